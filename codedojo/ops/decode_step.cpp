// decode_layers: every dense layer of a Llama-family model (transformer.py's Block) for a few
// new tokens against a KV cache (decode.py sends up to 16), as one call: a decode step (one
// token for each of B sequences), a speculative verification pass (k + 1 tokens of one
// sequence), or a short prefill.
//
// At batch 1 a decode step reads every weight once (about 0.5 GB for SmolLM2-135M in float32),
// which the small-row kernel streams near the machine's read bandwidth. Run op by op from
// Python, the same step also spends two thirds as long again (11 of 28 ms here) on about a
// thousand small tensor ops between the matrix multiplies (norms, RoPE, cache writes,
// attention, residual adds) and on their dispatch. Here those are plain loops over a few KB of
// activations, vectorised where they count (attention's dot products, the exponentials).
//
// The whole call is one parallel region: each thread owns a band of rows of every weight
// matrix (small_gemm.h's `rows`) and the threads meet at a barrier only where a result of all
// of them is needed next (five times a layer). Norms are computed by every thread for itself,
// residual adds and SwiGLU on each thread's own band. One fork for the call instead of one per
// matrix multiply.
#include <omp.h>

#include <cmath>
#include <vector>

#include "small_gemm.h"

namespace {

constexpr int kPerLayer = 7;  // attn_norm, wqkv, bqkv, wo, mlp_norm, w_gate_up, w_down

// y = w * (x / sqrt(mean(x^2) + eps)) for each of N rows of length D.
template <typename W>
void rms_norm(const float* x, const W* w, float* y, int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = 1.f / std::sqrt(float(ss / D) + eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = float(w[i]) * (xr[i] * r);
  }
}

// Rotate-half RoPE in place on one head: x * cos + [x2, x1] * sin (sin carries the sign of the
// rotation, as rope.py's table does).
void rope(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] + b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// softmax(q . k_t / sqrt(hd)) . v_t over the S cached positions of one head (cache entries
// float32 or bfloat16, computed in float32).
template <typename W>
void attend(const float* q, const W* k, const W* v, float* out, int64_t S, int64_t hd,
            std::vector<float>& p) {
  const float scale = 1.f / std::sqrt(float(hd));
  p.resize(S);
  const bool vec = hd % 16 == 0;
  float mx = -INFINITY;
  for (int64_t t = 0; t < S; ++t) {
    const W* kt = k + t * hd;
    float s = 0.f;
    if (vec) {  // a float sum is not reassociated by the compiler: spell the vectors out
      v16 a = {};
      for (int64_t i = 0; i < hd; i += 16) a += load(q + i) * load(kt + i);
      s = hsum(a);
    } else {
      for (int64_t i = 0; i < hd; ++i) s += q[i] * float(kt[i]);
    }
    p[t] = s * scale;
    mx = std::max(mx, p[t]);
  }
  float sum = 0.f;
  int64_t t = 0;
  for (; t + 16 <= S; t += 16) {
    const v16 e = vexp(load(&p[t]) - mx);
    store(&p[t], e);
    sum += hsum(e);
  }
  for (; t < S; ++t) sum += (p[t] = std::exp(p[t] - mx));
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < S; ++t) {
    const W* vt = v + t * hd;
    const float w = p[t] / sum;
    for (int64_t i = 0; i < hd; ++i) out[i] += w * float(vt[i]);
  }
}

// h = silu(g) * u over n floats.
void swiglu(const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 gv = load(g + i);
    store(h + i, gv / (1.f + vexp(-gv)) * load(u + i));
  }
  for (; i < n; ++i) h[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

template <typename W>
const W* ptr(const torch::Tensor& t, int64_t numel, const char* what, int64_t layer) {
  constexpr auto type = c10::CppTypeToScalarType<W>::value;
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == numel,
              "decode_layers: layer ", layer, " ", what, " must be a contiguous ",
              c10::toString(type), " tensor (the caches' type) of ", numel, " elements");
  return t.data_ptr<W>();
}

template <typename W>
struct Layer {
  const W *attn_norm, *wqkv, *bqkv, *wo, *mlp_norm, *wgu, *wdown;
};

// Thread `t` of `nt`'s share [lo, hi) of n items.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) {
  return {n * t / nt, n * (t + 1) / nt};
}

// decode_layers (below) for weights and caches of type W, its inputs checked.
template <typename W>
torch::Tensor run(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                  const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const std::vector<int64_t>& slot, const std::vector<int64_t>& pos,
                  const torch::Tensor& cos, const torch::Tensor& sin, int64_t H, int64_t K,
                  double eps) {
  const int64_t B = x_in.size(0), D = x_in.size(1), L = weights.size() / kPerLayer;
  const int64_t slots = k_cache.size(1), cap = k_cache.size(3), hd = k_cache.size(4);
  const int64_t QKV = (H + 2 * K) * hd;
  const int64_t F = weights[5].size(0) / 2;
  std::vector<Layer<W>> layers(L);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &weights[l * kPerLayer];
    layers[l] = {ptr<W>(w[0], D, "attn_norm", l), ptr<W>(w[1], QKV * D, "wqkv", l),
                 w[2].numel() ? ptr<W>(w[2], QKV, "bqkv", l) : nullptr,
                 ptr<W>(w[3], D * H * hd, "wo", l), ptr<W>(w[4], D, "mlp_norm", l),
                 ptr<W>(w[5], 2 * F * D, "w_gate_up", l), ptr<W>(w[6], D * F, "w_down", l)};
  }

  auto opts = x_in.options();
  torch::Tensor x = x_in.contiguous().clone();
  torch::Tensor qkv = torch::empty({B, QKV}, opts);
  torch::Tensor att = torch::empty({B, H * hd}, opts);
  torch::Tensor gu = torch::empty({B, 2 * F}, opts);
  torch::Tensor act = torch::empty({B, F}, opts);
  torch::Tensor out = torch::empty({B, D}, opts);
  float *xp = x.data_ptr<float>(), *qp = qkv.data_ptr<float>(), *ap = att.data_ptr<float>();
  float *gp = gu.data_ptr<float>(), *hp = act.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  W *kc = k_cache.data_ptr<W>(), *vc = v_cache.data_ptr<W>();

  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    std::vector<float> normed(B * D), p;
    // y[:, m0:m1] = a (B, Kin) @ w[m0:m1]^T, this thread's band of the M output columns.
    auto band = [&](const float* a, const W* w, float* y, int64_t Kin, int64_t M) {
      const auto [m0, m1] = share(M, t, nt);
      rows(a, w, y, B, m0, m1, Kin, M);
      return std::make_pair(m0, m1);
    };
    auto residual = [&](int64_t m0, int64_t m1) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = m0; i < m1; ++i) xp[b * D + i] += op[b * D + i];
    };
    for (int64_t l = 0; l < L; ++l) {
      const Layer<W>& w = layers[l];
      // Attention: norm, fused q/k/v projection, RoPE on q and k, cache write, attend, output.
      rms_norm(xp, w.attn_norm, normed.data(), B, D, float(eps));
      {
        const auto [m0, m1] = band(normed.data(), w.wqkv, qp, D, QKV);
        if (w.bqkv)
          for (int64_t b = 0; b < B; ++b)
            for (int64_t i = m0; i < m1; ++i) qp[b * QKV + i] += float(w.bqkv[i]);
      }
#pragma omp barrier
      {  // RoPE on the q and k heads; k and v into the cache
        const auto [i0, i1] = share(B * (H + K), t, nt);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / (H + K), h = i % (H + K);
          float* r = qp + b * QKV;
          rope(r + h * hd, cp + b * hd, sp + b * hd, hd);
          if (h >= H) {
            const int64_t g = h - H;
            const int64_t at = (((l * slots + slot[b]) * K + g) * cap + pos[b]) * hd;
            std::copy(r + h * hd, r + (h + 1) * hd, kc + at);
            std::copy(r + (H + K + g) * hd, r + (H + K + g + 1) * hd, vc + at);
          }
        }
      }
#pragma omp barrier
      {
        const auto [i0, i1] = share(B * H, t, nt);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / H, h = i % H, g = h / (H / K);
          const int64_t base = ((l * slots + slot[b]) * K + g) * cap * hd;
          attend(qp + b * QKV + h * hd, kc + base, vc + base, ap + b * H * hd + h * hd,
                 pos[b] + 1, hd, p);
        }
      }
#pragma omp barrier
      {
        const auto [m0, m1] = band(ap, w.wo, op, H * hd, D);
        residual(m0, m1);
      }
#pragma omp barrier
      // MLP: norm, fused gate/up projection (this thread's gate rows and the matching up rows,
      // so SwiGLU needs no other thread's), SwiGLU, down projection.
      rms_norm(xp, w.mlp_norm, normed.data(), B, D, float(eps));
      {
        const auto [f0, f1] = share(F, t, nt);
        rows(normed.data(), w.wgu, gp, B, f0, f1, D, 2 * F);
        rows(normed.data(), w.wgu, gp, B, F + f0, F + f1, D, 2 * F);
        for (int64_t b = 0; b < B; ++b)
          swiglu(gp + b * 2 * F + f0, gp + b * 2 * F + F + f0, hp + b * F + f0, f1 - f0);
      }
#pragma omp barrier
      {
        const auto [m0, m1] = band(hp, w.wdown, op, F, D);
        residual(m0, m1);
      }
#pragma omp barrier
    }
  }
  return x;
}

}  // namespace

// x (B, D): the embedded new tokens; returns the hidden states after the last layer (B, D).
// k_cache, v_cache (L, slots, K, capacity, hd): token b's key and value are written at position
// pos[b] of slot slot[b], and token b attends to positions [0, pos[b]] of its slot (every token
// of the call is written before any attends, so tokens of one sequence see each other causally).
// cos, sin (B, hd): the RoPE tables at each token's position. x, cos, sin and the result are
// float32; the weights and caches are float32, or all bfloat16 (sums in float32; see
// small_gemm.h for the products).
torch::Tensor decode_layers(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const std::vector<int64_t>& slot, const std::vector<int64_t>& pos,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t H,
                            int64_t K, double eps) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "decode_layers: x must be (B, D) float32");
  const int64_t B = x_in.size(0), D = x_in.size(1);
  TORCH_CHECK(B >= 1 && int64_t(slot.size()) == B && int64_t(pos.size()) == B,
              "decode_layers: at least one token, with a slot and a position each");
  TORCH_CHECK(!weights.empty() && weights.size() % kPerLayer == 0,
              "decode_layers: 7 tensors per layer expected");
  const int64_t L = weights.size() / kPerLayer;
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16) && v_cache.scalar_type() == type,
              "decode_layers: caches must be contiguous float32 or bfloat16 "
              "(L, slots, K, capacity, hd)");
  const int64_t slots = k_cache.size(1), cap = k_cache.size(3), hd = k_cache.size(4);
  TORCH_CHECK(k_cache.size(0) >= L && k_cache.size(2) == K && K >= 1 && H % K == 0,
              "decode_layers: cache shape does not match the layers and heads");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < slots, "decode_layers: slot ", slot[b],
                " outside the cache's ", slots, " slots");
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cap, "decode_layers: position ", pos[b],
                " outside the cache capacity ", cap);
  }
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * hd &&
                  sin.numel() == B * hd && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "decode_layers: cos and sin must be contiguous float32 (B, hd)");
  if (type == at::kBFloat16)
    return run<at::BFloat16>(x_in, weights, k_cache, v_cache, slot, pos, cos, sin, H, K, eps);
  return run<float>(x_in, weights, k_cache, v_cache, slot, pos, cos, sin, H, K, eps);
}

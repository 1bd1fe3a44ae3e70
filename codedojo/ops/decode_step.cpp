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
// activations; only the matrix multiplies (small_gemm.h) and attention run on ATen's thread
// pool.
#include <cmath>
#include <vector>

#include "small_gemm.h"

namespace {

constexpr int kPerLayer = 7;  // attn_norm, wqkv, bqkv, wo, mlp_norm, w_gate_up, w_down

// y = w * (x / sqrt(mean(x^2) + eps)) for each of N rows of length D.
void rms_norm(const float* x, const float* w, float* y, int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = 1.f / std::sqrt(float(ss / D) + eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = w[i] * (xr[i] * r);
  }
}

// Rotate-half RoPE in place over n_heads heads: x * cos + [x2, x1] * sin (sin carries the sign
// of the rotation, as rope.py's table does).
void rope(float* x, const float* cos, const float* sin, int64_t n_heads, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] + b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// softmax(q . k_t / sqrt(hd)) . v_t over the S cached positions of one head.
void attend(const float* q, const float* k, const float* v, float* out, int64_t S, int64_t hd,
            std::vector<float>& p) {
  const float scale = 1.f / std::sqrt(float(hd));
  p.resize(S);
  float mx = -INFINITY;
  for (int64_t t = 0; t < S; ++t) {
    const float* kt = k + t * hd;
    float s = 0.f;
    for (int64_t i = 0; i < hd; ++i) s += q[i] * kt[i];
    p[t] = s * scale;
    mx = std::max(mx, p[t]);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < S; ++t) sum += (p[t] = std::exp(p[t] - mx));
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < S; ++t) {
    const float* vt = v + t * hd;
    const float w = p[t] / sum;
    for (int64_t i = 0; i < hd; ++i) out[i] += w * vt[i];
  }
}

const float* ptr(const torch::Tensor& t, int64_t numel, const char* what, int64_t layer) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "decode_layers: layer ", layer, " ", what, " must be a contiguous float32 tensor "
              "of ", numel, " elements");
  return t.data_ptr<float>();
}

}  // namespace

// x (B, D): the embedded new tokens; returns the hidden states after the last layer (B, D).
// k_cache, v_cache (L, slots, K, capacity, hd): token b's key and value are written at position
// pos[b] of slot slot[b], and token b attends to positions [0, pos[b]] of its slot (every token
// of the call is written before any attends, so tokens of one sequence see each other causally).
// cos, sin (B, hd): the RoPE tables at each token's position.
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
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "decode_layers: caches must be contiguous float32 (L, slots, K, capacity, hd)");
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
  const int64_t QKV = (H + 2 * K) * hd;
  const int64_t F = weights[5].size(0) / 2;

  auto opts = x_in.options();
  torch::Tensor x = x_in.contiguous().clone();
  torch::Tensor hn = torch::empty({B, std::max(D, F)}, opts);
  torch::Tensor qkv = torch::empty({B, QKV}, opts);
  torch::Tensor att = torch::empty({B, H * hd}, opts);
  torch::Tensor out = torch::empty({B, std::max(D, 2 * F)}, opts);
  float *xp = x.data_ptr<float>(), *hp = hn.data_ptr<float>(), *qp = qkv.data_ptr<float>();
  float *ap = att.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();

  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &weights[l * kPerLayer];
    const float* attn_norm = ptr(w[0], D, "attn_norm", l);
    const float* wqkv = ptr(w[1], QKV * D, "wqkv", l);
    const float* bqkv = w[2].numel() ? ptr(w[2], QKV, "bqkv", l) : nullptr;
    const float* wo = ptr(w[3], D * H * hd, "wo", l);
    const float* mlp_norm = ptr(w[4], D, "mlp_norm", l);
    const float* wgu = ptr(w[5], 2 * F * D, "w_gate_up", l);
    const float* wdown = ptr(w[6], D * F, "w_down", l);

    // Attention: norm, fused q/k/v projection, RoPE on q and k, cache write, attend, output.
    rms_norm(xp, attn_norm, hp, B, D, float(eps));
    gemm_rows(hp, wqkv, qp, B, D, QKV);
    for (int64_t b = 0; b < B; ++b) {
      float* r = qp + b * QKV;
      if (bqkv)
        for (int64_t i = 0; i < QKV; ++i) r[i] += bqkv[i];
      rope(r, cp + b * hd, sp + b * hd, H + K, hd);
      for (int64_t g = 0; g < K; ++g) {
        const int64_t at = (((l * slots + slot[b]) * K + g) * cap + pos[b]) * hd;
        std::copy(r + (H + g) * hd, r + (H + g + 1) * hd, kc + at);
        std::copy(r + (H + K + g) * hd, r + (H + K + g + 1) * hd, vc + at);
      }
    }
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> p;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, h = i % H, g = h / (H / K);
        const int64_t base = ((l * slots + slot[b]) * K + g) * cap * hd;
        attend(qp + b * QKV + h * hd, kc + base, vc + base, ap + b * H * hd + h * hd,
               pos[b] + 1, hd, p);
      }
    });
    gemm_rows(ap, wo, op, B, H * hd, D);
    for (int64_t i = 0; i < B * D; ++i) xp[i] += op[i];

    // MLP: norm, fused gate/up projection, SwiGLU, down projection.
    rms_norm(xp, mlp_norm, hp, B, D, float(eps));
    gemm_rows(hp, wgu, op, B, D, 2 * F);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < F; ++i) {
        const float g = op[b * 2 * F + i];
        hp[b * F + i] = g / (1.f + std::exp(-g)) * op[b * 2 * F + F + i];
      }
    gemm_rows(hp, wdown, op, B, F, D);
    for (int64_t i = 0; i < B * D; ++i) xp[i] += op[i];
  }
  return x;
}

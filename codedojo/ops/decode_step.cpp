// FusedLayers: every dense layer of a Llama-family model (transformer.py's Block) for a few new
// tokens against a KV cache, as one call, and optionally the token embedding before them and
// the final norm and output head after them: a decode step (one token for each of B
// sequences), a speculative verification pass (k + 1 tokens of one sequence), or a short
// prefill.
//
// At batch 1 a decode step reads every weight once (about 0.5 GB for SmolLM2-135M in float32),
// which the kernels stream near the machine's read bandwidth: float32 matrices from a copy
// laid out in panels (panels.h; packed when the object is built, again when a weight changes
// in place), bfloat16 ones row by row as they are (small_gemm.h's `rows`). Run op by op from
// Python, the same step also spends two thirds as long again (11 of 28 ms here) on about a
// thousand small tensor ops between the matrix multiplies (norms, RoPE, cache writes,
// attention, residual adds) and on their dispatch. Here those are plain loops over a few KB of
// activations, vectorised where they count (attention's dot products, the exponentials). The
// weights are listed and checked once, when the object is built; a step's call passes only
// token ids, cache slots and positions, and returns the logits: the fifty or so tensor ops a
// step spent around the layers (embedding, RoPE tables, final norm, head) cost about 1 ms of
// a 17 ms step, run between two passes over 0.5 GB that leave every cache cold.
//
// The whole call is one parallel region: each thread owns a band of the output columns of
// every weight matrix (whole panels, or rows) and the threads meet at a barrier only where a
// result of all of them is needed next (five times a layer). Norms are computed by every
// thread for itself, residual adds and SwiGLU on each thread's own band. One fork for the call
// instead of one per matrix multiply.
#include <omp.h>
#include <pybind11/functional.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "panels.h"
#include "small_gemm.h"

namespace {

constexpr int kPerLayer = 7;  // attn_norm, wqkv, bqkv, wo, mlp_norm, w_gate_up, w_down
// A layer's float32 matrices as panels (panels.h): wqkv, wo, the gate and up halves of
// w_gate_up, w_down.
constexpr int kPanelsPerLayer = 5;

// y = w * (x / sqrt(mean(x^2) + eps)) for each of N rows of length D (w null: no weight).
template <typename W>
void rms_norm(const float* x, const W* w, float* y, int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = 1.f / std::sqrt(float(ss / D) + eps);
    if (w == nullptr)
      for (int64_t i = 0; i < D; ++i) y[n * D + i] = xr[i] * r;
    else
      for (int64_t i = 0; i < D; ++i) y[n * D + i] = float(w[i]) * (xr[i] * r);
  }
}

// Rotate-half RoPE in place on one head: x * cos + [x2, x1] * sin (sin carries the sign of the
// rotation, as rope.py's table does).
void rotate(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] + b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// softmax(q . k_t / sqrt(hd)) . v_t over S cached positions of one head (cache entries
// float32 or bfloat16, computed in float32): positions 0 .. S-1, or, given `path`, positions
// 0 .. S-1-len(path) followed by those `path` lists (a token of a draft tree sees the cache
// before the tree and its own ancestors in it). The sums run over the same values in the same
// order either way, so a tree's node computes what the same tokens decoded as a chain would.
template <typename W>
void attend(const float* q, const W* k, const W* v, float* out, int64_t S, int64_t hd,
            std::vector<float>& p, const std::vector<int64_t>* path = nullptr) {
  const float scale = 1.f / std::sqrt(float(hd));
  p.resize(S);
  const bool vec = hd % kLanes == 0;
  const int64_t before = path ? S - int64_t(path->size()) : S;
  auto at = [&](int64_t t) { return t < before ? t : (*path)[t - before]; };
  float mx = -INFINITY;
  for (int64_t t = 0; t < S; ++t) {
    const W* kt = k + at(t) * hd;
    float s = 0.f;
    if (vec) {  // a float sum is not reassociated by the compiler: spell the vectors out
      vf a = {};
      for (int64_t i = 0; i < hd; i += kLanes) a += load(q + i) * load(kt + i);
      s = hsum(a);
    } else {
      for (int64_t i = 0; i < hd; ++i) s += q[i] * float(kt[i]);
    }
    p[t] = s * scale;
    mx = std::max(mx, p[t]);
  }
  float sum = 0.f;
  int64_t t = 0;
  for (; t + kLanes <= S; t += kLanes) {
    const vf e = vexp(load(&p[t]) - mx);
    store(&p[t], e);
    sum += hsum(e);
  }
  for (; t < S; ++t) sum += (p[t] = std::exp(p[t] - mx));
  for (int64_t i = 0; i < hd; ++i) out[i] = 0.f;
  for (int64_t t = 0; t < S; ++t) {
    const W* vt = v + at(t) * hd;
    const float w = p[t] / sum;
    for (int64_t i = 0; i < hd; ++i) out[i] += w * float(vt[i]);
  }
}

// h = silu(g) * u over n floats.
void swiglu(const float* g, const float* u, float* h, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf gv = load(g + i);
    store(h + i, gv / (1.f + vexp(-gv)) * load(u + i));
  }
  for (; i < n; ++i) h[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

template <typename W>
struct Layer {
  const W *attn_norm, *wqkv, *bqkv, *wo, *mlp_norm, *wgu, *wdown;
};

// Thread `t` of `nt`'s share [lo, hi) of n items.
inline std::pair<int64_t, int64_t> share(int64_t n, int t, int nt) {
  return {n * t / nt, n * (t + 1) / nt};
}

// Numbers in error messages go through std::to_string, never `<<`: inserting an integer into a
// stream runs libstdc++'s number formatting as compiled into this library, which crashed
// (SIGSEGV in std::codecvt) on a machine whose compiler's libstdc++ differed from the one the
// process had loaded. Text insertions are safe there, as are all the kernels' own paths.
void check_tensor(const torch::Tensor& t, at::ScalarType type, std::vector<int64_t> shape,
                  const char* what, int64_t layer = -1) {
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
  TORCH_CHECK(t.defined() && t.scalar_type() == type && t.is_contiguous() &&
                  t.sizes() == c10::IntArrayRef(shape),
              "FusedLayers: ", layer >= 0 ? "layer " + std::to_string(layer) + " " : "", what,
              " must be a contiguous ", c10::toString(type), " tensor (the weights' type) of "
              "shape (", dims, ")");
}

}  // namespace

// Layers of a Llama-family model held once, run for a few new tokens per call (see the top of
// this file). The tensors are kept, not copied: weights updated in place are seen by the next
// call.
class FusedLayers {
 public:
  // weights: 7 a layer (attn_norm, wqkv, bqkv or an empty tensor, wo, mlp_norm, w_gate_up,
  // w_down), all float32 or all bfloat16. cos, sin (positions, hd) float32: the RoPE tables.
  // embed (vocab, D): the token embeddings, or an empty tensor (callers then pass x). norm (D)
  // and head (V, D): the final norm and output projection, or empty tensors (no logits).
  // mix: an MTP module's input, [norm_h (D), norm_e (D), proj (D, 2D)]: the first layer's input
  // is then proj [RMSNorm_h(x); RMSNorm_e(embed[token])], or empty. With a fourth tensor, fuse
  // (D, n D), x's rows are [h, t_1, ..., t_n] (the tapped layers' states after the previous
  // depth's), and the module reads h + fuse [RMSNorm(t_1); ...; RMSNorm(t_n)] (norms without
  // weights) in place of x. memory(n): n uninitialised float32 values, where float32 matrices
  // are laid out in panels (panels.h; the caller gives 2 MB pages); not called for bfloat16
  // weights.
  FusedLayers(std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
              int64_t H, int64_t K, double eps, torch::Tensor embed, torch::Tensor norm,
              torch::Tensor head, std::vector<torch::Tensor> mix,
              const std::function<torch::Tensor(int64_t)>& memory)
      : weights_(std::move(weights)), cos_(std::move(cos)), sin_(std::move(sin)),
        embed_(std::move(embed)), norm_(std::move(norm)), head_(std::move(head)),
        mix_(std::move(mix)), H_(H), K_(K), eps_(float(eps)) {
    TORCH_CHECK(!weights_.empty() && weights_.size() % kPerLayer == 0,
                "FusedLayers: 7 tensors per layer expected");
    type_ = weights_[1].scalar_type();
    TORCH_CHECK(type_ == at::kFloat || type_ == at::kBFloat16,
                "FusedLayers: weights must be float32 or bfloat16");
    TORCH_CHECK(cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.is_contiguous() &&
                    sin_.is_contiguous() && cos_.scalar_type() == at::kFloat &&
                    sin_.scalar_type() == at::kFloat,
                "FusedLayers: cos and sin must be contiguous float32 (positions, head_dim)");
    TORCH_CHECK(K >= 1 && H % K == 0, "FusedLayers: ", std::to_string(H), " heads cannot share ", std::to_string(K),
                " key/value heads");
    L_ = weights_.size() / kPerLayer;
    D_ = weights_[0].numel();
    hd_ = cos_.size(1);
    QKV_ = (H + 2 * K) * hd_;
    F_ = weights_[5].numel() / (2 * D_);
    for (int64_t l = 0; l < L_; ++l) {
      const torch::Tensor* w = &weights_[l * kPerLayer];
      check_tensor(w[0], type_, {D_}, "attn_norm", l);
      check_tensor(w[1], type_, {QKV_, D_}, "wqkv", l);
      if (w[2].numel()) check_tensor(w[2], type_, {QKV_}, "bqkv", l);
      check_tensor(w[3], type_, {D_, H * hd_}, "wo", l);
      check_tensor(w[4], type_, {D_}, "mlp_norm", l);
      check_tensor(w[5], type_, {2 * F_, D_}, "w_gate_up", l);
      check_tensor(w[6], type_, {D_, F_}, "w_down", l);
    }
    vocab_ = embed_.numel() ? embed_.size(0) : 0;
    V_ = head_.numel() ? head_.size(0) : 0;
    if (embed_.numel()) check_tensor(embed_, type_, {vocab_, D_}, "embed");
    if (head_.numel()) {
      check_tensor(head_, type_, {V_, D_}, "head");
      check_tensor(norm_, type_, {D_}, "norm");
    }
    TORCH_CHECK(mix_.empty() || ((mix_.size() == 3 || mix_.size() == 4) && embed_.numel()),
                "FusedLayers: mix is [norm_h, norm_e, proj] or [norm_h, norm_e, proj, fuse], "
                "with an embedding table");
    if (!mix_.empty()) {
      check_tensor(mix_[0], type_, {D_}, "mix norm_h");
      check_tensor(mix_[1], type_, {D_}, "mix norm_e");
      check_tensor(mix_[2], type_, {D_, 2 * D_}, "mix proj");
    }
    if (mix_.size() == 4) {
      TORCH_CHECK(mix_[3].dim() == 2 && mix_[3].size(0) == D_ && mix_[3].size(1) > 0 &&
                      mix_[3].size(1) % D_ == 0,
                  "FusedLayers: mix fuse must be (", std::to_string(D_), ", n * ",
                  std::to_string(D_), ")");
      check_tensor(mix_[3], type_, {D_, mix_[3].size(1)}, "mix fuse");
      FI_ = mix_[3].size(1);
    }
    if (type_ == at::kFloat) {  // bfloat16 matrices are read as they are, row by row
      for (int64_t l = 0; l < L_; ++l) {
        const torch::Tensor* w = &weights_[l * kPerLayer];
        panels_.emplace_back(w[1], 0, QKV_);
        panels_.emplace_back(w[3], 0, D_);
        panels_.emplace_back(w[5], 0, F_);
        panels_.emplace_back(w[5], F_, F_);
        panels_.emplace_back(w[6], 0, D_);
      }
      if (V_) panels_.emplace_back(head_, 0, V_);
      if (!mix_.empty()) panels_.emplace_back(mix_[2], 0, D_);
      if (FI_) panels_.emplace_back(mix_[3], 0, D_);
      int64_t total = 0;  // each matrix 64-byte aligned
      for (const Panels& p : panels_) total += (p.floats() + 15) / 16 * 16;
      panel_memory_ = memory(total);
      TORCH_CHECK(panel_memory_.scalar_type() == at::kFloat && panel_memory_.is_contiguous() &&
                      panel_memory_.numel() >= total,
                  "FusedLayers: memory(", std::to_string(total), ") must give that many contiguous float32");
      float* at = panel_memory_.data_ptr<float>();
      for (Panels& p : panels_) {
        p.place(at);
        at += (p.floats() + 15) / 16 * 16;
      }
    }
  }

  // The new tokens: x (N, D) float32 embedded, or their ids `tokens` (x empty) looked up in
  // `embed`; with `mix`, both: x the previous depth's hidden states, `tokens` the ids mixed
  // in. Token n's key and value go to position pos[n] of cache slot slot[n] (caches laid
  // out (layers, slots, K, capacity, hd)) and it attends to positions [0, pos[n]] of that slot,
  // tokens of this call included (every token's key is written before any attends). Returns
  // the hidden states after the last layer (N, D) float32 and, for the rows `logit_rows`, the
  // logits (final norm and output projection; (R, V) float32, (0, V) when none is asked).
  // `taps` (layer indexes, increasing): the states after those layers too, each (N, D) beside
  // the last ones: (N, (1 + taps) D), [last, taps[0], taps[1], ...] (an MTP module's fused
  // features).
  // A tree of tokens (draft trees: several continuations of one sequence in one pass): with
  // `parent` (N entries, the index in this call of a token's parent, or -1) and `rope` (N
  // RoPE positions, a parent's plus one), token n is rotated as at position rope[n] and
  // attends to positions [0, rope[r]) of its slot, r the first of its ancestors in the call,
  // and then to the positions of those ancestors and its own.
  std::tuple<torch::Tensor, torch::Tensor> run(const torch::Tensor& x,
                                               const std::vector<int64_t>& tokens,
                                               const torch::Tensor& k_cache,
                                               const torch::Tensor& v_cache,
                                               const std::vector<int64_t>& slot,
                                               const std::vector<int64_t>& pos,
                                               const std::vector<int64_t>& logit_rows,
                                               const std::vector<int64_t>& rope,
                                               const std::vector<int64_t>& parent,
                                               const std::vector<int64_t>& taps) {
    const bool embedded = x.numel() > 0, mixed = !mix_.empty();
    TORCH_CHECK(mixed ? embedded && x.size(0) == int64_t(tokens.size())
                      : embedded != !tokens.empty(),
                mixed ? "FusedLayers: x and a token for each of its rows expected (mix)"
                      : "FusedLayers: pass either x or tokens");
    const int64_t N = embedded ? x.size(0) : int64_t(tokens.size());
    if (embedded) {
      const int64_t width = D_ + (mixed ? FI_ : 0);  // with fuse, [h, tapped states]
      TORCH_CHECK(x.dim() == 2 && x.size(1) == width && x.scalar_type() == at::kFloat,
                  "FusedLayers: x must be (N, ", std::to_string(width), ") float32");
    } else {
      TORCH_CHECK(embed_.numel(), "FusedLayers: token ids given, but no embedding table held");
    }
    TORCH_CHECK(int64_t(slot.size()) == N && int64_t(pos.size()) == N,
                "FusedLayers: a slot and a position for each of the ", std::to_string(N),
                " tokens expected");
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_cache.scalar_type() == type_ && v_cache.scalar_type() == type_,
                "FusedLayers: caches must be contiguous (layers, slots, K, capacity, hd) of the "
                "weights' type, ", c10::toString(type_));
    TORCH_CHECK(k_cache.size(0) >= L_ && k_cache.size(2) == K_ && k_cache.size(4) == hd_,
                "FusedLayers: cache shape does not match the layers and heads");
    const int64_t slots = k_cache.size(1), cap = k_cache.size(3);
    const bool tree = !parent.empty();  // positions in the cache, and RoPE positions apart
    for (int64_t n = 0; n < N; ++n) {
      TORCH_CHECK(slot[n] >= 0 && slot[n] < slots, "FusedLayers: slot ",
                  std::to_string(slot[n]), " outside the cache's ", std::to_string(slots), " slots");
      TORCH_CHECK(pos[n] >= 0 && pos[n] < cap && (tree || pos[n] < cos_.size(0)),
                  "FusedLayers: position ", std::to_string(pos[n]), " outside the cache capacity ",
                  std::to_string(cap), " or the RoPE table's ", std::to_string(cos_.size(0)),
                  " positions");
      TORCH_CHECK(tokens.empty() || (tokens[n] >= 0 && tokens[n] < vocab_),
                  "FusedLayers: token ", std::to_string(tokens[n]),
                  " outside the vocabulary of ", std::to_string(vocab_));
    }
    TORCH_CHECK(rope.size() == parent.size() && (!tree || int64_t(parent.size()) == N),
                "FusedLayers: a tree needs a parent and a RoPE position for each of the ",
                std::to_string(N), " tokens");
    std::vector<std::vector<int64_t>> paths(tree ? N : 0);  // each token's ancestors' positions
    for (int64_t n = 0; tree && n < N; ++n) {
      const int64_t up = parent[n];
      TORCH_CHECK(up >= -1 && up < n &&
                      (up < 0 || (slot[up] == slot[n] && rope[up] + 1 == rope[n])),
                  "FusedLayers: token ", std::to_string(n), "'s parent ", std::to_string(up),
                  " must come before it, in its slot, one RoPE position earlier");
      TORCH_CHECK(rope[n] >= 0 && rope[n] < cos_.size(0) && (up >= 0 || rope[n] <= pos[n]),
                  "FusedLayers: RoPE position ", std::to_string(rope[n]), " of token ",
                  std::to_string(n), " outside the table or after the cache it sees");
      if (up >= 0) paths[n] = paths[up];
      paths[n].push_back(pos[n]);
    }
    for (int64_t r : logit_rows)
      TORCH_CHECK(head_.numel() && r >= 0 && r < N, "FusedLayers: logits asked of row ",
                  std::to_string(r),
                  head_.numel() ? " of a call of " + std::to_string(N) + " tokens"
                                : ", but no output head held");
    for (size_t j = 0; j < taps.size(); ++j)
      TORCH_CHECK(taps[j] >= 0 && taps[j] < L_ && (j == 0 || taps[j - 1] < taps[j]),
                  "FusedLayers: taps must be increasing layer indexes below ",
                  std::to_string(L_), "; got ", std::to_string(taps[j]), " at ",
                  std::to_string(j));
    if (type_ == at::kBFloat16)
      return run_typed<at::BFloat16>(x, tokens, k_cache, v_cache, slot, tree ? rope : pos,
                                     logit_rows, paths, taps);
    // Weights changed in place since the last call are packed again, by one caller while no
    // other reads the panels: calls from several threads read them together otherwise.
    std::shared_lock<std::shared_mutex> reading(panels_mutex_);
    if (std::any_of(panels_.begin(), panels_.end(), [](const Panels& p) { return p.stale(); })) {
      reading.unlock();
      {
        std::unique_lock<std::shared_mutex> packing(panels_mutex_);
        for (Panels& p : panels_) p.refresh();
      }
      reading.lock();
    }
    return run_typed<float>(x, tokens, k_cache, v_cache, slot, tree ? rope : pos, logit_rows,
                            paths, taps);
  }

 private:
  template <typename W>
  std::tuple<torch::Tensor, torch::Tensor> run_typed(
      const torch::Tensor& x_in, const std::vector<int64_t>& tokens, const torch::Tensor& k_cache,
      const torch::Tensor& v_cache, const std::vector<int64_t>& slot,
      const std::vector<int64_t>& rope, const std::vector<int64_t>& logit_rows,
      const std::vector<std::vector<int64_t>>& paths, const std::vector<int64_t>& taps) const {
    // rope[n]: token n's RoPE position; its cache position is rope[n] too, or, in a tree, the
    // last of paths[n] (the positions of its ancestors and its own)
    const int64_t B = x_in.numel() ? x_in.size(0) : int64_t(tokens.size());
    const bool mixed = !mix_.empty();
    const int64_t D = D_, H = H_, K = K_, hd = hd_, QKV = QKV_, F = F_, L = L_, V = V_;
    const int64_t R = logit_rows.size();
    const int64_t slots = k_cache.size(1), cap = k_cache.size(3);
    std::vector<Layer<W>> layers(L);
    for (int64_t l = 0; l < L; ++l) {
      const torch::Tensor* w = &weights_[l * kPerLayer];
      layers[l] = {w[0].data_ptr<W>(), w[1].data_ptr<W>(),
                   w[2].numel() ? w[2].data_ptr<W>() : nullptr, w[3].data_ptr<W>(),
                   w[4].data_ptr<W>(), w[5].data_ptr<W>(), w[6].data_ptr<W>()};
    }

    auto opts = torch::TensorOptions().dtype(at::kFloat);
    torch::Tensor x, mixin;
    if (x_in.numel() && !mixed) {
      x = x_in.contiguous().clone();
    } else {  // the embedding rows of the tokens (with mix, the second half of its input)
      x = torch::empty({B, D}, opts);
      if (mixed) mixin = torch::empty({B, 2 * D}, opts);
      float* xe = (mixed ? mixin : x).data_ptr<float>();
      const int64_t stride = mixed ? 2 * D : D, at = mixed ? D : 0;
      const W* table = embed_.data_ptr<W>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < D; ++i) xe[b * stride + at + i] = float(table[tokens[b] * D + i]);
    }
    // with fuse: the tapped states normed (B, FI), and what the module reads of the previous
    // depth, h + fuse [them] (B, D), which the parallel region computes
    const int64_t FI = FI_, XW = D + (mixed ? FI : 0);
    torch::Tensor h_in, tapped, h_read;
    if (mixed) {  // [RMSNorm_h(x); RMSNorm_e(e)] row by row, in place (with fuse, the first
                  // half once h_read is known)
      h_in = x_in.contiguous();
      float* m = mixin.data_ptr<float>();
      const float* h = h_in.data_ptr<float>();
      if (FI) {
        tapped = torch::empty({B, FI}, opts);
        h_read = torch::empty({B, D}, opts);
        for (int64_t b = 0; b < B; ++b)  // the row's FI / D tapped states, each normed
          rms_norm<W>(h + b * XW + D, nullptr, tapped.data_ptr<float>() + b * FI, FI / D, D,
                      eps_);
      }
      for (int64_t b = 0; b < B; ++b) {
        if (!FI) rms_norm(h + b * D, mix_[0].data_ptr<W>(), m + b * 2 * D, 1, D, eps_);
        rms_norm(m + b * 2 * D + D, mix_[1].data_ptr<W>(), m + b * 2 * D + D, 1, D, eps_);
      }
    }
    torch::Tensor qkv = torch::empty({B, QKV}, opts);
    torch::Tensor att = torch::empty({B, H * hd}, opts);
    torch::Tensor gu = torch::empty({B, 2 * F}, opts);
    torch::Tensor act = torch::empty({B, F}, opts);
    torch::Tensor out = torch::empty({B, D}, opts);
    torch::Tensor logits = torch::empty({R, V}, opts);
    const int64_t NT = taps.size(), FD = (1 + NT) * D;  // the tapped states' row width
    torch::Tensor feat = NT ? torch::empty({B, FD}, opts) : x;
    float* fp = feat.data_ptr<float>();
    float *xp = x.data_ptr<float>(), *qp = qkv.data_ptr<float>(), *ap = att.data_ptr<float>();
    float *gp = gu.data_ptr<float>(), *hp = act.data_ptr<float>(), *op = out.data_ptr<float>();
    float* lp = logits.data_ptr<float>();
    const float *cp = cos_.data_ptr<float>(), *sp = sin_.data_ptr<float>();
    const W* norm = R ? norm_.data_ptr<W>() : nullptr;
    const W* head = R ? head_.data_ptr<W>() : nullptr;
    W *kc = k_cache.data_ptr<W>(), *vc = v_cache.data_ptr<W>();
    const float eps = eps_;

    const Panels* head_panels = panel(L * kPanelsPerLayer);  // the head's, then mix proj's
    const Panels* mix_panels = mixed ? panel(L * kPanelsPerLayer + (V ? 1 : 0)) : nullptr;
    const Panels* fuse_panels = FI ? panel(L * kPanelsPerLayer + (V ? 1 : 0) + 1) : nullptr;
    const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      std::vector<float> normed(std::max(B, R) * D), p;
      // y[:, m0:m1] = a (N, Kin) @ w^T for this thread's band [m0, m1) of the M output
      // columns (a whole number of panels for float32 weights, `pw`; bfloat16 ones are read
      // row by row from w); ldy is y's row stride.
      auto band = [&](const float* a, const W* w, const Panels* pw, float* y, int64_t ldy,
                      int64_t N, int64_t Kin, int64_t M) {
        if constexpr (std::is_same_v<W, float>) {
          const auto [p0, p1] = share(pw->count(), t, nt);
          panel_rows(a, *pw, y, N, p0, p1, ldy);
          return std::make_pair(std::min(p0 * kPanel, M), std::min(p1 * kPanel, M));
        } else {
          const auto [m0, m1] = share(M, t, nt);
          rows(a, w, y, N, m0, m1, Kin, ldy);
          return std::make_pair(m0, m1);
        }
      };
      auto residual = [&](int64_t m0, int64_t m1) {
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = m0; i < m1; ++i) xp[b * D + i] += op[b * D + i];
      };
      if (FI) {  // h_read = h + fuse [tapped], then its norm into the first half of mixin
        float* rp = h_read.data_ptr<float>();
        const float* h = h_in.data_ptr<float>();
        const auto [m0, m1] = band(tapped.data_ptr<float>(), mix_[3].data_ptr<W>(),
                                   fuse_panels, rp, D, B, FI, D);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = m0; i < m1; ++i) rp[b * D + i] += h[b * XW + i];
#pragma omp barrier
        const auto [b0, b1] = share(B, t, nt);
        for (int64_t b = b0; b < b1; ++b)
          rms_norm(rp + b * D, mix_[0].data_ptr<W>(), mixin.data_ptr<float>() + b * 2 * D, 1,
                   D, eps);
#pragma omp barrier
      }
      if (mixed) {  // the MTP module's projection of its two inputs
        band(mixin.data_ptr<float>(), mix_[2].data_ptr<W>(), mix_panels, xp, D, B, 2 * D, D);
#pragma omp barrier
      }
      for (int64_t l = 0; l < L; ++l) {
        const Layer<W>& w = layers[l];
        auto panels = [&](int i) { return panel(l * kPanelsPerLayer + i); };
        // Attention: norm, fused q/k/v projection, RoPE on q and k, cache write, attend, output.
        rms_norm(xp, w.attn_norm, normed.data(), B, D, eps);
        {
          const auto [m0, m1] = band(normed.data(), w.wqkv, panels(0), qp, QKV, B, D, QKV);
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
            rotate(r + h * hd, cp + rope[b] * hd, sp + rope[b] * hd, hd);
            if (h >= H) {
              const int64_t g = h - H, stored = paths.empty() ? rope[b] : paths[b].back();
              const int64_t at = (((l * slots + slot[b]) * K + g) * cap + stored) * hd;
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
                   rope[b] + 1, hd, p, paths.empty() ? nullptr : &paths[b]);
          }
        }
#pragma omp barrier
        {
          const auto [m0, m1] = band(ap, w.wo, panels(1), op, D, B, H * hd, D);
          residual(m0, m1);
        }
#pragma omp barrier
        // MLP: norm, fused gate/up projection (this thread's gate rows and the matching up
        // rows, so SwiGLU needs no other thread's), SwiGLU, down projection.
        rms_norm(xp, w.mlp_norm, normed.data(), B, D, eps);
        {
          const auto [f0, f1] = band(normed.data(), w.wgu, panels(2), gp, 2 * F, B, D, F);
          band(normed.data(), w.wgu + F * D, panels(3), gp + F, 2 * F, B, D, F);
          for (int64_t b = 0; b < B; ++b)
            swiglu(gp + b * 2 * F + f0, gp + b * 2 * F + F + f0, hp + b * F + f0, f1 - f0);
        }
#pragma omp barrier
        {
          const auto [m0, m1] = band(hp, w.wdown, panels(4), op, D, B, F, D);
          residual(m0, m1);
        }
#pragma omp barrier
        // a tapped layer's states: this thread's rows (x is next written after a barrier)
        if (const auto j = std::find(taps.begin(), taps.end(), l); j != taps.end()) {
          const int64_t at = (1 + (j - taps.begin())) * D;
          const auto [b0, b1] = share(B, t, nt);
          for (int64_t b = b0; b < b1; ++b)
            std::copy(xp + b * D, xp + (b + 1) * D, fp + b * FD + at);
        }
      }
      if (R) {  // final norm of the rows asked for; this thread's band of the vocabulary
        for (int64_t r = 0; r < R; ++r)
          rms_norm(xp + logit_rows[r] * D, norm, normed.data() + r * D, 1, D, eps);
        band(normed.data(), head, head_panels, lp, V, R, D, V);
      }
    }
    if (NT)
      for (int64_t b = 0; b < B; ++b) std::copy(xp + b * D, xp + (b + 1) * D, fp + b * FD);
    return {feat, logits};
  }

  std::vector<torch::Tensor> weights_;
  torch::Tensor cos_, sin_, embed_, norm_, head_;
  std::vector<torch::Tensor> mix_;
  // Panels i, in the order the constructor lists them; nullptr for bfloat16 weights (none).
  const Panels* panel(int64_t i) const { return panels_.empty() ? nullptr : &panels_[i]; }

  std::vector<Panels> panels_;  // float32 weights only, in panel_memory_
  std::shared_mutex panels_mutex_;  // shared by the calls reading the panels, held to pack
  torch::Tensor panel_memory_;
  int64_t H_, K_;
  float eps_;
  at::ScalarType type_;
  int64_t L_, D_, hd_, QKV_, F_, V_, vocab_;
  int64_t FI_ = 0;  // the width of mix's fuse input (n D), or 0
};

void bind_fused_layers(pybind11::module& m) {
  pybind11::class_<FusedLayers>(m, "FusedLayers", pybind11::module_local())
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t,
                          int64_t, double, torch::Tensor, torch::Tensor, torch::Tensor,
                          std::vector<torch::Tensor>,
                          const std::function<torch::Tensor(int64_t)>&>())
      .def("run", &FusedLayers::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}

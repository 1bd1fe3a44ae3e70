// Float32 weight matrices laid out for the fused decode layers (decode_step.cpp): `Panels`.
//
// A weight matrix w (M, K) stored row by row is multiplied as dot products (small_gemm.h): each
// output a sum over one weight row, each activation row loaded again for every weight row. Here
// it is copied once into panels of 32 output columns: panel p holds, for each k in turn, the 32
// weights w[32p + j, k] (zeros past M), so a thread reads its panels as sequential streams
// and every product is y[n, m] += x[n, k] * w[m, k] for k = 0, 1, 2... in one vector lane: an
// activation broadcast from L1 meets the panel's 32 weights (two vectors with AVX-512, four
// with AVX2), each loaded once for all the rows of a tile.
//
// - Every output is the same sequence of multiply-adds whatever the number of rows and however
//   they are tiled, so a row's result does not depend on the rows beside it (a verification
//   pass gives the logits of one-token steps bit for bit, a batch the tokens of its requests
//   alone).
// - One row (a decode step) streams the panels near the read bandwidth; many rows (a prefill,
//   a batch) go kRowTile at a time over a panel held in L2, each weight load shared by eight
//   multiply-adds with AVX-512 (two with AVX2) where the dot-product tiles share one by four.
//
// Measured here on SmolLM2-135M's layers against the dot-product tiles, the same process
// alternating: passes of 8 / 25 / 128 tokens 0.75 / 0.80 / 0.67x the time, a one-token step
// even (0.99-1.02x; 1.10-1.26x with one stream a thread instead of two, or with the panels of
// each matrix in memory of their own, most of it then in 4 KB pages). Tried and left out:
// 64-column panels (a 512 MB product, 2 threads: 0.98x a sum's rate against 1.06x), fetching
// the next panel into L2 during the passes from L2 (1.05-1.14x slower), and idle threads taking
// panels from the others' bands at one row (work stealing: 1.00x).
//
// The copy costs memory (as much again as the float32 weights) and must follow the weights:
// `Panels::refresh` packs again when the source's version counter has moved (an optimizer step,
// `copy_`), so weights updated in place are seen by the next call.
#pragma once
#include <algorithm>

#include "vec.h"

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: 2 vectors (AVX-512) or 4 (AVX2)

// Rows eight at a time with AVX-512 (16 accumulators of its 32 registers), two at a time with
// AVX2 (8 of its 16).
constexpr int kRowTile = kLanes == 16 ? 8 : 2;
constexpr int kParts = kPanel / kLanes;  // vectors a panel row

// Rows [m0, m0 + M) of a row-major (*, K) float32 tensor as panels, in memory given by
// `place` (the owner's, one buffer for all its matrices).
class Panels {
 public:
  Panels(torch::Tensor src, int64_t m0, int64_t M)
      : src_(std::move(src)), m0_(m0), M_(M), K_(src_.size(-1)) {}

  int64_t count() const { return (M_ + kPanel - 1) / kPanel; }
  int64_t floats() const { return count() * kPanel * K_; }
  int64_t M() const { return M_; }
  int64_t K() const { return K_; }
  const float* data() const { return data_; }

  void place(float* data) {
    data_ = data;
    pack();
  }

  // Packs again if the source changed in place since the last packing (inference tensors
  // keep no version counter: made under torch.inference_mode, they are packed once).
  void refresh() {
    if (stale()) pack();
  }
  bool stale() const { return version() != version_; }

 private:
  int64_t version() const { return src_.is_inference() ? 0 : src_._version(); }

  void pack() {
    const int64_t now = version();
    const float* w = src_.data_ptr<float>() + m0_ * K_;
    float* out = data_;
    const int64_t K = K_, M = M_;
    at::parallel_for(0, count(), 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        float* panel = out + p * kPanel * K;
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t m = p * kPanel + j;
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + j] = m < M ? w[m * K + k] : 0.f;
        }
      }
    });
    version_ = now;
  }

  torch::Tensor src_;
  float* data_ = nullptr;
  int64_t m0_, M_, K_, version_ = -1;
};

// Activation rows x[n + b] (b < NB; length K) @ NP panels, panel i into columns c[i], ...,
// c[i] + 31 of y (row stride ldy; columns past cols[i] left alone).
template <int NB, int NP>
inline void panel_tile(const float* x, const float* const* panel, float* y, int64_t n,
                       const int64_t* c, const int64_t* cols, int64_t K, int64_t ldy) {
  vf acc[NB][NP][kParts];
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < NP; ++i)
      for (int j = 0; j < kParts; ++j) acc[b][i][j] = vf{};
  const float* xr = x + n * K;
  for (int64_t k = 0; k < K; ++k) {
    vf w[NP][kParts];
    for (int i = 0; i < NP; ++i)
      for (int j = 0; j < kParts; ++j)
        w[i][j] = load(panel[i] + k * kPanel + j * kLanes);
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const vf xb = splat(xr + b * K + k);
      for (int i = 0; i < NP; ++i)
        for (int j = 0; j < kParts; ++j) acc[b][i][j] = madd(acc[b][i][j], w[i][j], xb);
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int i = 0; i < NP; ++i) {
      float* out = y + (n + b) * ldy + c[i];
      float full[kPanel];
      float* to = cols[i] >= kPanel ? out : full;  // the last panel may be partial
      for (int j = 0; j < kParts; ++j) store(to + j * kLanes, acc[b][i][j]);
      if (to == full) std::copy(full, full + cols[i], out);
    }
}

// Columns [32 p0, min(32 p1, M)) of y (N, ldy) = x (N, K) @ w^T, from panels [p0, p1) of w.
// Up to three rows read each panel once from memory, as two streams (the first and second
// halves of the range side by side, as small_gemm.h's `two_streams`); more go kRowTile at a time
// over a panel while it is in L2 (a panel is K x 128 bytes: 72 KB for K = 576).
inline void panel_rows(const float* x, const Panels& w, float* y, int64_t N, int64_t p0,
                       int64_t p1, int64_t ldy) {
  const int64_t K = w.K(), M = w.M();
  auto at = [&](int64_t p) { return w.data() + p * kPanel * K; };
  auto width = [&](int64_t p) { return std::min(kPanel, M - p * kPanel); };
  if (N <= 3) {
    const int64_t half = (p1 - p0) / 2;
    for (int64_t p = p0; p < p1 - half; ++p) {
      const int64_t q = p + (p1 - p0 - half);  // its partner in the second half
      const bool pair = p < p0 + half;
      const float* panel[2] = {at(p), at(q)};
      const int64_t c[2] = {p * kPanel, q * kPanel}, cols[2] = {width(p), pair ? width(q) : 0};
      switch (N * 2 + pair) {
        case 2: panel_tile<1, 1>(x, panel, y, 0, c, cols, K, ldy); break;
        case 3: panel_tile<1, 2>(x, panel, y, 0, c, cols, K, ldy); break;
        case 4: panel_tile<2, 1>(x, panel, y, 0, c, cols, K, ldy); break;
        case 5: panel_tile<2, 2>(x, panel, y, 0, c, cols, K, ldy); break;
        case 6: panel_tile<3, 1>(x, panel, y, 0, c, cols, K, ldy); break;
        case 7: panel_tile<3, 2>(x, panel, y, 0, c, cols, K, ldy); break;
        default: break;
      }
    }
    return;
  }
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel[1] = {at(p)};
    const int64_t c[1] = {p * kPanel}, cols[1] = {width(p)};
    int64_t n = 0;
    for (; n + kRowTile <= N; n += kRowTile)
      panel_tile<kRowTile, 1>(x, panel, y, n, c, cols, K, ldy);
    switch (N - n) {
      case 7: panel_tile<7, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 6: panel_tile<6, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 5: panel_tile<5, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 4: panel_tile<4, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 3: panel_tile<3, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 2: panel_tile<2, 1>(x, panel, y, n, c, cols, K, ldy); break;
      case 1: panel_tile<1, 1>(x, panel, y, n, c, cols, K, ldy); break;
      default: break;
    }
  }
}

}  // namespace

// y (N, M) = x (N, K) @ w (M, K)^T for few rows N: the decode-time matrix multiply.
//
// Decoding multiplies a handful of activation rows by every weight matrix, so it is bound by
// streaming the weights from memory. BLAS libraries tune for large N; at N = 1..16 they read the
// weights once per activation row or fall back to slow paths. Here each thread owns a band of
// weight rows and reads it once, as two sequential streams (its two halves side by side; see
// `two_streams`). Each weight row (a few KB, then in L1) meets every activation row, 4 at a
// time, in vector accumulators of the CPU's width (vec.h: AVX-512 where the CPU has it, AVX2
// otherwise).
// Weights are float32 or bfloat16 (half the bytes to stream): bfloat16 weights meet activations
// rounded to bfloat16 in the CPU's bfloat16 dot products (AVX512-BF16), or where it has none are
// widened to float32 as they are loaded. Sums are float32. Parallelism is ATen's thread pool.
// The fused decode layers (decode_step.cpp) use `rows` for bfloat16 weights; their float32
// weights go through panels.h instead (the figures below were measured through the fused
// layers before that, in float32).
#pragma once
#include <algorithm>
#include <vector>
#include <ATen/Parallel.h>

#include "vec.h"

namespace {

// How a tile multiplies activations of type X by weights of type W, `kStep` of k at a time.
// Float32 activations against float32 weights, or bfloat16 weights widened to float32 as they
// are loaded: one multiply-add per kLanes.
template <typename X, typename W>
struct Mul {
  static constexpr int kStep = kLanes;
  typedef vf Acc;
  typedef vf Wv;
  static Acc zero() { return vf{}; }
  typedef vf Xv;
  static Wv weights(const W* p) { return load(p); }
  static Xv acts(const X* p) { return load(p); }
  static Acc madd(Acc a, Wv w, Xv x) { return ::madd(a, w, x); }
  static Acc add(Acc a, Acc b) { return a + b; }
  static float total(Acc a) { return hsum(a); }
};

#ifdef __AVX512BF16__
// bfloat16 weights where the CPU has AVX512-BF16: the activations are rounded to bfloat16 as
// well (as a bfloat16 model's are; see `rows` below) and one instruction multiplies 32 pairs
// and adds them into 16 float32 sums. Widening the weights instead costs a load and a
// multiply-add per activation row and 16 weights, twice the work: at 2-3 rows, compute-bound
// (a 2-token pass of SmolLM2-135M 19% dearer than a 1-token step, a 3-token pass 57%). Here,
// against widening (the fused layers, ms): 1 row 8.4 / 7.7, 2 rows 8.3 / 9.3, 3 rows 9.4 / 9.8,
// 16 rows 24.9 / 35.9; eight accumulators gained nothing at one row and lost at more.
template <>
struct Mul<at::BFloat16, at::BFloat16> {
  static constexpr int kStep = 32;
  typedef __m512 Acc;
  typedef __m512bh Wv;
  static Acc zero() { return _mm512_setzero_ps(); }
  typedef __m512bh Xv;
  static Wv weights(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Xv acts(const at::BFloat16* p) { return weights(p); }
  static Acc madd(Acc a, Wv w, Xv x) { return _mm512_dpbf16_ps(a, w, x); }
  static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float total(Acc a) { return _mm512_reduce_add_ps(a); }
};
#endif

// Weight rows m + r * gap (r < R) against activation rows [n, n + NB). Each pair keeps U
// accumulators over consecutive chunks of k: NB * U independent multiply-add chains per weight
// row, enough to hide their latency when NB is small (one chain per pair would leave batch 1
// latency-bound, not read-bound).
//
// U is the same for every NB and R, so each pair's products are summed in the same order
// whatever the tile: a row's result does not depend on how many rows share the call (batch
// invariance). A verification pass then gives, bit for bit, the logits one-token steps give
// (greedy speculative decoding is plain greedy decoding, in bfloat16 too), and a request's
// tokens do not depend on the requests batched with it. Eight accumulators at one row measured
// no faster over a whole decode step (layers 17.6-18.0 ms with four, 18.8-19.1 with eight; the
// output head alone 15% slower with four); two at four rows and more, slower.
template <int NB, int R, typename X, typename W>
inline void tile(const X* x, const W* w, float* y, int64_t n, int64_t m, int64_t gap, int64_t K,
                 int64_t M) {
  using P = Mul<X, W>;
  constexpr int U = 4, S = P::kStep;
  const W* row[R];
  for (int r = 0; r < R; ++r) row[r] = w + (m + r * gap) * K;
  // With 2-3 activation rows (a verification pass, a small batch) each weight byte costs more
  // instructions, and the hardware prefetcher alone no longer keeps the streams full: each
  // stream's bytes 4 KB ahead are fetched into L2 (prefetcht1) as the tile moves on. Passes of
  // SmolLM2-135M, alternating with and without: 2 tokens 0.91x the time, 3 tokens 0.75x. At
  // one row the same prefetches made a decode step 4-6% slower (weights in 2 MB pages: 11%).
  auto fetch_ahead = [&](int64_t kk) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < S * U * int(sizeof(W)); c += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row[r] + kk) + 4096 + c, 0, 2);
  };
  typename P::Acc acc[R][NB][U];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      for (int u = 0; u < U; ++u) acc[r][b][u] = P::zero();
  int64_t k = 0;
  // One chunk of k: each weight row's vector and each activation row's vector loaded once.
  auto chunk = [&](int64_t kk, int u) {
    typename P::Wv wv[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) wv[r] = P::weights(row[r] + kk);
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      typename P::Xv xv = P::acts(x + (n + b) * K + kk);
      // Loaded once into a register for all R weight rows: left alone, GCC folds the load
      // into each multiply-add, R loads instead of one. At 2-3 activation rows, where loads
      // crowd the weight stream, that costs (a 512 MB product, alternating: 2 rows 0.93x the
      // time, 3 rows 0.955x; the same sums, bit for bit).
#if defined(__AVX512F__)  // "v": a register; with AVX2 it cost (bf16, 3 rows: 1.17x the time)
      if constexpr (R > 1 && NB > 1) asm("" : "+v"(xv));
#endif
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) acc[r][b][u] = P::madd(acc[r][b][u], wv[r], xv);
    }
  };
  for (; k + S * U <= K; k += S * U) {
    if constexpr (NB > 1 && R > 1) fetch_ahead(k);
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) chunk(k + S * u, u);
  }
  for (; k + S <= K; k += S) chunk(k, 0);
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) {
      typename P::Acc a = acc[r][b][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) a = P::add(a, acc[r][b][u]);
      float s = P::total(a);
      for (int64_t kk = k; kk < K; ++kk) s += float(row[r][kk]) * float(x[(n + b) * K + kk]);
      y[(n + b) * M + m + r * gap] = s;
    }
  }
}

// Up to three activation rows against weight rows [m0, m1), each weight row read once straight
// from memory, as two streams: the first and second halves of the band side by side. One
// sequential stream per thread left a fifth of the read bandwidth unused here: a 512 MB
// matrix-vector product at 0.72-0.84 of a torch.sum over the same bytes, 0.94-1.0 with two
// streams. A whole decode step of SmolLM2-135M (layers and head) reads at 1.07 of torch.sum's
// rate with two streams, 0.85 with four, 0.97 with three; at one row, software prefetching
// (ahead in the streams, or of the next matrix while waiting at a barrier) gained nothing.
template <int NB, typename X, typename W>
inline void two_streams(const X* x, const W* w, float* y, int64_t n, int64_t m0, int64_t m1,
                        int64_t K, int64_t M) {
  const int64_t half = (m1 - m0) / 2;
  for (int64_t m = m0; m < m0 + half; ++m) tile<NB, 2>(x, w, y, n, m, half, K, M);
  if ((m1 - m0) % 2) tile<NB, 1>(x, w, y, n, m1 - 1, 0, K, M);
}

// Weight rows [m0, m1) against every activation row. With up to three activation rows each
// weight row is read once, straight from memory, in two streams. With more, the activation rows
// go four at a time (a few KB, kept in L1) over a band of weight rows small enough to stay in
// L2: the weights still come from memory once, and the activations are not fetched again from
// L2 for every weight row (16 rows: a decode step of SmolLM2-135M in 58 ms instead of 77).
// From L2 these tiles reach 110-140 GFLOP/s here (2 cores; BLAS on large matrices 115).
// Tiles of two weight rows by three activation rows (fewer loads per multiply-add) measured
// slower: the layers over 16 rows 49 ms against 41.
template <typename X, typename W>
inline void rows(const X* x, const W* w, float* y, int64_t N, int64_t m0, int64_t m1,
                 int64_t K, int64_t M) {
  switch (N) {
    case 1: return two_streams<1>(x, w, y, 0, m0, m1, K, M);
    // A two- or three-token pass (a depth-1 or depth-2 verification) costs about what a
    // one-token step does: 1.045x each (16.4, 17.2, 17.1 ms; before `tile`'s prefetches and
    // register-held activations, 1.16-1.21x and 1.36-1.49x). Two one-row passes, the second
    // over the row in L1, measured 1.3x.
    case 2: return two_streams<2>(x, w, y, 0, m0, m1, K, M);
    case 3: return two_streams<3>(x, w, y, 0, m0, m1, K, M);
    default: break;
  }
  const int64_t band = std::max<int64_t>(1, (128 << 10) / (K * int64_t(sizeof(W))));  // 128 KB
  const int64_t passes = (N + 3) / 4;  // over each band
  for (int64_t b0 = m0; b0 < m1; b0 += band) {
    const int64_t b1 = std::min(m1, b0 + band);
    // Only the first pass over a band reads memory; the others run from L2. So that memory is
    // read all along, the next band is fetched into L2 while they run, a slice before each
    // tile. A 26-token prefill of SmolLM2-135M: 83 ms without, 68 ms with (256 KB bands),
    // about 6% less again with 128 KB ones; fetching into L1 (prefetcht0): slower than none.
    const char* next = reinterpret_cast<const char*>(w + b1 * K);
    const int64_t next_bytes = (std::min(m1, b1 + band) - b1) * K * int64_t(sizeof(W));
    const int64_t tiles = (passes - 1) * (b1 - b0);
    const int64_t slice = tiles ? (next_bytes / tiles + 63) / 64 * 64 : 0;
    int64_t fetched = 0;
    auto fetch_next = [&]() {
      for (const int64_t end = std::min(next_bytes, fetched + slice); fetched < end; fetched += 64)
        __builtin_prefetch(next + fetched, 0, 2);  // prefetcht1: into L2
    };
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
      for (int64_t m = b0; m < b1; ++m) {
        if (n) fetch_next();
        tile<4, 1>(x, w, y, n, m, 0, K, M);
      }
    for (int64_t m = b0; m < b1; ++m) {
      if (n) fetch_next();
      switch (N - n) {
        case 3: tile<3, 1>(x, w, y, n, m, 0, K, M); break;
        case 2: tile<2, 1>(x, w, y, n, m, 0, K, M); break;
        case 1: tile<1, 1>(x, w, y, n, m, 0, K, M); break;
        default: break;
      }
    }
  }
}

#ifdef __AVX512BF16__
// bfloat16 weights: the activations rounded to bfloat16 once per call (this thread's copy), then
// the dot-product tiles.
inline void rows(const float* x, const at::BFloat16* w, float* y, int64_t N, int64_t m0,
                 int64_t m1, int64_t K, int64_t M) {
  thread_local std::vector<at::BFloat16> xb;
  xb.resize(N * K);
  int64_t i = 0;
  for (; i + 32 <= N * K; i += 32)
    _mm512_storeu_si512(xb.data() + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16),
                                                                   _mm512_loadu_ps(x + i)));
  for (; i < N * K; ++i) xb[i] = at::BFloat16(x[i]);
  rows<at::BFloat16, at::BFloat16>(xb.data(), w, y, N, m0, m1, K, M);
}
#endif

}  // namespace

// y (N, M) = x (N, K) @ w (M, K)^T, raw contiguous buffers (x, y float32; w float32 or
// bfloat16); threads over weight rows.
template <typename W>
inline void gemm_rows(const float* x, const W* w, float* y, int64_t N, int64_t K, int64_t M) {
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) { rows(x, w, y, N, m0, m1, K, M); });
}


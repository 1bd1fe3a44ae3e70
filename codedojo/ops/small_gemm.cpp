// y (N, M) = x (N, K) @ w (M, K)^T for few rows N: the decode-time matrix multiply.
//
// Decoding multiplies a handful of activation rows by every weight matrix, so it is bound by
// streaming the weights from memory. BLAS libraries tune for large N; at N = 1..16 they read the
// weights once per row or fall back to slow paths. Here each thread owns a band of weight rows and
// streams it once: a tile of 4 weight rows (a few KB, kept in L1) is multiplied by every
// activation row, 4 at a time, with 16-wide vector accumulators (GCC vector extensions: AVX-512
// where the CPU has it, two AVX2 registers otherwise). Parallelism is ATen's thread pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16*>(p); }

inline float hsum(v16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#endif
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Rows [m, m + R) of w against activation rows [n, n + NB).
template <int R, int NB>
inline void tile(const float* x, const float* w, float* y, int64_t n, int64_t m, int64_t K,
                 int64_t M) {
  v16 acc[NB][R] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load(w + (m + r) * K + k);
    for (int b = 0; b < NB; ++b) {
      const v16 xv = load(x + (n + b) * K + k);
      for (int r = 0; r < R; ++r) acc[b][r] += wv[r] * xv;
    }
  }
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[b][r]);
      for (int64_t kk = k; kk < K; ++kk) s += w[(m + r) * K + kk] * x[(n + b) * K + kk];
      y[(n + b) * M + m + r] = s;
    }
  }
}

template <int R>
inline void rows(const float* x, const float* w, float* y, int64_t N, int64_t m, int64_t K,
                 int64_t M) {
  int64_t n = 0;
  for (; n + 4 <= N; n += 4) tile<R, 4>(x, w, y, n, m, K, M);
  switch (N - n) {
    case 3: tile<R, 3>(x, w, y, n, m, K, M); break;
    case 2: tile<R, 2>(x, w, y, n, m, K, M); break;
    case 1: tile<R, 1>(x, w, y, n, m, K, M); break;
    default: break;
  }
}

}  // namespace

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_gemm: x (N, K) and w (M, K) expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "small_gemm: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_gemm: contiguous inputs only");
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  auto y = torch::empty({N, M}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Grain: bands of at least 64 rows, so a thread streams a long contiguous run of weights.
  at::parallel_for(0, (M + 3) / 4, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m = 4 * t;
      if (m + 4 <= M) {
        rows<4>(xp, wp, yp, N, m, K, M);
      } else {
        for (int64_t r = m; r < M; ++r) rows<1>(xp, wp, yp, N, r, K, M);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "x (N, K) @ w (M, K)^T for small N, float32");
}

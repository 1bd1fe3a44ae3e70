// small_gemm(x, w): the decode-time matrix multiply (see small_gemm.h) as a torch op.
#include "small_gemm.h"

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_gemm: x (N, K) and w (M, K) expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "small_gemm: x float32, w float32 or bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_gemm: contiguous inputs only");
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  auto y = torch::empty({N, M}, x.options());
  if (w.scalar_type() == at::kBFloat16)
    gemm_rows(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), N, K, M);
  else
    gemm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), N, K, M);
  return y;
}

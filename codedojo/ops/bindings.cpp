// The Python module of the CPU kernels (built by gemm.py's load_kernel).
#include <torch/extension.h>

#include <tuple>

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w);
void bind_fused_layers(pybind11::module& m);
std::tuple<torch::Tensor, torch::Tensor> greedy(const torch::Tensor& logits,
                                                const torch::Tensor& tokens);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "x (N, K) @ w (M, K)^T for small N, float32");
  bind_fused_layers(m);  // FusedLayers: the dense layers (and head) for a few new tokens
  m.def("greedy", &greedy, "each row's argmax and a token's log-softmax, float32");
}

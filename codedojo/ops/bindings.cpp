// The Python module of the CPU kernels (built by gemm.py's load_kernel).
#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor decode_layers(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const std::vector<int64_t>& slot, const std::vector<int64_t>& pos,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t H,
                            int64_t K, double eps);
std::tuple<torch::Tensor, torch::Tensor> greedy(const torch::Tensor& logits,
                                                const torch::Tensor& tokens);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_gemm", &small_gemm, "x (N, K) @ w (M, K)^T for small N, float32");
  m.def("decode_layers", &decode_layers,
        "every dense layer for a few new tokens against a KV cache, float32");
  m.def("greedy", &greedy, "each row's argmax and a token's log-softmax, float32");
}

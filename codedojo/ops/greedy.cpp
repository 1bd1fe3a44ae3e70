// greedy(logits, tokens): each row's argmax, and the log-softmax of a token of the row.
//
// Greedy decoding reads both for every token it emits: the argmax to emit, its log-probability
// for the caller (RL needs it). torch.argmax and torch.log_softmax over a 49k vocabulary take
// about 90 and 40 microseconds here per row (argmax is not vectorised); two vectorised passes
// over the row take a fraction of that.
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <ATen/Parallel.h>

#include "vec.h"

namespace {

// The index of the row's largest value, the first of equal ones; a NaN counts as the largest
// (torch.argmax's rules).
int64_t argmax_row(const float* x, int64_t V) {
  int64_t best = 0, i = 0;
  float m = x[0];
  if (V >= kLanes) {
    vf top = load(x);
    vi at;
    for (int l = 0; l < kLanes; ++l) at[l] = l;
    vi cur = at, nan = top != top;
    for (i = kLanes; i + kLanes <= V; i += kLanes) {
      cur += kLanes;
      const vf v = load(x + i);
      const vi gt = v > top;  // strict: each lane keeps its first maximum
      top = gt ? v : top;
      at = gt ? cur : at;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int l = 0; l < kLanes; ++l) any_nan |= nan[l] != 0;
    if (any_nan)
      for (int64_t j = 0; j < V; ++j)
        if (std::isnan(x[j])) return j;
    m = top[0], best = at[0];
    for (int l = 1; l < kLanes; ++l)
      if (top[l] > m || (top[l] == m && at[l] < best)) m = top[l], best = at[l];
  }
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > m) m = x[i], best = i;
  }
  return best;
}

// log(sum(exp(x - m))) over the row.
float log_sum_exp(const float* x, int64_t V, float m) {
  int64_t i = 0;
  vf s = {};
  for (; i + kLanes <= V; i += kLanes) s += vexp(load(x + i) - m);
  float sum = hsum(s);
  for (; i < V; ++i) sum += std::exp(x[i] - m);
  return std::log(sum);
}

}  // namespace

// logits (N, V) float32; tokens (N,) int64, or empty for each row's argmax. Returns the argmaxes
// (N,) int64 and the log-softmax of the tokens (N,) float32: x[t] - max - log(sum(exp(x - max))),
// torch.log_softmax's formula.
std::tuple<torch::Tensor, torch::Tensor> greedy(const torch::Tensor& logits,
                                                const torch::Tensor& tokens) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "greedy: logits must be contiguous float32 (N, V) with V > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  const bool given = tokens.numel() > 0;
  TORCH_CHECK(!given || (tokens.dim() == 1 && tokens.size(0) == N &&
                         tokens.scalar_type() == at::kLong),
              "greedy: tokens must be int64 (N,) or empty");
  auto ids = torch::empty({N}, logits.options().dtype(at::kLong));
  auto lps = torch::empty({N}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* tok = given ? tokens.data_ptr<int64_t>() : nullptr;
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)  // numbers as text: see check_tensor in decode_step.cpp
    TORCH_CHECK(!given || (tok[n] >= 0 && tok[n] < V), "greedy: token ",
                std::to_string(tok[n]), " outside the vocabulary of ", std::to_string(V));
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = x + n * V;
      id[n] = argmax_row(row, V);
      const float m = row[id[n]];
      const int64_t t = given ? tok[n] : id[n];
      lp[n] = std::isnan(m) ? m : (row[t] - m) - log_sum_exp(row, V, m);
    }
  });
  return {ids, lps};
}

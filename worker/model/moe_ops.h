// The operations of a mixture-of-experts block on one rank: the router (scores, top-k, gates), the
// dispatch of each token's k assignments sorted by expert, the experts' SwiGLU over their segments,
// the weighted combine back to the tokens, and the router's balance and z losses. Written from
// LibTorch operations, so autograd gives every backward; deterministic (a stable sort, a gather and a
// sum; the only atomics add integer counts), so every layout that computes the same rows gets the
// same bits.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace ltrain::worker::moe {

enum class Score { kSoftmax, kSigmoid };

struct RouterOptions {
  int top_k = 2;
  Score score = Score::kSoftmax;
  bool norm_topk = true;     // the k gates divided by their sum
  double route_scale = 1.0;  // the gates multiplied by this, after the normalization
};

struct Routing {
  torch::Tensor scores;   // [T, E] fp32: softmax or sigmoid of the logits
  torch::Tensor experts;  // [T, k] int64: each token's experts, by falling score (+ bias), ties to the lower index
  torch::Tensor gates;    // [T, k] fp32: the chosen experts' scores, normalized and scaled
};

// logits [T, E], in any floating dtype (scored in fp32). bias [E] fp32, or undefined: it moves which
// experts a token chooses, never how much their outputs weigh (DeepSeek-V3's balance without a loss).
Routing Route(const torch::Tensor& logits, const torch::Tensor& bias, const RouterOptions& options);

// The T·k assignments (token t's j-th is t·k + j) in expert order: stable, so within an expert by
// token, then by slot.
struct Dispatch {
  torch::Tensor order;          // [T·k] int64: the assignments, expert by expert
  torch::Tensor rows;           // [E] int64 on the assignments' device: rows each expert gets
  std::vector<int64_t> counts;  // the same on the host (one copy from the device), where asked for
  int top_k = 1;
};
// With `host_counts` false, `counts` stays empty and nothing waits for the device (the grouped
// products read `rows` there).
Dispatch SortByExpert(const torch::Tensor& experts, int64_t num_experts, bool host_counts = true);

// x [T, d] -> [T·k, d]: each assignment's token row, in dispatch order.
torch::Tensor Permute(const torch::Tensor& x, const Dispatch& dispatch);

// Every expert's SwiGLU, w2 · (silu(w1 · x) ⊙ w3 · x), over its segment of xs (counts[e] rows each,
// in expert order): w1 and w3 [E, f, d], w2 [E, d, f]; -> [rows, d]. On a GPU that has them, in bf16,
// three grouped products (GroupedExpertsApply), one launch each for all the experts; else one product
// an expert (ExpertsLoop). In bf16 on GPUs the SwiGLU is one kernel that keeps w1's and w3's outputs
// only (FusedSwiGlu).
torch::Tensor Experts(const torch::Tensor& xs, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                      const torch::Tensor& w3, const torch::Tensor& w2);
// Experts by grouped products only (GroupedExpertsApply must hold), each expert's rows counted by
// `rows` [E] on the device: no copy to the host.
torch::Tensor GroupedExperts(const torch::Tensor& xs, const torch::Tensor& rows, const torch::Tensor& w1,
                             const torch::Tensor& w3, const torch::Tensor& w2);
torch::Tensor ExpertsLoop(const torch::Tensor& xs, const std::vector<int64_t>& counts, const torch::Tensor& w1,
                          const torch::Tensor& w3, const torch::Tensor& w2);
// Whether Experts runs grouped products for these operands: CUDA, bf16, compute capability 9.0 or
// newer, a LibTorch with compat::GroupedMm, widths multiples of 8 (16-byte rows), and
// LTRAIN_MOE_GROUPED_MM not 0.
bool GroupedExpertsApply(const torch::Tensor& xs, const torch::Tensor& w1);

// ys [T·k, d] in dispatch order -> [T, d]: each token's k outputs times their gates, summed in fp32 and
// rounded once to ys' dtype. Keeps ys and the gates for backward (not the gathered rows in fp32).
torch::Tensor Combine(const torch::Tensor& ys, const Dispatch& dispatch, const torch::Tensor& gates);

// DeepSeek-V3's sequence-wise balance loss without its coefficient: for each sequence of seq_len
// tokens, Σ_i f_i · P_i with f_i = E / (k · seq_len) · (tokens that chose i) and P_i the mean over the
// sequence of the scores (each token's normalized to sum 1 for sigmoid); averaged over the sequences.
// 1 when the load is even; only P carries a gradient.
torch::Tensor SequenceBalanceLoss(const Routing& routing, int64_t seq_len, Score score);

// ST-MoE's router z-loss without its coefficient: the mean over tokens of logsumexp(logits)².
torch::Tensor ZLoss(const torch::Tensor& logits);

}  // namespace ltrain::worker::moe

// The pieces ModelShard's blocks are made of: tensor- and sequence-parallel collectives as autograd
// functions (Megatron-LM's f and g and their sequence-parallel forms), and the norms and products that
// go through our fused kernels where they take the tensors and through LibTorch's elsewhere. Each
// family's block in parallel_model.cc is written from these. Runs on the training thread; a failed
// collective throws std::runtime_error (Check).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/variable.h>
#include <torch/types.h>

#include "common/layout.h"
#include "common/status.h"
#include "worker/comm/communicator.h"
#include "worker/model/fused_kernels.h"

namespace ltrain::worker {

using torch::autograd::variable_list;

// Throws std::runtime_error with the status' message unless it is ok.
void Check(const Status& s);

// Megatron's f: identity forward, the gradient summed over tp backward.
torch::Tensor CopyToTp(const torch::Tensor& x, Communicator* tp);
// Megatron's g: the sum over tp forward, identity backward.
torch::Tensor ReduceFromTp(const torch::Tensor& x, Communicator* tp);
// Megatron's g begun on a side stream beside the work queued after it: its handle goes to *pending,
// and nothing may read the output before the handle's Finish(). Identity backward.
torch::Tensor ReduceFromTpBeside(const torch::Tensor& x, Communicator* tp, std::unique_ptr<SideStreamSum>* pending);
// Sequence parallel: [b, t/tp, ...] all-gathered along the sequence forward, reduce-scattered backward.
torch::Tensor GatherSeq(const torch::Tensor& x, Communicator* tp);
// Sequence parallel: [b, t, ...] partial sums reduce-scattered along the sequence forward, all-gathered
// backward.
torch::Tensor ScatterSeq(const torch::Tensor& x, Communicator* tp);
// The q, k and v heads of a fused projection's output [b, t, 3c] as [b, heads, t, c/heads] views;
// backward writes the three gradients into one [b, t, 3c] tensor with one strided copy each.
variable_list SplitHeads(const torch::Tensor& qkv, int64_t heads);
// Causal attention whose internals (scores, softmax) are recomputed in backward, not kept: selective
// checkpointing on the CPU.
torch::Tensor CheckpointedAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// Whether a fused product can add `residual` to its output of `sizes` in its epilogue.
bool FusableResidual(const torch::Tensor& residual, const torch::Tensor& x, c10::IntArrayRef sizes);
// The sizes of x · wᵀ.
std::vector<int64_t> OutputSizes(const torch::Tensor& x, const torch::Tensor& w);
// residual + linear(x, w, b); b and residual may be undefined (the bias folded into the product).
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                     const torch::Tensor& residual = {});
// {layer_norm(x), x}: the residual branch reads x through the second, so that with our kernel its
// gradient is added inside the norm's backward. `rebuild`: FusedLayerNorm's rebuild_output.
std::pair<torch::Tensor, torch::Tensor> LayerNorm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                                                  bool rebuild = false);
// {rms_norm(x) over the last dimension, x}, as LayerNorm.
std::pair<torch::Tensor, torch::Tensor> RmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                                                bool rebuild = false);
// residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2); b2 and residual may be undefined.
torch::Tensor Mlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                  const torch::Tensor& b2, const torch::Tensor& residual, bool recompute_gelu);
// Where our products sum their input's gradient over tp themselves (Megatron's f folded in): tensor
// parallelism without sequence parallelism. Else null.
Communicator* SumInProducts(const Layout& layout, Communicator* tp);
// residual + x · wᵀ (residual may be undefined), through our product where it takes them. `w` must be
// a parameter itself, not a view of one.
torch::Tensor NoBiasLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& residual = {});

}  // namespace ltrain::worker

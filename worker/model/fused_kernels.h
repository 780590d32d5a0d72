// Kernels of our own where LibTorch's would take more memory traffic, as autograd functions. They
// exist in CUDA builds (LTRAIN_WITH_CUDA_KERNELS); callers ask Fused*Available() and otherwise use
// the composite LibTorch operations.
#pragma once

#include <utility>
#include <vector>

#include <torch/types.h>

#include "worker/model/fp8_scaling.h"

namespace ltrain::worker {

class Communicator;

// The most of cuBLASLt's candidates the product tuner times (LTRAIN_GEMM_CANDIDATES), and its default.
constexpr int kMaxGemmCandidates = 32;

// Which of the worker's own kernels run (see `ltrain-worker --help`). Set once, before training
// starts; CPU builds ignore it.
struct FusedKernelOptions {
  bool linear = true;       // FusedLinear, FusedMlp (LTRAIN_FUSED_LINEAR=0 turns them off)
  bool layer_norm = true;   // FusedLayerNorm (LTRAIN_FUSED_LAYER_NORM=0 turns it off)
  bool adamw = true;        // FusedAdamW (LTRAIN_FUSED_ADAMW=0 turns it off)
  int gemm_sm_margin = 0;   // backward's products are planned for this many fewer SMs (LTRAIN_GEMM_SM_MARGIN)
  bool gemm_tune = true;    // each product's algorithm timed among cuBLASLt's candidates (LTRAIN_GEMM_TUNE=0: first)
  int gemm_candidates = kMaxGemmCandidates;  // how many candidates (LTRAIN_GEMM_CANDIDATES)
  bool tp_overlap = true;   // the products sum their input's gradient over tp (LTRAIN_TP_OVERLAP=0 turns it off)
  // FusedLayerNorm's and FusedRmsNorm's rebuild_output: as the caller asks (-1), never (0,
  // LTRAIN_NORM_REBUILD=0) or always (1, LTRAIN_NORM_REBUILD=1: also without selective recompute).
  int norm_rebuild = -1;
  // The blocks' linear products in FP8 (e4m3 weights and activations, e5m2 gradients), where
  // Fp8ProductsAvailable and the sides are multiples of 16.
  bool fp8 = false;
  // Under fp8: a scale for each row along the product's inner dimension (parallel.fp8_scaling:
  // rowwise), each operand quantized once for each direction its products read it in; false: one
  // scale an operand (tensorwise).
  bool fp8_rowwise = false;
  // Under fp8: a product's forward keeps its weight's FP8 transposed copy for backward (false under
  // ZeRO-3, whose gathered weights are not held from forward to backward: backward quantizes again).
  bool fp8_keep_weights = true;
  // Under fp8: the kernels that write a product's input or output gradient (the norms, SwiGLU, the
  // GELU's gradient, RoPE's backward) take its amax as they write it, and its quantization reads that amax instead of
  // a pass of its own (LTRAIN_FP8_WRITER_AMAX=0 turns it off: the same values, one more pass each).
  bool fp8_writer_amax = true;
  // Under fp8: which of a layer's three products run in FP8 (LTRAIN_FP8_PRODUCTS, letters f, d, w):
  // the forward, the input gradient, the weight gradient; the others stay in bf16.
  bool fp8_forward = true;
  bool fp8_input_grad = true;
  bool fp8_weight_grad = true;
  // Under fp8: the forward products accumulate with Hopper's fast accumulation (LTRAIN_FP8_FAST_ACCUM=0:
  // with its periodic promotion, as backward's).
  bool fp8_fast_accum = true;
  // Under fp8: the gradients in e4m3 as the weights and activations are, instead of e5m2's wider range
  // (the worker sets it under rowwise scaling, as torchao's recipe has it; LTRAIN_FP8_GRADIENTS).
  bool fp8_gradients_e4m3 = false;
};
void SetFusedKernelOptions(const FusedKernelOptions& options);

// Under options.fp8, the products made on this thread while one of these lives (with `bf16` true)
// stay in bf16: the output head's, where FP8 hurts. Backward runs each product in the precision its
// forward did, whichever thread runs it.
class Bf16ProductsScope {
 public:
  explicit Bf16ProductsScope(bool bf16 = true);
  ~Bf16ProductsScope();
  Bf16ProductsScope(const Bf16ProductsScope&) = delete;
  Bf16ProductsScope& operator=(const Bf16ProductsScope&) = delete;

 private:
  bool was_;
};

// Whether the products made on this thread now run in FP8 (options.fp8, outside a Bf16ProductsScope).
bool Fp8ProductsOn();

// Whether FusedLinear and FusedMlp can take input x with weight w: a CUDA build, bf16 CUDA
// tensors, a contiguous 2-D weight whose sides are multiples of 8, and options.linear.
bool FusedLinearAvailable(const torch::Tensor& x, const torch::Tensor& w);

// Whether FusedLinearAvailable holds for bf16 CUDA inputs and weights of [out, in] (contiguous).
bool FusedLinearTakes(int64_t out, int64_t in);

// Weight gradients left unzeroed at the start of a step (the parameter store's, views of its flat
// buffer): the first fused product to write each overwrites it instead of adding to it.
// ZeroStaleGradients zeroes those no product wrote (call it after backward, before anything reads
// the gradients) and forgets them all, and drops what backward's norms left for the products to read.
// Only for gradients that nothing but the products adds to.
void MarkGradientsStale(const std::vector<torch::Tensor>& grads);
void ZeroStaleGradients();

// residual + at::linear(x, w, b) (b and residual may be undefined) through cuBLASLt, the bias and
// the residual (shaped like the output) in the product's epilogue: no separate add. Backward adds the
// weight gradient straight into w's .grad where it already has one (bf16, as the parameter store
// keeps it): no separate gradient tensor and no accumulating add.
torch::Tensor FusedLinear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                          const torch::Tensor& residual = {});

// The products below that read a block's input take `tp`: where it is not null (tensor parallelism
// without sequence parallelism), x is the input every tp rank holds whole, and backward sums its
// gradient over `tp` (Megatron's f, folded into the product). The input gradient is computed first
// and its all-reduce runs on a side stream while the weight gradients are computed after it.

// Whether callers should hand `tp` to the products below (options.tp_overlap).
bool FusedTpOverlap();

// The sum of `t` over `comm`, in place, begun on a side stream of t's GPU (one per GPU, shared with
// the products' input-gradient sums, so that the group's collectives keep the order they were
// issued in) once the current stream has computed t: the work queued on the current stream after
// it runs beside the all-reduce. Finish() (or the destructor) makes the current stream wait for the
// sum; nothing may read, write or free t before. A CPU tensor (or a build without CUDA kernels) is
// summed at once; with no communicator nothing happens.
class SideStreamSum {
 public:
  SideStreamSum(torch::Tensor& t, Communicator* comm);
  SideStreamSum(const SideStreamSum&) = delete;
  SideStreamSum& operator=(const SideStreamSum&) = delete;
  ~SideStreamSum() { Finish(); }

  void Finish();

 private:
  void* main_ = nullptr;  // cudaStream_t that waits
  void* done_ = nullptr;  // cudaEvent_t after the sum
};

// residual + linear(gelu_tanh(linear(x, w1, b1)), w2, b2) (b2 and residual may be undefined) with
// the GELU and its gradient in the products' epilogues (no separate GELU kernels), the residual in
// the second product's; weight gradients as FusedLinear's. `recompute_gelu` (selective recompute):
// backward recomputes the GELU's output from its input instead of keeping it from forward, a
// quarter less of what a block keeps for backward for one elementwise pass more.
torch::Tensor FusedMlp(const torch::Tensor& x, const torch::Tensor& w1, const torch::Tensor& b1, const torch::Tensor& w2,
                       const torch::Tensor& b2, const torch::Tensor& residual = {}, Communicator* tp = nullptr,
                       bool recompute_gelu = false);

// The attention's q, k, v [b, heads, t, d] from x [b, t, in] and the stacked weight w [3c, in] (rows
// q, k, v) with bias b [3c] (may be undefined), as the slices of linear(x, w, b) viewed
// [b, t, 3, heads, d] would give them, but each a dense tensor of its own (no copies around the
// attention kernel); weight gradients as FusedLinear's. Takes what FusedLinearAvailable(x, w) does.
std::vector<torch::Tensor> FusedQkv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, int64_t heads,
                                    Communicator* tp = nullptr);

// Whether FusedLayerNorm can take these: a CUDA build, bf16 CUDA input, bf16 weight and bias, a
// width that is a multiple of 8, and options.layer_norm.
bool FusedLayerNormAvailable(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b);

// {layer_norm(x) over the last dimension (eps 1e-5), x}: backward runs our kernels. The second is
// x itself for the residual branch to read: its gradient is then added to the layer norm's input
// gradient inside the kernel, not by a separate add where the two branches meet.
//
// `rebuild_output` (selective recompute, while autograd records): the products of this file that
// read the first output (FusedMlp, FusedQkv, FusedProjections; not views of it) do not keep it for
// their weight gradients but make it again in backward, with the norm's forward kernel, from the
// bf16 input the norm keeps for its own backward. A norm's output then costs no memory after
// forward (2 bytes a value), for one pass of the norm's forward in backward. On an fp32 stream the
// norm keeps x − mean in bf16, so the rebuilt output can differ from forward's in the last bf16 bit.
std::pair<torch::Tensor, torch::Tensor> FusedLayerNorm(const torch::Tensor& x, const torch::Tensor& w,
                                                       const torch::Tensor& b, bool rebuild_output = false);

// Whether FusedRmsNorm can take these: a CUDA build, bf16 CUDA input and weight, a width that is a
// multiple of 8, and options.layer_norm (which covers both norms).
bool FusedRmsNormAvailable(const torch::Tensor& x, const torch::Tensor& w);

// {rms_norm(x, w, eps) over the last dimension, x}: LibTorch's forward, our kernels backward, with
// the residual branch reading x through the second output as FusedLayerNorm's.
// `rebuild_output`: FusedLayerNorm's (the kept input is x in bf16).
std::pair<torch::Tensor, torch::Tensor> FusedRmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                                                     bool rebuild_output = false);

// {x · w_iᵀ} for two or three weights (each as FusedLinearAvailable(x, w_i) takes): one product
// each, the input gradient summed in the backward products' epilogues (no separate adds), weight
// gradients as FusedLinear's.
std::vector<torch::Tensor> FusedProjections(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                                            Communicator* tp = nullptr);

// Whether FusedRope and FusedSwiGlu can take x: a CUDA build, a bf16 CUDA tensor.
bool FusedLlamaOpsAvailable(const torch::Tensor& x);

// llama_model.apply_rope of x [b, t, heads, head_dim] with cos, sin fp32 [>= t, head_dim/2] (on x's
// device): one kernel forward, one (the inverse rotation) backward; fp32 arithmetic, bf16 out.
torch::Tensor FusedRope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// embedding(ids, w) for a bf16 CUDA table w (where FusedLlamaOpsAvailable(w)): backward adds the
// used rows' gradients into w's .grad in place where it has one (bf16, as the parameter store keeps
// it), instead of a dense table-sized gradient and an add.
torch::Tensor FusedEmbedding(const torch::Tensor& ids, const torch::Tensor& w);

// silu(gate) · up in one kernel, both gradients in one kernel.
torch::Tensor FusedSwiGlu(const torch::Tensor& gate, const torch::Tensor& up);
// silu(gate) · up: FusedSwiGlu where FusedLlamaOpsAvailable(gate) (it keeps gate and up only), else
// LibTorch's composite.
torch::Tensor SwiGlu(const torch::Tensor& gate, const torch::Tensor& up);

// residual + linear(silu(gate) · up, w) (residual may be undefined), the SwiGLU MLP's down projection
// under selective recompute: the product's input silu(gate) · up is not kept for backward but made
// again there from gate and up, which the SwiGLU's gradient reads anyway (a third less of what the
// MLP keeps). Weight gradients as FusedLinear's. Takes what FusedLlamaOpsAvailable(gate) and
// FusedLinearAvailable(gate, w) do.
torch::Tensor FusedSwiGluLinear(const torch::Tensor& gate, const torch::Tensor& up, const torch::Tensor& w,
                                const torch::Tensor& residual = {});

// Whether FusedCrossEntropy can take these logits: a CUDA build, bf16 CUDA logits.
bool FusedCrossEntropyAvailable(const torch::Tensor& logits);

// Mean cross-entropy of logits [rows, vocab] (bf16, CUDA) against targets [rows] (int64): the
// value of nll_loss(log_softmax(logits.float())), computed without fp32 copies of the logits; the
// gradient flows to the logits in bf16.
// `grad_in_logits`: backward writes the logits' gradient into the logits' own memory, one [rows,
// vocab] buffer less when backward starts (its peak, for a large vocabulary). Only for logits that
// nothing else reads after the loss: the caller hands them over.
torch::Tensor FusedCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets, bool grad_in_logits = false);

// Whether FusedAdamW can update these fp32 master weights: a CUDA build, fp32 CUDA tensors, and
// options.adamw.
bool FusedAdamWAvailable(const torch::Tensor& param);

// One AdamW step (torch.optim.AdamW's update) over `param` (fp32 master weights, updated in place)
// and its moments, from `grad` (bf16 or fp32, divided by the device scalar `grad_divisor` when that
// is defined), writing the updated weights also into `param_bf16` when it is defined. One kernel,
// one pass over memory. `step` is 1-based.
void FusedAdamW(const torch::Tensor& param, const torch::Tensor& grad, const torch::Tensor& exp_avg,
                const torch::Tensor& exp_avg_sq, const torch::Tensor& param_bf16, double lr, double beta1, double beta2,
                double eps, double weight_decay, int64_t step, const torch::Tensor& grad_divisor);

// parallel.precision fp8: the amax figures of the operands the FP8 products quantized since the last
// call, on the device, for the trainer to copy with the step's loss (nothing waits for the GPU). fp32
// [8]: the activations' largest and smallest amax, the weights', the gradients', then how many
// operands were quantized and how many of those had an amax that was not finite. Undefined where
// no FP8 product ran.
torch::Tensor TakeFp8Figures();

// How many FP8 quantizations in this process read the amax that the kernel which wrote their tensor
// took (options.fp8_writer_amax) instead of taking it in a pass of their own.
int64_t Fp8WriterAmaxesTaken();

// FP8 products (a CUDA build on a LibTorch with float8 types, a GPU of compute capability 8.9 or
// newer: Fp8ProductsAvailable).
bool Fp8ProductsAvailable();

// bf16 x [rows, cols] (contiguous, CUDA) quantized on the device by our kernels: as Fp8Quantize
// (fp8_scaling.h) gives it, data in float8. With `transposed` (tensorwise only) also the transposed
// copy [cols, rows] of the data, which shares scale_inv and amax.
Fp8Tensor Fp8QuantizeOnDevice(const torch::Tensor& x, Fp8Format format, Fp8Scaling scaling, bool power_of_2,
                              torch::Tensor* transposed = nullptr);

// bf16 x [rows, cols] (contiguous, CUDA) quantized rowwise both ways, as a product along x's rows and
// one along its columns read it: first x's rows scaled each by its own amax (as Fp8QuantizeOnDevice
// rowwise), second the transposed copy [cols, rows] scaled by each of its rows (x's columns). One read
// of x for the amaxes and one for both casts where the sides allow (rows of 16, cols of 8).
std::pair<Fp8Tensor, Fp8Tensor> Fp8QuantizeBothWaysOnDevice(const torch::Tensor& x, Fp8Format format, bool power_of_2);

// a [m, k] · b [n, k]ᵀ in bf16 [m, n], each operand taken back by its scale_inv (both tensorwise or
// both rowwise; not both e5m2), through cuBLASLt. `fast_accum`: Hopper's faster accumulation (the
// forward products of FP8 training).
torch::Tensor Fp8Product(const Fp8Tensor& a, const Fp8Tensor& b, bool fast_accum);

}  // namespace ltrain::worker

// bf16 matrix products through cuBLASLt with the epilogues the worker's linear layers fuse: the
// bias add, GELU (tanh approximation) keeping its input, the GELU gradient with the bias gradient,
// and the bias gradient of a weight-gradient product. Plain CUDA, no LibTorch.
//
// cuBLAS conventions: column-major, D[m, n] = op(A)[m, k] · op(B)[k, n]; a row-major [r, c] matrix
// is a column-major [c, r] one with leading dimension c. fp32 accumulation, bf16 in, bf16 out (or
// fp32 C, D and bias, for a product that adds into an fp32 residual stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace ltrain::worker::cuda {

enum class Epilogue {
  kNone,
  kBias,         // D += bias[m] along the columns
  kGeluAuxBias,  // aux = D + bias; D = gelu(aux)
  kDGelu,        // D = D * gelu'(aux)
  kDGeluBGrad,   // D = D * gelu'(aux); bias_grad[m] = sum of D over its columns
  kBGradB,       // bias_grad[n] = sum of op(B) over k
};

// The type of A or B: bf16, or FP8 (e4m3 for weights and activations, e5m2 for gradients).
enum class GemmType { kBf16, kE4M3, kE5M2 };

// The most candidates the tuner times (LTRAIN_GEMM_CANDIDATES), and its default.
constexpr int kGemmMaxCandidates = 32;

struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0;
  Epilogue epilogue = Epilogue::kNone;
  const void* bias = nullptr;  // kBias, kGeluAuxBias: bf16 [m] (fp32 where fp32_out)
  void* bias_grad = nullptr;   // kDGeluBGrad: bf16 [m]; kBGradB: bf16 [n]
  void* aux = nullptr;         // kGeluAuxBias (written), kDGelu, kDGeluBGrad (read): bf16, laid out like D
  int64_t ld_aux = 0;
  // D = product + beta · C (+ the epilogue's bias), C laid out like D with leading dimension ldc;
  // C null: C is D itself (beta 0: D is only written; 1: the product is added to what D holds).
  float beta = 0.0f;
  const void* c = nullptr;
  int64_t ldc = 0;
  // C, D and the bias fp32 (A and B stay bf16); only with kNone or kBias.
  bool fp32_out = false;
  // Plan for this many fewer SMs than the device has, leaving them to collectives that run at the
  // same time on another stream (0: all SMs).
  int sm_margin = 0;
  // Choose among cuBLASLt's first few candidates for this problem by timing them, once per problem
  // (the first call synchronizes the stream); false: the heuristic's first choice.
  bool tune = false;
  int candidates = kGemmMaxCandidates;  // how many of cuBLASLt's candidates `tune` times (1 to kGemmMaxCandidates)
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // FP8 operands (both or neither; not both e5m2). cuBLASLt takes them transposed-A, plain-B only
  // (trans_a and not trans_b: both contiguous along k). a_scale_inv and b_scale_inv are fp32 device
  // pointers to the multipliers that take the FP8 values back to theirs: one each, or with `rowwise`
  // one per row of op(A) (m of them) and one per column of op(B) (n). With fp32_out the bias stays
  // bf16. fast_accum: Hopper's faster accumulation without periodic promotion (forward products).
  GemmType a_type = GemmType::kBf16, b_type = GemmType::kBf16;
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  bool rowwise = false;
  bool fast_accum = false;
};

// The three products of a linear layer over row-major x [rows, in], w [out, in]:
//   forward          y [rows, out] = x · wᵀ
//   input gradient  dx [rows, in]  = grad [rows, out] · w
//   weight gradient dw [out, in]   = gradᵀ · x
inline GemmArgs LinearForward(const void* x, const void* w, void* y, int64_t rows, int64_t in, int64_t out) {
  GemmArgs g;
  g.trans_a = true;
  g.m = out, g.n = rows, g.k = in;
  g.a = w, g.lda = in;
  g.b = x, g.ldb = in;
  g.d = y, g.ldd = out;
  return g;
}

inline GemmArgs LinearInputGrad(const void* grad, const void* w, void* dx, int64_t rows, int64_t in, int64_t out) {
  GemmArgs g;
  g.m = in, g.n = rows, g.k = out;
  g.a = w, g.lda = in;
  g.b = grad, g.ldb = out;
  g.d = dx, g.ldd = in;
  return g;
}

inline GemmArgs LinearWeightGrad(const void* grad, const void* x, void* dw, int64_t rows, int64_t in, int64_t out) {
  GemmArgs g;
  g.trans_b = true;
  g.m = in, g.n = out, g.k = rows;
  g.a = x, g.lda = in;
  g.b = grad, g.ldb = out;
  g.d = dw, g.ldd = in;
  return g;
}

// The workspace a product may use (callers allocate it on the stream they pass).
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

// Queues the product on `stream` (of the current device). Returns "" or what failed.
std::string GemmBf16(const GemmArgs& args, cudaStream_t stream);

// Whether this cuBLASLt scales FP8 operands per row (CUDA 12.9 and later).
bool GemmHasRowwiseFp8();

}  // namespace ltrain::worker::cuda

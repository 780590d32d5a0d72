#include "worker/model/cuda/gemm.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <mutex>

#include <cublasLt.h>
#include <cublas_api.h>

namespace ltrain::worker::cuda {
namespace {

std::string Failed(const char* what, cublasStatus_t status) {
  return std::string("cuBLASLt ") + what + " failed with status " + std::to_string(static_cast<int>(status));
}

// Owners of cuBLASLt descriptors.
struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() {
    if (d) cublasLtMatmulDescDestroy(d);
  }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() {
    if (l) cublasLtMatrixLayoutDestroy(l);
  }
};
struct Pref {
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() {
    if (p) cublasLtMatmulPreferenceDestroy(p);
  }
};

// Largest power of two (up to 256) that divides the address.
uint32_t Alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

cublasLtEpilogue_t LtEpilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kNone: return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU;
    case Epilogue::kDGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case Epilogue::kBGradB: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

cudaDataType_t LtType(GemmType type) {
  switch (type) {
    case GemmType::kBf16: return CUDA_R_16BF;
    case GemmType::kE4M3: return CUDA_R_8F_E4M3;
    case GemmType::kE5M2: return CUDA_R_8F_E5M2;
  }
  return CUDA_R_16BF;
}

constexpr size_t kKeySize = 27;

// Handles (one per device) and the algorithm chosen per problem, shared by every thread.
struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::array<int64_t, kKeySize>, cublasLtMatmulAlgo_t> algos;
};

State& Shared() {
  static State* state = new State();  // never destroyed: products may run until exit
  return *state;
}

}  // namespace

bool GemmHasRowwiseFp8() {
#if CUBLAS_VERSION >= 120900
  return true;
#else
  return false;
#endif
}

std::string GemmBf16(const GemmArgs& g, cudaStream_t stream) {
  const bool fp8 = g.a_type != GemmType::kBf16 || g.b_type != GemmType::kBf16;
  if (fp8) {
    if (g.a_type == GemmType::kBf16 || g.b_type == GemmType::kBf16) return "an FP8 product takes both operands in FP8";
    if (g.a_type == GemmType::kE5M2 && g.b_type == GemmType::kE5M2) return "an FP8 product takes at most one e5m2 operand";
    if (!g.trans_a || g.trans_b) return "an FP8 product takes A transposed and B not (both contiguous along k)";
    if (g.a_scale_inv == nullptr || g.b_scale_inv == nullptr) return "an FP8 product needs the scales of both operands";
    if (g.rowwise && !GemmHasRowwiseFp8()) return "this cuBLASLt has no rowwise FP8 scales (CUDA 12.9 and later have)";
  }
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "cudaGetDevice failed";
  State& state = Shared();
  cublasLtHandle_t handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    auto it = state.handles.find(device);
    if (it == state.handles.end()) {
      if (cublasStatus_t s = cublasLtCreate(&handle); s != CUBLAS_STATUS_SUCCESS) return Failed("create", s);
      state.handles[device] = handle;
    } else {
      handle = it->second;
    }
  }

  Desc desc;
  if (cublasStatus_t s = cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F); s != CUBLAS_STATUS_SUCCESS) {
    return Failed("matmul descriptor", s);
  }
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = LtEpilogue(g.epilogue);
  cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a));
  cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b));
  cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  const void* bias = nullptr;
  switch (g.epilogue) {
    case Epilogue::kBias:
    case Epilogue::kGeluAuxBias: bias = g.bias; break;
    case Epilogue::kDGeluBGrad:
    case Epilogue::kBGradB: bias = g.bias_grad; break;
    case Epilogue::kDGelu:
    case Epilogue::kNone: break;
  }
  if (g.fp32_out && g.epilogue != Epilogue::kNone && g.epilogue != Epilogue::kBias) {
    return "an fp32 product output takes no epilogue but the bias";
  }
  if (bias != nullptr) {
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    if (fp8 && g.fp32_out) {
      const cudaDataType_t bias_type = CUDA_R_16BF;  // FP8 products add a bf16 bias, also into fp32
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
    }
  }
  if (fp8) {
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g.a_scale_inv, sizeof(g.a_scale_inv));
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_scale_inv, sizeof(g.b_scale_inv));
#if CUBLAS_VERSION >= 120900
    if (g.rowwise) {
      const cublasLtMatmulMatrixScale_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode));
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode));
    }
#endif
    const int8_t fast = g.fast_accum ? 1 : 0;
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
  }
  int32_t sm_target = 0;
  if (g.sm_margin > 0) {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (sms > g.sm_margin) sm_target = sms - g.sm_margin;
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target, sizeof(sm_target));
  }
  const bool uses_aux =
      g.epilogue == Epilogue::kGeluAuxBias || g.epilogue == Epilogue::kDGelu || g.epilogue == Epilogue::kDGeluBGrad;
  if (uses_aux) {
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &g.aux, sizeof(g.aux));
    cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &g.ld_aux, sizeof(g.ld_aux));
  }

  Layout la, lb, ld, lc;
  const uint64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  const uint64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
  if (cublasStatus_t s = cublasLtMatrixLayoutCreate(&la.l, LtType(g.a_type), a_rows, a_cols, g.lda); s != CUBLAS_STATUS_SUCCESS) {
    return Failed("layout of A", s);
  }
  if (cublasStatus_t s = cublasLtMatrixLayoutCreate(&lb.l, LtType(g.b_type), b_rows, b_cols, g.ldb); s != CUBLAS_STATUS_SUCCESS) {
    return Failed("layout of B", s);
  }
  const cudaDataType_t out_type = g.fp32_out ? CUDA_R_32F : CUDA_R_16BF;
  if (cublasStatus_t s = cublasLtMatrixLayoutCreate(&ld.l, out_type, g.m, g.n, g.ldd); s != CUBLAS_STATUS_SUCCESS) {
    return Failed("layout of D", s);
  }

  const bool own_c = g.c != nullptr;
  if (own_c) {
    if (cublasStatus_t s = cublasLtMatrixLayoutCreate(&lc.l, out_type, g.m, g.n, g.ldc); s != CUBLAS_STATUS_SUCCESS) {
      return Failed("layout of C", s);
    }
  }
  const void* c = own_c ? g.c : g.d;
  cublasLtMatrixLayout_t c_layout = own_c ? lc.l : ld.l;

  const uint32_t align_a = Alignment(g.a), align_b = Alignment(g.b), align_c = Alignment(c), align_d = Alignment(g.d);
  const std::array<int64_t, kKeySize> key = {device, sm_target, g.tune, g.trans_a, g.trans_b, g.beta != 0.0f, g.m, g.n, g.k,
                                             g.lda, g.ldb, g.ldd, own_c ? g.ldc : -1, static_cast<int64_t>(g.epilogue),
                                             g.ld_aux, align_a, align_b, align_c, align_d, Alignment(bias),
                                             uses_aux ? Alignment(g.aux) : 0, static_cast<int64_t>(g.workspace_bytes),
                                             g.fp32_out, static_cast<int64_t>(g.a_type), static_cast<int64_t>(g.b_type),
                                             g.rowwise, g.fast_accum};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    auto it = state.algos.find(key);
    if (it != state.algos.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    Pref pref;
    if (cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref.p); s != CUBLAS_STATUS_SUCCESS) return Failed("preference", s);
    const uint64_t workspace = g.workspace_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
    cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
    cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c));
    cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
    constexpr int kCandidates = kGemmMaxCandidates;
    std::array<cublasLtMatmulHeuristicResult_t, kCandidates> results = {};
    int found = 0;
    const int requested = g.tune ? std::clamp(g.candidates, 1, kCandidates) : 1;
    if (cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, c_layout, ld.l, pref.p,
                                                          requested, results.data(), &found);
        s != CUBLAS_STATUS_SUCCESS || found == 0) {
      return "cuBLASLt found no algorithm for a " + std::to_string(g.m) + "x" + std::to_string(g.n) + "x" +
             std::to_string(g.k) + (fp8 ? " FP8" : " bf16") + " product with epilogue " +
             std::to_string(static_cast<int>(epilogue)) +
             " (status " + std::to_string(static_cast<int>(s)) + ")";
    }
    algo = results[0].algo;
    if (found > 1) {
      // Time the candidates on this problem once. A product that adds to D runs them into a scratch
      // D (and C, where C is D), so that the real D is written once, by the call below; the others
      // rewrite the same values (aux and bias gradients included).
      void* scratch = nullptr;
      const size_t d_bytes = static_cast<size_t>(g.ldd) * static_cast<size_t>(g.n) * (g.fp32_out ? 4 : 2);
      if (g.beta == 0.0f || cudaMallocAsync(&scratch, d_bytes, stream) == cudaSuccess) {
        void* d = scratch != nullptr ? scratch : g.d;
        const void* c_run = scratch != nullptr && !own_c ? scratch : c;
        cudaEvent_t start = nullptr, stop = nullptr;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        const float one = 1.0f;
        // Beyond the heuristic's own choice, no split-K whose partial sums meet in bf16 (in place or
        // in the output type): only those summed in fp32.
        std::array<bool, kCandidates> usable = {};
        for (int i = 0; i < found; ++i) {
          int32_t splits = 1;
          uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
          size_t written = 0;
          cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits),
                                               &written);
          cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                               sizeof(scheme), &written);
          usable[i] = i == 0 || splits == 1 || scheme == CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        }
        auto run = [&](int i) {
          return cublasLtMatmul(handle, desc.d, &one, g.a, la.l, g.b, lb.l, &g.beta, c_run, c_layout, d, ld.l,
                                &results[i].algo, g.workspace, g.workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
        };
        // Each candidate's time is its best of two passes, the second in the opposite order: a clock
        // still rising while the first step runs, or work of another stream beside one pass, favours
        // no candidate by its place in the list.
        std::array<float, kCandidates> best_ms = {};
        for (int pass = 0; pass < 2; ++pass) {
          for (int j = 0; j < found; ++j) {
            const int i = pass == 0 ? j : found - 1 - j;
            if (!usable[i] || !run(i)) {
              usable[i] = false;
              continue;
            }
            cudaEventRecord(start, stream);
            constexpr int kRuns = 3;
            bool ok = true;
            for (int r = 0; r < kRuns && ok; ++r) ok = run(i);
            cudaEventRecord(stop, stream);
            float ms = 0.0f;
            if (!ok || cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
              usable[i] = false;
              continue;
            }
            if (best_ms[i] == 0.0f || ms < best_ms[i]) best_ms[i] = ms;
          }
        }
        // The fastest other candidate replaces the heuristic's choice only when faster by more than
        // the timing's noise (1%).
        int fastest = -1;
        for (int i = 1; i < found; ++i) {
          if (usable[i] && (fastest < 0 || best_ms[i] < best_ms[fastest])) fastest = i;
        }
        if (fastest > 0 && (!usable[0] || best_ms[fastest] < 0.99f * best_ms[0])) algo = results[fastest].algo;
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        if (scratch != nullptr) cudaFreeAsync(scratch, stream);
      } else {
        cudaGetLastError();  // no scratch: the heuristic's first choice
      }
    }
    std::lock_guard<std::mutex> lock(state.mu);
    state.algos[key] = algo;
  }

  const float alpha = 1.0f;
  if (cublasStatus_t s = cublasLtMatmul(handle, desc.d, &alpha, g.a, la.l, g.b, lb.l, &g.beta, c, c_layout, g.d, ld.l, &algo,
                                        g.workspace, g.workspace_bytes, stream);
      s != CUBLAS_STATUS_SUCCESS) {
    return Failed("matmul", s);
  }
  return "";
}

}  // namespace ltrain::worker::cuda

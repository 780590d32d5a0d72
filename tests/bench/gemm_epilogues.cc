// Times the linear layers' matrix products with and without cuBLASLt's fused epilogues, next to the
// separate LibTorch kernels they replace, for one GPT model's shapes on the current GPU. Prints a
// table (milliseconds per call); it is what chose the epilogues the worker uses (docs/performance.md).
//   gemm_epilogues [d_model] [rows]      (defaults: 2048 and 16384, gpt-1.3b at micro-batch 8)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "worker/model/cuda/gemm.h"

namespace {

using ltrain::worker::cuda::Epilogue;
using ltrain::worker::cuda::GemmArgs;

double Time(const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  torch::cuda::synchronize();
  const int reps = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / reps;
}

torch::Tensor workspace;

void Run(GemmArgs g) {
  g.workspace = workspace.data_ptr();
  g.workspace_bytes = ltrain::worker::cuda::kGemmWorkspaceBytes;
  const std::string error = ltrain::worker::cuda::GemmBf16(g, c10::cuda::getCurrentCUDAStream().stream());
  if (!error.empty()) {
    std::fprintf(stderr, "gemm_epilogues: %s\n", error.c_str());
    std::exit(1);
  }
}

GemmArgs Forward(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) {
  return ltrain::worker::cuda::LinearForward(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.size(0), x.size(1), w.size(0));
}

GemmArgs InputGrad(const torch::Tensor& grad, const torch::Tensor& w, torch::Tensor& dx) {
  return ltrain::worker::cuda::LinearInputGrad(grad.data_ptr(), w.data_ptr(), dx.data_ptr(), grad.size(0), w.size(1),
                                               w.size(0));
}

GemmArgs WeightGrad(const torch::Tensor& grad, const torch::Tensor& x, torch::Tensor& dw) {
  return ltrain::worker::cuda::LinearWeightGrad(grad.data_ptr(), x.data_ptr(), dw.data_ptr(), x.size(0), x.size(1),
                                                grad.size(1));
}

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("gemm_epilogues: no CUDA device, skipped\n");
    return 77;
  }
  const int64_t d = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int64_t rows = argc > 2 ? std::atoll(argv[2]) : 16384;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  workspace = torch::empty({static_cast<int64_t>(ltrain::worker::cuda::kGemmWorkspaceBytes)}, bf16.dtype(torch::kByte));
  std::printf("d_model %ld, %ld rows; ms per call\n", static_cast<long>(d), static_cast<long>(rows));

  for (const int64_t width : {4 * d, 3 * d, d}) {
    torch::Tensor x = torch::randn({rows, d}, bf16), w = torch::randn({width, d}, bf16) * 0.02;
    torch::Tensor b = torch::randn({width}, bf16), y = torch::empty({rows, width}, bf16);
    torch::Tensor aux = torch::empty({rows, width}, bf16), g = torch::randn({rows, width}, bf16);
    torch::Tensor dw = torch::empty({width, d}, bf16), db = torch::empty({width}, bf16);
    std::printf("\n[%ld x %ld] · [%ld x %ld]ᵀ\n", static_cast<long>(rows), static_cast<long>(d),
                static_cast<long>(width), static_cast<long>(d));
    std::printf("  forward        at::linear %.3f | product %.3f | +bias %.3f | +gelu_aux_bias %.3f | at::gelu %.3f\n",
                Time([&] { (void)at::linear(x, w, b); }), Time([&] { Run(Forward(x, w, y)); }), Time([&] {
                  GemmArgs a = Forward(x, w, y);
                  a.epilogue = Epilogue::kBias, a.bias = b.data_ptr();
                  Run(a);
                }),
                Time([&] {
                  GemmArgs a = Forward(x, w, y);
                  a.epilogue = Epilogue::kGeluAuxBias, a.bias = b.data_ptr(), a.aux = aux.data_ptr(), a.ld_aux = width;
                  Run(a);
                }),
                Time([&] { (void)torch::gelu(y, "tanh"); }));
    std::printf("  weight grad    at::mm %.3f | product %.3f | +bgradb %.3f | sum(0) %.3f\n",
                Time([&] { (void)at::mm(g.t(), x); }), Time([&] { Run(WeightGrad(g, x, dw)); }), Time([&] {
                  GemmArgs a = WeightGrad(g, x, dw);
                  a.epilogue = Epilogue::kBGradB, a.bias_grad = db.data_ptr();
                  Run(a);
                }),
                Time([&] { (void)g.sum(0); }));
    // The input gradient of a layer whose output width is d feeding a GELU of width `width` (fc2).
    torch::Tensor g2 = torch::randn({rows, d}, bf16), w2 = torch::randn({d, width}, bf16) * 0.02;
    torch::Tensor dx = torch::empty({rows, width}, bf16);
    std::printf("  input grad     at::mm %.3f | product %.3f | +dgelu %.3f | +dgelu_bgrad %.3f | gelu_backward %.3f\n",
                Time([&] { (void)at::mm(g2, w2); }), Time([&] { Run(InputGrad(g2, w2, dx)); }), Time([&] {
                  GemmArgs a = InputGrad(g2, w2, dx);
                  a.epilogue = Epilogue::kDGelu, a.aux = aux.data_ptr(), a.ld_aux = width;
                  Run(a);
                }),
                Time([&] {
                  GemmArgs a = InputGrad(g2, w2, dx);
                  a.epilogue = Epilogue::kDGeluBGrad, a.aux = aux.data_ptr(), a.ld_aux = width, a.bias_grad = db.data_ptr();
                  Run(a);
                }),
                Time([&] { (void)at::gelu_backward(dx, aux, "tanh"); }));
  }
  return 0;
}

// A step's figures (part of Trainer, trainer.h): the MoE blocks' route counts and the router biases
// they move, the FP8 products' amaxes, the check of the loss, the throughput line.
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "common/layout_plan.h"
#include "worker/torch_compat.h"
#include "worker/train/trainer.h"
#include "worker/train/trainer_internal.h"

namespace ltrain::worker {

Status Trainer::SettleRouting() {
  if (model_->MoeLayers().empty() && recipe_.model.moe.experts == 0) return Status::Ok();
  torch::NoGradGuard no_grad;
  const int layers = recipe_.model.layers;
  const torch::TensorOptions f32 = torch::TensorOptions().dtype(torch::kFloat).device(device_);
  // [layers load ratios, aux sum, aux count, z sum, z count, layers x experts assignments, dropped,
  // routed]: this stage's blocks, the others' zero.
  const int64_t experts = recipe_.model.moe.experts;
  const int64_t drops = layers + 4 + layers * experts;
  torch::Tensor figures = torch::zeros({drops + 2}, f32);
  if (!model_->MoeLayers().empty()) {
    torch::Tensor counts = model_->TakeRouteCounts();
    LTRAIN_RETURN_IF_ERROR(store_->DpAllReduce(counts));
    model_->UpdateRouterBias(counts);
    const torch::Tensor ratios = counts.amax(-1) / counts.mean(-1).clamp_min(1e-20);
    const std::vector<int>& moe_layers = model_->MoeLayers();
    const torch::Tensor index = torch::tensor(std::vector<int64_t>(moe_layers.begin(), moe_layers.end()),
                                              torch::TensorOptions().dtype(torch::kLong)).to(device_);
    // Each data-parallel rank adds the same ratios: divided by dp below.
    figures.narrow(0, 0, layers).index_copy_(0, index, ratios.to(torch::kFloat));
    figures.narrow(0, layers + 4, layers * experts).view({layers, experts}).index_copy_(0, index, counts.to(torch::kFloat));
    auto [aux, z] = model_->TakeRouterLosses();
    if (aux.defined()) figures[layers] = aux.to(torch::kFloat), figures[layers + 1] = 1;
    if (z.defined()) figures[layers + 2] = z.to(torch::kFloat), figures[layers + 3] = 1;
    const auto [dropped, routed] = model_->TakeDropCounts();
    figures[drops] = dropped, figures[drops + 1] = routed;
  }
  LTRAIN_RETURN_IF_ERROR(store_->DpAllReduce(figures));
  figures.narrow(0, 0, layers).div_(layout_.dp);
  figures.narrow(0, layers + 4, layers * experts).div_(layout_.dp);
  if (layout_.pp > 1) LTRAIN_RETURN_IF_ERROR(groups_->pp->AllReduceSum(figures));
  moe_figures_ = figures;
  return Status::Ok();
}

std::optional<StepFigures::Moe> Trainer::MoeFiguresOf(const torch::Tensor& figures, bool detail) const {
  if (!figures.defined()) return std::nullopt;
  const torch::Tensor host = figures.to(torch::kCPU, torch::kDouble).contiguous();
  const double* v = host.data_ptr<double>();
  const int layers = recipe_.model.layers;
  StepFigures::Moe f;
  int blocks = 0;
  double sum = 0;
  const int64_t experts = recipe_.model.moe.experts;
  for (int l = 0; l < layers; ++l) {
    if (!IsMoeLayer(recipe_.model, l)) continue;
    ++blocks;
    sum += v[l];
    if (v[l] > f.load_max) f.load_max = v[l], f.worst_layer = l;
    f.layers.push_back(l);
    f.layer_load.push_back(v[l]);
    if (detail) f.tokens_per_expert.emplace_back(v + layers + 4 + l * experts, v + layers + 4 + (l + 1) * experts);
  }
  f.load_mean = blocks > 0 ? sum / blocks : 0;
  if (v[layers + 1] > 0) f.aux_loss = v[layers] / v[layers + 1];
  if (v[layers + 3] > 0) f.z_loss = v[layers + 2] / v[layers + 3];
  const int64_t drops = layers + 4 + layers * experts;
  if (recipe_.model.moe.capacity_factor > 0) f.drop_rate = v[drops + 1] > 0 ? v[drops] / v[drops + 1] : 0;
  return f;
}

std::optional<StepFigures::Fp8> Trainer::Fp8FiguresOf(const torch::Tensor& figures, int64_t step) {
  if (!figures.defined()) return std::nullopt;
  const torch::Tensor host = figures.to(torch::kCPU, torch::kDouble).contiguous();
  const double* v = host.data_ptr<double>();
  StepFigures::Fp8 f;
  f.activation_amax_max = v[0], f.activation_amax_min = v[1];
  f.weight_amax_max = v[2], f.weight_amax_min = v[3];
  f.gradient_amax_max = v[4], f.gradient_amax_min = v[5];
  f.products = static_cast<int>(v[6]);
  f.overflowed = static_cast<int>(v[7]);
  if (f.overflowed > 0) {
    ++fp8_overflow_steps_;
    fp8_last_overflow_step_ = step;
    // Said on the rank where it happened: each rank quantizes its own operands.
    std::printf("rank %d step %lld: FP8 overflow: %d of %d operands had an amax that was not finite (largest amax: "
                "activations %g, weights %g, gradients %g); %lld such steps so far\n",
                groups_->rank, static_cast<long long>(step), f.overflowed, f.products, f.activation_amax_max,
                f.weight_amax_max, f.gradient_amax_max, static_cast<long long>(fp8_overflow_steps_));
    std::fflush(stdout);
  }
  f.overflow_steps = fp8_overflow_steps_;
  f.last_overflow_step = fp8_last_overflow_step_;
  return f;
}

Status Trainer::CheckLoss(double value, int64_t step, int fp8_overflowed) const {
  if (std::isfinite(value)) return Status::Ok();
  if (fp8_overflowed > 0) {
    return Internal("loss became " + std::to_string(value) + " at step " + std::to_string(step) + " after " +
                    std::to_string(fp8_overflowed) + " of the step's FP8 operands overflowed (an amax not finite); "
                    "lower training.lr, or train in parallel.precision: bf16-fp32-residual");
  }
  return Internal("loss became " + std::to_string(value) + " at step " + std::to_string(step) +
                  "; lower training.lr or check the data");
}

void Trainer::PrintThroughput(int64_t first_step, int64_t steps, double total_ms, int64_t left_out) const {
  const ModelSpec& m = recipe_.model;
  const double flops_per_token = ModelFlopsPerToken(recipe_.model);
  const double step_ms = total_ms / static_cast<double>(steps - left_out);
  const double tokens = static_cast<double>(layout_.global_batch) * m.seq_len / (step_ms / 1000.0);
  const double per_device = tokens / layout_.world_size;
  const double tflops = per_device * flops_per_token / 1e12;
  std::printf("throughput: steps %lld-%lld step_ms %.1f tok/s %.0f tok/s/device %.0f tflops/device %.1f",
              static_cast<long long>(first_step), static_cast<long long>(first_step + steps - 1), step_ms, tokens,
              per_device, tflops);
  if (device_.is_cuda()) {
    // MFU against the H100's dense bf16 peak (989 TFLOP/s), as the peers report it.
    std::printf(" mfu %.1f%% peak_mem_gib %.1f", 100.0 * tflops * 1e12 / kGpuPeakFlops,
                static_cast<double>(PeakDeviceBytes()) / (1024.0 * 1024.0 * 1024.0));
  }
  std::printf("\n");
  if (left_out > 0) {
    std::printf("throughput: without the %lld profiled step(s) and the writing of their trace\n",
                static_cast<long long>(left_out));
  }
  std::fflush(stdout);
}

}  // namespace ltrain::worker

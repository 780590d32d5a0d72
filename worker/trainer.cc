#include "worker/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include <torch/nn/utils/clip_grad.h>

#include "worker/checkpoint.h"
#include "worker/progress.h"
#include "worker/torch_compat.h"

namespace ltrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

double MillisSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

StatusOr<Layout> PlanLayout(const Recipe& recipe, int world_size) {
  const ParallelSpec& p = recipe.parallel;
  if (p.tp > 1) return InvalidArgument("parallel.tp>1 is not supported by this worker yet (tp=" + std::to_string(p.tp) + ")");
  if (p.pp > 1) return InvalidArgument("parallel.pp>1 is not supported by this worker yet (pp=" + std::to_string(p.pp) + ")");
  if (p.zero != 0) return InvalidArgument("parallel.zero>0 is not supported by this worker yet (zero=" + std::to_string(p.zero) + ")");
  if (world_size < 1) return InvalidArgument("world size " + std::to_string(world_size) + " must be >= 1");
  const ModelSpec& m = recipe.model;
  if (m.heads < 1 || m.d_model % m.heads != 0) {
    return InvalidArgument("model.heads=" + std::to_string(m.heads) + " does not divide model.d_model=" +
                           std::to_string(m.d_model));
  }
  Layout layout;
  layout.world_size = world_size;
  layout.dp = world_size;
  layout.micro_batch = recipe.training.micro_batch;
  layout.global_batch = recipe.training.global_batch;
  const int per_step = layout.micro_batch * layout.dp;
  if (layout.micro_batch < 1 || layout.global_batch < per_step || layout.global_batch % per_step != 0) {
    return InvalidArgument("training.global_batch=" + std::to_string(layout.global_batch) +
                           " is not a positive multiple of training.micro_batch*dp=" +
                           std::to_string(layout.micro_batch) + "*" + std::to_string(layout.dp) + "=" +
                           std::to_string(per_step) + "; change global_batch or micro_batch");
  }
  layout.accumulation = layout.global_batch / per_step;
  return layout;
}

Trainer::Trainer(const Recipe& recipe, const TrainerOptions& options, Communicator* comm, Layout layout,
                 TokenDataset data)
    : recipe_(recipe),
      options_(options),
      comm_(comm),
      layout_(layout),
      data_(std::move(data)),
      sampler_(&data_, recipe.training.seed, recipe.model.seq_len) {}

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const Recipe& recipe, const TrainerOptions& options,
                                                   Communicator* comm) {
  StatusOr<Layout> layout = PlanLayout(recipe, comm->size());
  if (!layout.ok()) return layout.status();
  if (recipe.data.path.empty()) return InvalidArgument("data.path is empty: point it at a directory written by `ltrain data prepare`");
  StatusOr<TokenDataset> data = TokenDataset::Open(recipe.data.path + "/train.bin");
  if (!data.ok()) return data.status();
  if (data->vocab() > recipe.model.vocab) {
    return InvalidArgument("token file " + data->path() + " has vocab " + std::to_string(data->vocab()) +
                           " but model.vocab=" + std::to_string(recipe.model.vocab) + "; raise model.vocab");
  }
  std::unique_ptr<Trainer> trainer(new Trainer(recipe, options, comm, *layout, std::move(data).value()));
  if (Status s = trainer->sampler_.Check(); !s.ok()) return s;
  if (Status s = trainer->Init(); !s.ok()) return s;
  return trainer;
}

Status Trainer::Init() {
  if (recipe_.parallel.device == "cuda") {
    if (!compat::kBuiltWithCuda) {
      return InvalidArgument("parallel.device=cuda needs a worker built against LibTorch with CUDA; this one is CPU-only (use device: cpu)");
    }
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(options_.local_rank));
  } else if (recipe_.parallel.device != "cpu") {
    return InvalidArgument("parallel.device=" + recipe_.parallel.device + " is neither cpu nor cuda");
  }

  const TrainingSpec& t = recipe_.training;
  schedule_ = LrSchedule{t.lr, t.min_lr, t.warmup_steps, t.steps, t.lr_schedule != "constant"};

  // Same seed on every rank gives the same parameters; the broadcast below makes it a guarantee.
  torch::manual_seed(t.seed);
  GptConfig config{recipe_.model.layers, recipe_.model.d_model, recipe_.model.heads, recipe_.model.seq_len,
                   recipe_.model.vocab};
  model_ = Gpt(config);
  model_->to(device_);
  params_ = model_->parameters();

  // Weight decay only on matrices (and the embeddings); never on biases or LayerNorm gains.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : params_) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto options = torch::optim::AdamWOptions(t.lr).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(options).weight_decay(t.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(options).weight_decay(0.0)));
  optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), options);

  for (const auto& p : params_) grad_numel_ += p.numel();
  flat_ = torch::zeros({grad_numel_ + 1}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  inputs_host_ = torch::empty({layout_.micro_batch, recipe_.model.seq_len}, torch::kLong);
  targets_host_ = torch::empty({layout_.micro_batch, recipe_.model.seq_len}, torch::kLong);

  {
    torch::NoGradGuard no_grad;
    torch::Tensor params_flat = torch::cat([&] {
      std::vector<torch::Tensor> views;
      for (const auto& p : params_) views.push_back(p.detach().reshape(-1));
      return views;
    }());
    if (Status s = comm_->Broadcast(params_flat, 0); !s.ok()) return s;
    int64_t offset = 0;
    for (auto& p : params_) {
      p.view(-1).copy_(params_flat.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
  }

  const std::string& resume = recipe_.checkpoint.resume_from;
  if (!resume.empty()) {
    StatusOr<std::string> step_dir = ResolveCheckpoint(resume);
    if (!step_dir.ok()) return step_dir.status();
    StatusOr<CheckpointMeta> meta = LoadCheckpoint(*step_dir, *model_, *optimizer_);
    if (!meta.ok()) return meta.status();
    step_ = meta->step;
    data_position_ = meta->data_position;
    if (options_.rank == 0 && options_.print_progress) {
      std::printf("resumed from %s at step %lld data_position %lld (saved by world size %d)\n",
                  step_dir->c_str(), static_cast<long long>(step_), static_cast<long long>(data_position_),
                  meta->world_size);
    }
  }
  run_start_step_ = step_;
  run_start_position_ = data_position_;
  return Status::Ok();
}

void Trainer::PackGrads(const torch::Tensor& extra) {
  int64_t offset = 0;
  for (const auto& p : params_) {
    torch::Tensor slice = flat_.narrow(0, offset, p.numel());
    const torch::Tensor& g = p.grad();
    if (g.defined()) {
      slice.copy_(g.reshape(-1));
    } else {
      slice.zero_();
    }
    offset += p.numel();
  }
  flat_.narrow(0, grad_numel_, 1).copy_(extra.reshape({1}));
}

void Trainer::UnpackGrads() {
  int64_t offset = 0;
  for (auto& p : params_) {
    torch::Tensor slice = flat_.narrow(0, offset, p.numel()).view_as(p);
    if (p.grad().defined()) {
      p.mutable_grad().copy_(slice);
    } else {
      p.mutable_grad() = slice.clone();
    }
    offset += p.numel();
  }
}

StatusOr<double> Trainer::Step() {
  const int64_t step = step_;
  const double lr = LearningRate(schedule_, step);
  for (auto& group : optimizer_->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
  compat::ZeroGrad(*optimizer_);
  model_->train();

  const int accumulation = layout_.accumulation;
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  for (int a = 0; a < accumulation; ++a) {
    BatchSlice slice;
    slice.position0 = run_start_position_;
    slice.step = step - run_start_step_;
    slice.global_batch = layout_.global_batch;
    slice.dp_rank = comm_->rank();
    slice.dp = layout_.dp;
    slice.micro_step = a;
    slice.micro_batch = layout_.micro_batch;
    sampler_.Fill(slice, inputs_host_.data_ptr<int64_t>(), targets_host_.data_ptr<int64_t>());
    Progress::Global().SetPhase(step + 1, "forward");
    torch::Tensor loss = model_->forward(inputs_host_.to(device_), targets_host_.to(device_));
    Progress::Global().SetPhase(step + 1, "backward");
    (loss / accumulation).backward();
    loss_sum += loss.detach();
  }
  torch::Tensor local_loss = loss_sum / accumulation;

  double loss_value = 0.0;
  if (comm_->size() > 1) {
    torch::NoGradGuard no_grad;
    PackGrads(local_loss);
    if (Status s = comm_->AllReduceSum(flat_); !s.ok()) return s;
    flat_.div_(layout_.dp);
    UnpackGrads();
    loss_value = flat_[grad_numel_].item<double>();
  } else {
    loss_value = local_loss.item<double>();
  }
  if (!std::isfinite(loss_value)) {
    return Internal("loss became " + std::to_string(loss_value) + " at step " + std::to_string(step + 1) +
                    "; lower training.lr or check the data");
  }
  Progress::Global().SetPhase(step + 1, "optimizer");
  if (recipe_.training.grad_clip > 0) torch::nn::utils::clip_grad_norm_(params_, recipe_.training.grad_clip);
  optimizer_->step();
  ++step_;
  data_position_ += layout_.global_batch;
  return loss_value;
}

Status Trainer::Save() {
  if (comm_->rank() != 0 || options_.checkpoint_dir.empty()) return Status::Ok();
  Progress::Global().SetPhase(step_, "checkpoint");
  const auto start = Clock::now();
  CheckpointMeta meta;
  meta.step = step_;
  meta.data_position = data_position_;
  meta.world_size = comm_->size();
  meta.generation = options_.generation;
  meta.job_id = options_.job_id;
  if (Status s = SaveCheckpoint(options_.checkpoint_dir, meta, recipe_, *model_, *optimizer_,
                                recipe_.checkpoint.keep);
      !s.ok()) {
    return s;
  }
  if (options_.print_progress) {
    std::printf("checkpoint step-%lld written to %s in %.0f ms\n", static_cast<long long>(step_),
                options_.checkpoint_dir.c_str(), MillisSince(start));
  }
  return Status::Ok();
}

Status Trainer::Run() {
  const TrainingSpec& t = recipe_.training;
  const bool printer = comm_->rank() == 0 && options_.print_progress;
  if (printer) {
    std::printf(
        "model gpt params %lld layers %d d_model %d heads %d seq_len %d vocab %d | layout world %d dp %d "
        "tp %d pp %d zero %d micro_batch %d accumulation %d global_batch %d device %s backend %s threads %d\n",
        static_cast<long long>(model_->NumParameters()), recipe_.model.layers, recipe_.model.d_model,
        recipe_.model.heads, recipe_.model.seq_len, recipe_.model.vocab, layout_.world_size, layout_.dp,
        layout_.tp, layout_.pp, recipe_.parallel.zero, layout_.micro_batch, layout_.accumulation,
        layout_.global_batch, recipe_.parallel.device.c_str(), comm_->backend().c_str(),
        torch::get_num_threads());
  }
  const double tokens_per_step = static_cast<double>(layout_.global_batch) * recipe_.model.seq_len;
  while (step_ < t.steps) {
    const double lr = LearningRate(schedule_, step_);
    const auto start = Clock::now();
    StatusOr<double> loss = Step();
    if (!loss.ok()) return loss.status();
    const double ms = MillisSince(start);
    const int64_t s = step_;
    if (printer && (s == 1 || s == run_start_step_ + 1 || (t.log_every > 0 && s % t.log_every == 0) ||
                    s == t.steps)) {
      std::printf("step %lld/%lld loss %.6f lr %.3e tok/s %.0f step_ms %.1f\n", static_cast<long long>(s),
                  static_cast<long long>(t.steps), *loss, lr, tokens_per_step / (ms / 1000.0), ms);
    }
    const bool periodic = recipe_.checkpoint.every > 0 && s % recipe_.checkpoint.every == 0;
    if (periodic || s == t.steps) {
      if (Status st = Save(); !st.ok()) return st;
    }
  }
  // Keeps the ranks together until rank 0's final checkpoint is committed.
  return comm_->Barrier();
}

}  // namespace ltrain::worker

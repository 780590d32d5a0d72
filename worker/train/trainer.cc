#include "worker/train/trainer.h"

#include <filesystem>
#include <malloc.h>
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include "common/hf_format.h"
#include "common/safetensors.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/checkpoint_writer.h"
#include "worker/control/progress.h"
#include "worker/model/fused_kernels.h"
#include "worker/parallel/unit_hooks.h"
#include "worker/plan/flat_layout.h"
#include "worker/plan/topology.h"
#include "worker/torch_compat.h"
#include "worker/train/trainer_internal.h"

namespace ltrain::worker {
namespace {

// Steps over which a rank's compute figure is taken (StepFigures.compute_steps).
constexpr size_t kComputeWindow = 10;
constexpr int64_t kComputeStartupSteps = 3;  // a CPU rank's first steps, left out of it

// The CPU time spent so far on a rank's work, in milliseconds: the calling thread's where LibTorch
// runs its operations on it alone, else the whole process's over its intra-op threads (which then
// counts the rank's other threads too: the reductions', the collectives').
double WorkCpuMs() {
  const int threads = at::get_num_threads();
  timespec t{};
  ::clock_gettime(threads <= 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID, &t);
  return (static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) / 1e6) / std::max(1, threads);
}

// The core a CPU rank's step ran on, from the core it is on at each of its forward's and backward's
// ends: kNoCore before the first, kSeveralCores once two differ.
constexpr int kNoCore = -1;
constexpr int kSeveralCores = -2;
void NoteCore(int* cpu) {
  const int now = ::sched_getcpu();
  if (now < 0 || *cpu == kSeveralCores) return;
  *cpu = *cpu == kNoCore || *cpu == now ? now : kSeveralCores;
}

// model.init "auto": PyTorch's initialisation below this many parameters, per-parameter from here.
constexpr int64_t kPerParameterInitFrom = 2'000'000'000;

// Bytes the process's heap holds now (every malloc arena plus mmapped blocks).
int64_t HeapInUse() {
  struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

}  // namespace

namespace {
std::string& OutOfMemorySnapshotPath() {
  static std::string path;
  return path;
}
}  // namespace

void SetOutOfMemorySnapshotPath(std::string path) { OutOfMemorySnapshotPath() = std::move(path); }

std::string OutOfMemoryMessage(const c10::OutOfMemoryError& e) {
  std::string message = std::string("out of memory: ") + e.what_without_backtrace() +
                        "; the layout needs less memory a device: parallel.activation_checkpointing: selective (then "
                        "full), a smaller training.micro_batch (the same global_batch accumulates more), a higher "
                        "parallel.zero, or parallel.tp / parallel.pp; `ltrain plan RECIPE --gpu-memory GIB` shows what "
                        "each layout needs";
  const std::string& snapshot = OutOfMemorySnapshotPath();
  std::error_code ec;
  if (!snapshot.empty() && std::filesystem::exists(snapshot, ec)) {
    message += ". What filled the memory: the allocator's snapshot at the failure, " + snapshot +
               " (drop it on https://pytorch.org/memory_viz, PyTorch's memory viewer, or `python3 -m "
               "torch.cuda._memory_viz trace_plot " + snapshot + " -o memory.html`)";
  }
  return message;
}

Status CaughtException(const std::string& what) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError& e) {
    return Internal(what + ": " + OutOfMemoryMessage(e));
  } catch (const c10::Error& e) {
    return Internal(what + ": LibTorch error: " + e.what_without_backtrace());
  } catch (const std::exception& e) {
    // Collectives inside autograd (tensor parallelism) report failure by throwing.
    return Unavailable(what + ": " + e.what());
  }
}

Trainer::Trainer(const Recipe& recipe, const TrainerOptions& options, ProcessGroups* groups, Layout layout,
                 std::unique_ptr<DataLoader> data)
    : recipe_(recipe), options_(options), groups_(groups), layout_(layout), loader_(std::move(data)) {
  if (loader_) {
    // The next step's windows are read on a thread of their own while this step trains.
    prefetcher_ = std::make_unique<BatchPrefetcher>(
        [this](int64_t position, BatchPrefetcher::Batches* out) { MakeBatches(position, out); },
        layout_.global_batch);
  }
}

Trainer::~Trainer() {
  prefetcher_.reset();  // its thread may be writing the trace
  if (data_trace_ != nullptr) std::fclose(data_trace_);
}

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const Recipe& recipe, const TrainerOptions& options,
                                                   Communicator* comm) {
  auto groups = std::make_unique<ProcessGroups>(DataParallelGroups(comm));
  StatusOr<std::unique_ptr<Trainer>> trainer = Create(recipe, options, groups.get());
  if (trainer.ok()) (*trainer)->owned_groups_ = std::move(groups);
  return trainer;
}

StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const Recipe& recipe, const TrainerOptions& options,
                                                   ProcessGroups* groups) {
  LTRAIN_ASSIGN_OR_RETURN(Layout layout, PlanLayout(recipe, groups->world->size()));
  const Layout& t = groups->layout;
  if (t.tp != layout.tp || t.pp != layout.pp || t.dp != layout.dp) {
    return InvalidArgument("process groups (tp " + std::to_string(t.tp) + ", dp " + std::to_string(t.dp) + ", pp " +
                           std::to_string(t.pp) + ") do not match the recipe's layout");
  }
  std::unique_ptr<DataLoader> data;
  if (!options.model_only) {
    LTRAIN_ASSIGN_OR_RETURN(data, OpenTrainingData(recipe));
  }
  std::unique_ptr<Trainer> trainer(new Trainer(recipe, options, groups, layout, std::move(data)));
  if (recipe.training.eval_every > 0 && !options.model_only) {
    // Hash windows of a fixed seed: every evaluation, in every layout and after every resume,
    // reads the same sequences (of every source, by weight).
    StatusOr<std::unique_ptr<DataLoader>> val = DataLoader::Open(
        DataSources(recipe), "val", recipe.model.seq_len, Sampling::kHash, static_cast<uint64_t>(DataSeed(recipe)));
    if (!val.ok()) {
      return FailedPrecondition("training.eval_every=" + std::to_string(recipe.training.eval_every) +
                                " evaluates on the validation split, which `ltrain data prepare` writes beside the "
                                "training one: " +
                                val.status().message() + "; prepare the data again, or set training.eval_every: 0");
    }
    trainer->val_loader_ = std::move(val).value();
  }
  Status s;
  try {
    s = trainer->Init();
  } catch (...) {
    s = CaughtException("initialising the trainer");
  }
  if (!s.ok()) return s;
  return trainer;
}

Status Trainer::Init() {
  const ParallelSpec& p = recipe_.parallel;
  // Saves a previous run left half-written are never read: rank 0 removes them before any rank
  // can start a save of this run (every save follows collectives with rank 0).
  if (options_.rank == 0 && !options_.checkpoint_dir.empty()) RemovePendingCheckpoints(options_.checkpoint_dir, -1);
  if (p.device == Device::kCuda) {
    if (!compat::kBuiltWithCuda) {
      return InvalidArgument("parallel.device=cuda needs a worker built against LibTorch with CUDA; this one is CPU-only (use device: cpu)");
    }
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(options_.local_rank));
  }
  if (recipe_.training.deterministic) compat::UseDeterministicAlgorithms();
  const bool bf16_asked = p.precision == Precision::kBf16 || p.precision == Precision::kBf16Autocast ||
                          p.precision == Precision::kBf16Fp32Residual || p.precision == Precision::kFp8;
  if (bf16_asked && !device_.is_cuda()) {
    return InvalidArgument("parallel.precision=" + NameOf(p.precision) +
                           " needs parallel.device=cuda; on CPU use precision auto or fp32");
  }
  // bf16 on the GPU only. "bf16": the model computes on bf16 copies of fp32 master weights, the
  // optimizer works in fp32 (ZeRO-3 gathers the copies); "bf16-fp32-residual" (and auto) computes as
  // "bf16" but keeps the residual stream (the blocks' inputs and outputs) in fp32, as autocast does;
  // "bf16-autocast" keeps fp32 parameters and gradients and casts per operation (PyTorch AMP).
  bf16_ = device_.is_cuda() && p.precision != Precision::kFp32;
  bf16_params_ = bf16_ && p.precision != Precision::kBf16Autocast;
  fp32_residual_ = bf16_params_ && p.fp32_residual_stream();
  activation_dtype_ = bf16_params_ && !fp32_residual_ ? torch::kBFloat16 : torch::kFloat;

  const TrainingSpec& t = recipe_.training;
  schedule_ = LrSchedule{t.lr, t.min_lr, t.warmup_steps, t.steps, t.lr_schedule != LrScheduleKind::kConstant};

  ModelShardSpec ml;
  ml.config = recipe_.model;
  ml.layout = layout_;
  ml.coords = groups_->coords;
  // Same seed on every rank: every rank draws the same full parameters and keeps its slices.
  ml.per_parameter_init = recipe_.model.init == ModelInit::kPerParameter || recipe_.model.arch != Arch::kGpt2 ||
                          (recipe_.model.init == ModelInit::kAuto && ModelParameterCount(ml.config) >= kPerParameterInitFrom);
  ml.seed = static_cast<uint64_t>(t.seed);
  ml.device = device_;
  ml.fp32_residual = fp32_residual_;
  if (options_.stochastic_residual) {
    if (!bf16_params_ || fp32_residual_) {
      return InvalidArgument("LTRAIN_STOCHASTIC_RESIDUAL=1 rounds a bf16 residual stream's sums: it needs "
                             "parallel.precision=bf16 (this job's is " + NameOf(p.precision) + ")");
    }
    if (layout_.tp != 1 || layout_.activation_checkpointing == ActivationCheckpointing::kFull) {
      return InvalidArgument("LTRAIN_STOCHASTIC_RESIDUAL=1 needs parallel.tp 1 and no full activation "
                             "checkpointing (tp ranks and a recomputed forward would draw other noise)");
    }
    ml.stochastic_residual = true;
  }
  ml.tp_split_batch = options_.tp_split_batch;
  ml.bf16_layers = p.fp8_bf16_layers;
  torch::manual_seed(t.seed);
  LTRAIN_ASSIGN_OR_RETURN(model_, ModelShard::Create(ml, groups_->tp));
  for (const ShardParam& sp : model_->params()) tp_partial_grads_ = tp_partial_grads_ || sp.tp_partial;
  // Partial gradients are summed over tp after backward, before the data-parallel reduction.
  overlap_ = options_.dp_overlap && layout_.pp == 1 && !tp_partial_grads_;

  std::vector<ShardParam>& params = model_->params();
  std::vector<ParamStore::Param> store_params;
  std::vector<int64_t> numels;
  // bf16 on CUDA below ZeRO-2: the gradients only the products write are not zeroed each step.
  const bool products_overwrite = bf16_params_ && device_.is_cuda() && layout_.zero < 2;
  for (size_t i = 0; i < params.size(); ++i) {
    ShardParam& sp = params[i];
    if (device_.is_cuda()) sp.value = sp.value.detach().to(device_).requires_grad_(true);
    ParamStore::Param stored{&sp.value, sp.decay, sp.counts_for_norm,
                             products_overwrite && model_->GradientFromProductsOnly(i)};
    if (sp.expert) {
      // This rank's experts of the stack: checkpoints place them among every expert rank's.
      stored.expert = true;
      stored.saved_offset = sp.value.numel() * (groups_->coords.dp % layout_.ep);
      stored.saved_numel = sp.value.numel() * layout_.ep;
    }
    store_params.push_back(stored);
    numels.push_back(sp.value.numel());
    param_names_.push_back(sp.name);
  }
  // ZeRO-1 or 2 over one data-parallel rank shards nothing: the store runs as zero 0 (on CUDA its
  // update then runs beside the next forward, and writes the bf16 copies in the same pass).
  const int store_zero = layout_.dp == 1 && layout_.zero < 3 ? 0 : layout_.zero;
  // Gradients made block by block in backward and released after the update: where nothing is
  // reduced, no pipeline holds them across micro-batches, and no hook would stop LTRAIN_TP_SPLIT_BATCH.
  const bool transient = store_zero == 0 && layout_.dp == 1 && layout_.pp == 1 && !options_.tp_split_batch &&
                         (options_.transient_gradients == 1 || (options_.transient_gradients == -1 && device_.is_cuda()));
  // ZeRO-3 gathers parameters block by block, and transient gradients are made so: their units are
  // the model's structural units. The other stages reduce buckets of parallel.bucket_mb.
  std::vector<std::vector<int>> units = layout_.zero == 3 || transient
                                            ? StructuralUnits(params)
                                            : PlanBuckets(numels, 4, p.bucket_mb * 1024.0 * 1024.0);
  // Expert parallelism: the experts split over ep go to units of their own, reduced over edp.
  if (layout_.ep > 1) units = SeparateExpertUnits(units, params);
  AdamWConfig adamw;
  adamw.weight_decay = t.weight_decay;
  adamw.beta1 = t.beta1;
  adamw.beta2 = t.beta2;
  StatusOr<std::unique_ptr<ParamStore>> store =
      ParamStore::Create(store_params, units, store_zero, groups_->dp, adamw, bf16_params_,
                         /*exclusive_collectives=*/device_.is_cuda() && (layout_.tp > 1 || layout_.pp > 1 || layout_.ep > 1),
                         /*inline_on_own_stream=*/options_.dp_side_stream, groups_->edp);
  if (!store.ok()) return store.status();
  store_ = std::move(store).value();
  if (options_.recovery != nullptr && (store_zero == 1 || store_zero == 2)) {
    copies_ = std::make_unique<MemoryCopies>(recipe_.fault.memory_checkpoint_every);
  }
  if (loader_ && loader_->masked()) model_->set_masked_targets(true);
  if (layout_.zero == 3) model_->set_hooks(Zero3GatherHooks(store_.get(), params, units, ml.config.layers));
  transient_gradients_ = transient && store_->UseTransientGradients();
  if (transient_gradients_) {
    model_->set_hooks(PrepareGradientsHooks(store_.get(), params, units));
    if (options_.rank == 0 && options_.print_progress) {
      std::printf("gradients: each block's made when backward reaches it, released after its update "
                  "(LTRAIN_TRANSIENT_GRADIENTS=0 keeps them)\n");
    }
  }
  if (layout_.ep > 1) model_->set_expert_group(groups_->ep);
  if (layout_.cp > 1) model_->set_context_group(groups_->cp);
  // The router's balance and z losses are divided as the LM loss is (a mean over the micro-batches).
  model_->set_aux_scale(1.0 / layout_.accumulation);
  if (options_.tp_split_batch && options_.rank == 0) {
    // After ZeRO-3's hooks are set: they keep blocks whole.
    std::printf("%s\n", model_->SplitsBatch(layout_.micro_batch, /*recording=*/true) ? "tp: each micro-batch goes through the blocks in two halves, one half's all-reduce beside "
                                "the other half's products"
                              : "tp: LTRAIN_TP_SPLIT_BATCH=1 has no effect here: it needs parallel.tp above 1 without "
                                "sequence_parallel, training.micro_batch 2 or more, parallel.zero below 3 and no full "
                                "activation checkpointing");
  }
  if (options_.copy_engine_gathers) store_->UseSymmetricGathers();
  if (store_->sharded_update() || (options_.overlap_update && layout_.pp == 1 && store_->can_defer_update())) {
    UnitHooks hooks = AwaitComputeCopiesHooks(store_.get(), params);
    if (transient_gradients_) hooks = PrepareGradientsHooks(store_.get(), params, units, std::move(hooks));
    model_->set_hooks(std::move(hooks));
    defer_compute_ = true;
  }
  // ZeRO-3: each unit's update is left to its gather in the next forward (the gather hooks above).
  if (layout_.zero == 3 && options_.overlap_update) defer_compute_ = true;
  // A replacement takes every parameter from a peer (SyncState): none from rank 0 now.
  const bool replacement = options_.recovery != nullptr && options_.recovery->replacement();
  if (!replacement) LTRAIN_RETURN_IF_ERROR(store_->BroadcastParameters());

  if (layout_.pp > 1) {
    LTRAIN_ASSIGN_OR_RETURN(plan_, PlanPipeline(layout_.pp_schedule, layout_.pp, layout_.chunks, layout_.accumulation));
  }

  if (!options_.checkpoint_dir.empty()) {
    CheckpointWriterOptions w;
    w.dir = options_.checkpoint_dir;
    w.rank = groups_->rank;
    w.world_size = layout_.world_size;
    w.recipe = recipe_;
    w.print = options_.print_progress;
    w.fault = options_.checkpoint_write_fault;
    // A large save of a slow peer may take longer than a collective; a stuck one is the
    // coordinator's to find (checkpoint.timeout_s).
    w.commit_timeout = std::max(options_.collective_timeout,
                                std::chrono::milliseconds(static_cast<int64_t>(CheckpointTimeout(recipe_).seconds * 2000)));
    w.board = options_.commit_board;
    if (w.board == nullptr && layout_.world_size == 1) {
      local_board_ = std::make_unique<LocalCommitBoard>();
      w.board = local_board_.get();
    }
    w.async = recipe_.checkpoint.async && w.board != nullptr;
    w.on_commit = [report = options_.report_progress](int64_t step, const std::string& path, double save_ms,
                                                      uint64_t bytes) {
      Progress::Global().RecordCommit(step, path);
      Progress::Global().RecordSave(step, save_ms, static_cast<int64_t>(bytes));
      if (report) report();
    };
    writer_ = std::make_unique<CheckpointWriter>(std::move(w));
    if (writer_->async() && device_.is_cuda()) {
      // Pinned host memory for the snapshots, once: pinning gigabytes in the first save would block
      // training for seconds.
      constexpr const char* kPinning = "pinning host memory for checkpoint snapshots";
      Progress::Global().SetWork(kPinning, 0, 0, "bytes");
      const auto pin_start = SteadyClock::now();
      const int64_t pinned = store_->ReserveSnapshot();
      Progress::Global().EndWork(kPinning);
      if (options_.print_progress && groups_->rank == 0) {
        std::printf("checkpoint: %.2f GB of pinned host memory for rank 0's snapshots in %.1f s\n", pinned / 1e9,
                    MillisSince(pin_start) / 1000.0);
        std::fflush(stdout);
      }
    }
  }

  // After the snapshot memory is pinned: a resume reads into it (ReadShards).
  if (replacement) {
    // Its state comes from a peer's memory before the first step: nothing is read from storage.
  } else if (!recipe_.checkpoint.resume_from.empty()) {
    LTRAIN_RETURN_IF_ERROR(Resume(recipe_.checkpoint.resume_from));
  } else if (!recipe_.model.init_from.empty()) {
    // The same directory fails the same way after a restart: the job fails at once.
    if (Status s = LoadInitialParameters(recipe_.model.init_from); !s.ok()) return FailedPrecondition(s.message());
  }
  run_start_step_ = step_;
  run_start_position_ = data_position_;
  return Status::Ok();
}

std::vector<torch::Tensor> Trainer::Parameters() const {
  std::vector<torch::Tensor> out;
  for (const ShardParam& p : model_->params()) out.push_back(p.value);
  return out;
}

StatusOr<torch::Tensor> Trainer::PipelineForward(int micro_step, const torch::Tensor& inputs,
                                                  const torch::Tensor& targets) {
  // The virtual stages one after another: each rank runs its chunks when their turn comes,
  // receiving the activation from the previous stage's rank and sending its own to the next.
  Communicator* pp = groups_->pp;
  const int pp_size = layout_.pp, me = groups_->coords.pp, stages = pp_size * layout_.chunks;
  const std::vector<int64_t> shape = model_->ActivationShape(layout_.micro_batch);
  torch::Tensor loss;
  for (int vs = 0; vs < stages; ++vs) {
    if (vs % pp_size != me) continue;
    const int chunk = vs / pp_size;
    torch::Tensor input = inputs;
    if (vs > 0) {
      input = torch::empty(shape, torch::TensorOptions().dtype(activation_dtype_).device(device_));
      LTRAIN_RETURN_IF_ERROR(pp->Recv(input, (vs - 1) % pp_size, PipeTag(plan_, false, micro_step, vs - 1)));
    }
    torch::Tensor out = model_->Forward(chunk, input, targets);
    if (vs == stages - 1) {
      loss = out;
    } else {
      LTRAIN_RETURN_IF_ERROR(pp->Send(out.contiguous(), (vs + 1) % pp_size, PipeTag(plan_, false, micro_step, vs)));
    }
  }
  LTRAIN_RETURN_IF_ERROR(pp->WaitSends());
  return loss;
}

StatusOr<double> Trainer::Evaluate() {
  torch::NoGradGuard no_grad;
  LTRAIN_RETURN_IF_ERROR(store_->AwaitUpdates());
  Progress::Global().SetPhase(step_, "eval");
  const int batches = recipe_.training.eval_batches, m = layout_.accumulation;
  const bool last_stage = groups_->coords.pp == layout_.pp - 1;
  torch::Tensor sum = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  for (int e = 0; e < batches; ++e) {
    for (int a = 0; a < m; ++a) {
      const BatchSlice slice = SliceOf(0, e, a);
      const int64_t n = static_cast<int64_t>(layout_.micro_batch) * recipe_.model.seq_len;
      std::vector<int64_t> host_inputs(static_cast<size_t>(n)), host_targets(static_cast<size_t>(n));
      val_loader_->Fill(slice, host_inputs.data(), host_targets.data());
      torch::Tensor inputs, targets;
      LTRAIN_RETURN_IF_ERROR(ToDevice(*val_loader_, host_inputs.data(), host_targets.data(), &inputs, &targets));
      torch::Tensor loss;
      if (layout_.pp == 1) {
        loss = model_->Forward(0, inputs, targets);
      } else {
        LTRAIN_ASSIGN_OR_RETURN(loss, PipelineForward(a, inputs, targets));
      }
      if (last_stage) sum += loss.to(torch::kFloat).reshape({1});
    }
  }
  // ZeRO-3 keeps the embedding's and the head's units gathered for a backward that does not come.
  for (int u = 0; u < store_->units(); ++u) store_->Release(u);
  torch::Tensor mean = (sum / (batches * m)).contiguous();
  LTRAIN_RETURN_IF_ERROR(store_->DpAllReduce(mean));
  mean.div_(layout_.dp);
  if (layout_.pp > 1) LTRAIN_RETURN_IF_ERROR(groups_->pp->Broadcast(mean, layout_.pp - 1));
  return mean.item<double>();
}

void Trainer::SampleActivations() {
  activations_peak_ = std::max(activations_peak_, HeapInUse() - heap_base_);
}

Status Trainer::RunPipeline(torch::Tensor& loss_sum) {
  const int pp_rank = groups_->coords.pp;
  const int m = layout_.accumulation;
  Communicator* pp = groups_->pp;
  struct Slot {
    torch::Tensor input, output, grad;
  };
  std::map<std::pair<int, int>, Slot> slots;
  const std::vector<int64_t> shape = model_->ActivationShape(layout_.micro_batch);
  const torch::TensorOptions options = torch::TensorOptions().dtype(activation_dtype_).device(device_);
  for (const PipeOp& op : plan_.ops[pp_rank]) {
    const int vs = VirtualStage(layout_.pp, pp_rank, op.chunk);
    Slot& slot = slots[{op.microbatch, op.chunk}];
    switch (op.kind) {
      case PipeOpKind::kRecvActivation: {
        torch::Tensor buffer = torch::empty(shape, options);
        LTRAIN_RETURN_IF_ERROR(pp->Recv(buffer, op.peer, PipeTag(plan_, false, op.microbatch, vs - 1)));
        slot.input = buffer.requires_grad_(true);
        break;
      }
      case PipeOpKind::kForward: {
        Progress::Global().SetPhase(step_ + 1, "forward");
        torch::Tensor inputs, targets;
        if (model_->FirstStage(op.chunk) || model_->LastStage(op.chunk)) {
          LTRAIN_RETURN_IF_ERROR(FillBatch(op.microbatch, &inputs, &targets));
        }
        if (!model_->FirstStage(op.chunk)) inputs = slot.input;
        torch::Tensor out;
        {
          compat::CudaBf16Autocast autocast(bf16_ && !bf16_params_);
          out = model_->Forward(op.chunk, inputs, targets);
        }
        if (model_->LastStage(op.chunk)) {
          loss_sum += out.detach();
          slot.output = out / m;
        } else {
          slot.output = out;
        }
        SampleActivations();
        break;
      }
      case PipeOpKind::kSendActivation:
        LTRAIN_RETURN_IF_ERROR(pp->Send(slot.output.detach(), op.peer, PipeTag(plan_, false, op.microbatch, vs)));
        break;
      case PipeOpKind::kRecvGrad: {
        slot.grad = torch::empty(shape, options);
        LTRAIN_RETURN_IF_ERROR(pp->Recv(slot.grad, op.peer, PipeTag(plan_, true, op.microbatch, vs + 1)));
        break;
      }
      case PipeOpKind::kBackward:
        Progress::Global().SetPhase(step_ + 1, "backward");
        if (model_->LastStage(op.chunk)) {
          slot.output.backward();
        } else {
          torch::autograd::backward({slot.output}, {slot.grad});
        }
        slot.output = torch::Tensor();
        slot.grad = torch::Tensor();
        break;
      case PipeOpKind::kSendGrad:
        LTRAIN_RETURN_IF_ERROR(pp->Send(slot.input.grad(), op.peer, PipeTag(plan_, true, op.microbatch, vs)));
        slot.input = torch::Tensor();
        break;
    }
  }
  return pp->WaitSends();
}

StatusOr<double> Trainer::Step() {
  LTRAIN_ASSIGN_OR_RETURN(torch::Tensor loss, StepOnDevice(/*check_loss=*/true));
  return loss.item<double>();
}

StatusOr<torch::Tensor> Trainer::StepOnDevice(bool check_loss) {
  try {
    return StepImpl(check_loss);
  } catch (...) {
    return CaughtException("training step");
  }
}

StatusOr<torch::Tensor> Trainer::StepImpl(bool check_loss) {
  const int64_t step = step_;
  Progress::Global().SetPhase(step + 1, "data");
  const double lr = LearningRate(schedule_, step);
  // Before ZeroGrads: ZeRO-3's gather of the first unit, which it starts, is the step's memory.
  heap_base_ = HeapInUse();
  const int m = layout_.accumulation;
  store_->ZeroGrads(/*one_backward=*/layout_.pp == 1 && m == 1);
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat).device(device_));
  double compute_ms = 0;  // forward and backward of this step's micro-batches
  int step_cpu = kNoCore;  // the core they ran on (kSeveralCores: more than one)
  const bool cuda = device_.is_cuda();
  std::vector<compat::DeviceSpan> spans;
  if (layout_.pp == 1) {
    for (int a = 0; a < m; ++a) {
      Progress::Global().SetPhase(step + 1, "data");
      torch::Tensor inputs, targets;
      LTRAIN_RETURN_IF_ERROR(FillBatch(a, &inputs, &targets));
      const auto forward_start = SteadyClock::now();
      const double forward_cpu_ms = cuda ? 0.0 : WorkCpuMs();
      if (!cuda) NoteCore(&step_cpu);
      if (cuda) spans.push_back(compat::DeviceSpan::Start(device_));
      const bool reduce_now = overlap_ && (layout_.zero >= 2 || a == m - 1);
      store_->ArmHooks(reduce_now);
      Progress::Global().SetPhase(step + 1, "forward");
      torch::Tensor loss;
      {
        compat::CudaBf16Autocast autocast(bf16_ && !bf16_params_);
        loss = model_->Forward(0, inputs, targets);
      }
      SampleActivations();
      if (!cuda) NoteCore(&step_cpu);
      Progress::Global().SetPhase(step + 1, "backward");
      backward_start_ = SteadyClock::now();
      // The head's gradients (its backward comes first; store unit 0, StructuralUnits' order).
      if (transient_gradients_) store_->PrepareGradients(0);
      (loss / m).backward();
      backward_end_ = SteadyClock::now();
      if (!cuda) NoteCore(&step_cpu);
      // A CPU rank's work is the CPU time it spent (WorkCpuMs), not the host's clock: ranks that share
      // busy cores with each other and the control plane wait for a core by turns, and the clock would
      // name whichever waited most a straggler.
      double micro_ms = cuda ? std::chrono::duration<double, std::milli>(backward_end_ - forward_start).count()
                             : WorkCpuMs() - forward_cpu_ms;
      if (options_.slow_factor > 1.0) {
        if (cuda) {
          // The drill slows the GPU's work by the factor, sized from this rank's fastest measured step
          // (the slowed ones are longer).
          if (std::isfinite(drill_base_ms_)) {
            compat::DeviceSleep(device_, drill_base_ms_ / m * (options_.slow_factor - 1.0));
          }
        } else {
          std::this_thread::sleep_for(
              std::chrono::duration<double, std::milli>(micro_ms * (options_.slow_factor - 1.0)));
          micro_ms *= options_.slow_factor;
        }
      }
      if (cuda) spans.back().Stop();
      compute_ms += micro_ms;
      loss_sum += loss.detach();
      if (reduce_now) {
        LTRAIN_RETURN_IF_ERROR(store_->FinishBackward());
      }
    }
  } else {
    LTRAIN_RETURN_IF_ERROR(RunPipeline(loss_sum));
  }
  // On the host a CPU rank's forward and backward are its work; on CUDA they are launches, so the
  // device's spans count once the GPU has run them (a step or two later). Under a pipeline they
  // include waits for the other stages: not measured yet.
  // A process's first steps on the host are its start-up (the allocator's first requests, caches
  // still cold), each rank's differently: not in its figure.
  if (layout_.pp == 1 && !cuda && step - run_start_step_ >= kComputeStartupSteps) {
    compute_window_.push_back({compute_ms, step_cpu, step + 1});
    if (compute_window_.size() > kComputeWindow) compute_window_.pop_front();
  }
  if (layout_.pp == 1 && cuda) {
    device_spans_.push_back(std::move(spans));
    while (!device_spans_.empty() &&
           std::all_of(device_spans_.front().begin(), device_spans_.front().end(),
                       [](const compat::DeviceSpan& span) { return span.Ready(); })) {
      double ms = 0;
      for (const compat::DeviceSpan& span : device_spans_.front()) ms += span.Ms();
      device_spans_.pop_front();
      drill_base_ms_ = std::min(drill_base_ms_, ms);
      compute_window_.push_back({ms, -1});
      if (compute_window_.size() > kComputeWindow) compute_window_.pop_front();
    }
  }
  // Gradients left to the products that no product wrote this step (none in a Llama) become zeros.
  ZeroStaleGradients();

  {
    torch::NoGradGuard no_grad;
    std::vector<ShardParam>& params = model_->params();
    // Sequence parallelism leaves partial gradients of the replicated parameters on each tp rank,
    // and so does a Llama with fewer key/value heads than tp of wk and wv.
    if (tp_partial_grads_) {
      for (ShardParam& p : params) {
        if (!p.tp_partial || !p.value.grad().defined()) continue;
        torch::Tensor g = p.value.mutable_grad();
        LTRAIN_RETURN_IF_ERROR(groups_->tp->AllReduceSum(g));
      }
    }
    // The tied embedding's two copies (first and last stage) get the sum of both gradients.
    if (groups_->in_embedding_group) {
      const int tied = model_->TiedEmbeddingParam();
      if (tied >= 0) {
        torch::Tensor g = params[tied].value.mutable_grad();
        LTRAIN_RETURN_IF_ERROR(groups_->embedding->AllReduceSum(g));
      }
    }
  }
  if (!overlap_) {
    LTRAIN_RETURN_IF_ERROR(store_->ReduceAll());
  }

  // Loss: the last stage's micro-batch mean, averaged over dp, then known on every stage.
  torch::Tensor loss = (loss_sum / m).reshape({1}).to(torch::kFloat).contiguous();
  LTRAIN_RETURN_IF_ERROR(store_->DpAllReduce(loss));
  loss.div_(layout_.dp);
  if (layout_.pp > 1) {
    LTRAIN_RETURN_IF_ERROR(groups_->pp->Broadcast(loss, layout_.pp - 1));
  }
  LTRAIN_RETURN_IF_ERROR(SettleRouting());
  // Without the check (Run on CUDA) the loss stays on the device: the host reads it one step later,
  // so that it never waits for the GPU inside a step.
  if (check_loss) {
    LTRAIN_RETURN_IF_ERROR(CheckLoss(loss.item<double>(), step + 1));
  }

  Progress::Global().SetPhase(step + 1, "optimizer");
  double scale = 1.0;
  torch::Tensor divisor;
  const double clip = recipe_.training.grad_clip;
  if (clip > 0) {
    // Global norm over every shard of every group: each element counted once.
    torch::Tensor sq = store_->GradSquareSum();
    if (layout_.zero >= 1 || store_->has_expert_units()) {
      LTRAIN_RETURN_IF_ERROR(store_->DpAllReduce(sq));
    }
    LTRAIN_RETURN_IF_ERROR(groups_->tp->AllReduceSum(sq));
    LTRAIN_RETURN_IF_ERROR(groups_->pp->AllReduceSum(sq));
    if (sq.is_cuda()) {
      // On the device: the gradients are divided by max(1, norm / clip) inside the optimizer.
      divisor = ((sq.sqrt() + 1e-6) / clip).clamp_min(1.0).to(torch::kFloat);
    } else {
      const double coef = clip / (std::sqrt(sq.item<double>()) + 1e-6);
      if (coef < 1) scale = coef;
    }
  }
  if (options_.recovery != nullptr) LTRAIN_RETURN_IF_ERROR(CheckGroupsBeforeUpdate());
  LTRAIN_RETURN_IF_ERROR(store_->OptimizerStep(lr, scale, step + 1, divisor, defer_compute_));
  ++step_;
  data_position_ += layout_.global_batch;
  return loss;
}

int64_t Trainer::PeakDeviceBytes() const {
  // The allocator's peak, and the symmetric memory the data-parallel gathers use, which it does not see.
  return compat::PeakDeviceBytes(device_) + (store_ ? store_->symmetric_bytes() : 0);
}

int64_t Trainer::FullModelParameters() const { return ModelParameterCount(model_->spec().config); }

void Trainer::RetimeCollectives(double step_ms) {
  if (!options_.derive_collective_timeout) return;
  step_ms_window_.push_back(step_ms);
  while (step_ms_window_.size() > kDerivedWindowSteps) step_ms_window_.pop_front();
  ++steps_timed_;
  const double slowest = *std::max_element(step_ms_window_.begin(), step_ms_window_.end());
  const PhaseTimeout limit = CollectiveTimeout(recipe_, steps_timed_, slowest);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(limit.seconds * 1000));
  const auto now = options_.collective_timeout;
  if (timeout * 5 <= now * 6 && timeout * 6 >= now * 5) return;
  options_.collective_timeout = timeout;
  // Every group once (a group of one is its own SelfCommunicator, which has nothing to set).
  for (Communicator* group : {groups_->world, groups_->tp, groups_->dp, groups_->pp, groups_->embedding, groups_->ep,
                               groups_->edp}) {
    if (group != nullptr) group->SetTimeout(timeout);
  }
  if (options_.rank == 0) std::printf("collective timeout: %s\n", limit.how.c_str());
}

Status Trainer::Run() {
  const TrainingSpec& t = recipe_.training;
  if (options_.recovery != nullptr && options_.recovery->replacement()) {
    // A replacement joins its membership with no state: the members' agreement gives it a peer's.
    Status synced = SyncState();
    if (!synced.ok() && Recovery::Recoverable(synced)) synced = Recover(synced);
    LTRAIN_RETURN_IF_ERROR(synced);
    if (Reshaped()) return Status::Ok();
    run_start_step_ = step_;
    run_start_position_ = data_position_;
  }
  if (copies_ && copies_->steps().own[0] < 0 && copies_->steps().own[1] < 0) {
    // The first copies, of the state training starts from: a failure from now on has one to go back to.
    Status copied = TakeCopies();
    if (!copied.ok() && Recovery::Recoverable(copied)) copied = Recover(copied);
    LTRAIN_RETURN_IF_ERROR(copied);
    if (Reshaped()) return Status::Ok();
  }
  const bool printer = groups_->rank == 0 && options_.print_progress;
  if (printer) {
    const int64_t params = FullModelParameters();
    std::printf(
        "model %s params %lld layers %d d_model %d heads %d kv_heads %d ffn %d seq_len %d vocab %d | layout world %d dp %d "
        "tp %d pp %d zero %d sp %d schedule %s chunks %d ac %s micro_batch %d accumulation %d global_batch %d "
        "device %s backend %s threads %d | init %s sampling %s\n",
        NameOf(recipe_.model.arch).c_str(), static_cast<long long>(params), recipe_.model.layers, recipe_.model.d_model,
        recipe_.model.heads, KvHeads(recipe_.model), FfnWidth(recipe_.model), recipe_.model.seq_len, recipe_.model.vocab, layout_.world_size, layout_.dp, layout_.tp, layout_.pp,
        layout_.zero, layout_.sequence_parallel ? 1 : 0,
        layout_.pp > 1 ? NameOf(layout_.pp_schedule).c_str() : "none", layout_.chunks,
        NameOf(layout_.activation_checkpointing).c_str(), layout_.micro_batch, layout_.accumulation,
        layout_.global_batch, NameOf(recipe_.parallel.device).c_str(), groups_->world->backend().c_str(),
        torch::get_num_threads(), model_->spec().per_parameter_init ? "per_parameter" : "pytorch",
        NameOf(recipe_.data.sampling).c_str());
    if (loader_) std::printf("data: %s\n", loader_->Describe().c_str());
  }
  const double tokens_per_step = static_cast<double>(layout_.global_batch) * recipe_.model.seq_len;
  const double flops_per_token = ModelFlopsPerToken(recipe_.model);
  // On CUDA the host reads each step's loss one step later (and at every checkpoint, before the
  // save), so that it never waits for the GPU inside a step; on the CPU there is nothing to overlap.
  const bool lag = device_.is_cuda();
  struct Finished {
    int64_t step = 0;
    double lr = 0, ms = 0;
    torch::Tensor loss;
    compat::StreamMarker ready;  // on CUDA: `loss` (a host copy) is written once the GPU has passed it
    bool last = false;  // the run ends after it (a stop with a final checkpoint): always printed
    torch::Tensor fp8;  // parallel.precision fp8: TakeFp8Figures' (a host copy on CUDA), else undefined
    torch::Tensor moe;  // model.moe: SettleRouting's (a host copy on CUDA), else undefined
  };
  std::optional<Finished> pending;
  auto settle = [&](const Finished& f) -> Status {
    f.ready.Wait();
    const double value = f.loss.item<double>();
    const int64_t s = f.step;
    const std::optional<StepFigures::Fp8> fp8 = Fp8FiguresOf(f.fp8, s);
    LTRAIN_RETURN_IF_ERROR(CheckLoss(value, s, fp8 ? fp8->overflowed : 0));
    StepFigures figures;
    figures.fp8 = fp8;
    // The assignments of every expert in metrics.jsonl at the steps the log prints.
    figures.moe = MoeFiguresOf(f.moe, t.log_every > 0 && s % t.log_every == 0);
    figures.step = s;
    figures.total_steps = t.steps;
    figures.loss = value;
    figures.lr = f.lr;
    figures.tokens_per_s = f.ms > 0 ? tokens_per_step / (f.ms / 1000.0) : 0.0;
    figures.step_ms = f.ms;
    figures.SetCompute(compute_window_, options_.report_cores);
    if (device_.is_cuda()) {
      figures.mfu = figures.tokens_per_s / layout_.world_size * flops_per_token / kGpuPeakFlops;
      figures.memory_bytes = PeakDeviceBytes();
    } else {
      const MemoryBytes mem = store_->Memory();
      figures.memory_bytes = mem.params + mem.grads + mem.optimizer + activations_peak_;
    }
    Progress::Global().RecordStep(figures);
    RetimeCollectives(f.ms);
    if (printer &&
        (s == 1 || s == run_start_step_ + 1 || (t.log_every > 0 && s % t.log_every == 0) || s == t.steps || f.last)) {
      std::printf("step %lld/%lld loss %.6f lr %.3e tok/s %.0f step_ms %.1f", static_cast<long long>(s),
                  static_cast<long long>(t.steps), value, f.lr, tokens_per_step / (f.ms / 1000.0), f.ms);
      if (figures.moe) {
        // The busiest expert's share against an even one, in the worst MoE block.
        std::printf(" moe_load_max %.3f", figures.moe->load_max);
        if (figures.moe->aux_loss >= 0) std::printf(" moe_aux_loss %.4f", figures.moe->aux_loss);
        if (figures.moe->drop_rate >= 0) std::printf(" moe_dropped %.4f", figures.moe->drop_rate);
      }
      std::printf("\n");
    }
    return Status::Ok();
  };
  // Steady-state throughput: the steps after the first few of this process (allocator and
  // autotuning warm-up), timed from a synchronized start to the last step's loss, less the time
  // the training thread spent in checkpoint saves, and less the profiled steps with the writing of
  // their trace (LTRAIN_PROFILE), which the profiler slows.
  const int64_t warmup = std::min<int64_t>(3, (t.steps - run_start_step_) / 2);
  SteadyClock::time_point window_start = SteadyClock::now();
  double window_ms = 0, blocked_at_start = checkpoint_blocked_ms_, eval_at_start = eval_ms_;
  int64_t window_first = run_start_step_ + 1;
  compat::StepProfiler profiler;
  const int64_t profile_last = std::max(options_.profile_step, options_.profile_last);
  // The profiled steps and their time from the profiler's start to its trace written; at the
  // window's start.
  SteadyClock::time_point profile_start;
  double profile_ms = 0, profile_at_start = 0;
  int64_t profiled_steps = 0, profiled_at_start = 0;
  auto stop_profiler = [&](int64_t last) {
    compat::Synchronize(device_);
    profiler.Stop(options_.profile_path);
    const long long first = options_.profile_step;
    if (last == first) {
      std::printf("profile: step %lld written to %s\n", first, options_.profile_path.c_str());
    } else {
      std::printf("profile: steps %lld-%lld written to %s\n", first, static_cast<long long>(last),
                  options_.profile_path.c_str());
    }
  };
  while (step_ < t.steps) {
    const double lr = LearningRate(schedule_, step_);
    if (options_.profile_step == step_ + 1) {
      // From an idle GPU: the time left out of the throughput is the profiled steps' alone.
      compat::Synchronize(device_);
      profile_start = SteadyClock::now();
      if (std::string why = profiler.Start(); !why.empty()) std::printf("profile: not recorded: %s\n", why.c_str());
    }
    const bool profiling = profiler.running();
    // The window's last step (or the run's, where the run ends first) stops the profiler.
    const bool profile_stop = profiling && (step_ + 1 == profile_last || step_ + 1 == t.steps);
    const auto start = SteadyClock::now();
    StatusOr<torch::Tensor> stepped = StepOnDevice(/*check_loss=*/!lag);
    if (!stepped.ok() && options_.recovery != nullptr && Recovery::Recoverable(stepped.status())) {
      // A peer died in the step: this process stays, the step is redone in the next membership.
      LTRAIN_RETURN_IF_ERROR(Recover(stepped.status()));
      if (Reshaped()) return Status::Ok();
      continue;
    }
    LTRAIN_ASSIGN_OR_RETURN(torch::Tensor loss, std::move(stepped));
    torch::Tensor fp8 = TakeFp8Figures();
    torch::Tensor moe = std::move(moe_figures_);
    compat::StreamMarker ready;
    if (lag) {
      // The loss (and the FP8 figures) go to pinned host memory without waiting, and a marker after
      // them: reading them then waits for this step's only. A read of the device tensor would wait for
      // everything the stream holds by then (the next step's forward and backward), and the GPU would
      // run dry at the end of every step while the host queued the first kernels of the next.
      auto to_host = [](const torch::Tensor& t) {
        torch::Tensor host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
        host.copy_(t, /*non_blocking=*/true);
        return host;
      };
      loss = to_host(loss);
      if (fp8.defined()) fp8 = to_host(fp8);
      if (moe.defined()) moe = to_host(moe);
      ready = compat::StreamMarker::Record(device_);
    }
    const int64_t s = step_;
    if (pending) {
      LTRAIN_RETURN_IF_ERROR(settle(*pending));
      pending.reset();
    }
    if (profiling) ++profiled_steps;
    if (profile_stop) {
      stop_profiler(s);
      profile_ms += MillisSince(profile_start);
    }
    // A stop with a final checkpoint (TrainerOptions::stop_after) saves this step and ends the run.
    LTRAIN_ASSIGN_OR_RETURN(bool stop_here, options_.stop_after ? options_.stop_after(s) : StatusOr<bool>(false));
    const bool periodic = recipe_.checkpoint.every > 0 && s % recipe_.checkpoint.every == 0;
    const bool save = periodic || s == t.steps || stop_here;
    Finished finished{s, lr, MillisSince(start), loss, ready, stop_here, fp8, moe};
    const bool eval = t.eval_every > 0 && (s % t.eval_every == 0 || s == t.steps || stop_here);
    if (!lag || save || eval || s == run_start_step_ + warmup) {
      // The loss is read now: a checkpoint never holds the parameters of a non-finite step.
      LTRAIN_RETURN_IF_ERROR(settle(finished));
    } else {
      pending = finished;
    }
    if (eval) {
      const auto eval_start = SteadyClock::now();
      LTRAIN_ASSIGN_OR_RETURN(double val_loss, Evaluate());
      Progress::Global().RecordEval(s, val_loss);
      if (printer) {
        std::printf("eval step %lld/%lld val_loss %.6f eval_ms %.1f\n", static_cast<long long>(s),
                    static_cast<long long>(t.steps), val_loss, MillisSince(eval_start));
        std::fflush(stdout);
      }
      eval_ms_ += MillisSince(eval_start);
    }
    if (s == run_start_step_ + warmup) {
      compat::Synchronize(device_);
      window_start = SteadyClock::now();
      blocked_at_start = checkpoint_blocked_ms_;
      eval_at_start = eval_ms_;
      window_first = s + 1;
      profile_at_start = profile_ms;
      profiled_at_start = profiled_steps;
      // A profile running on into the window counts from here.
      if (profiler.running()) profile_start = window_start;
    }
    if (s == t.steps) {
      compat::Synchronize(device_);  // the window holds the last step's update too
      window_ms = MillisSince(window_start) - (checkpoint_blocked_ms_ - blocked_at_start) - (eval_ms_ - eval_at_start) -
                  (profile_ms - profile_at_start);
    }
    if (!memory_printed_ && options_.print_progress) {
      // Bytes this rank holds for each; activations_peak is the largest growth of the heap over
      // the start of the step, sampled after every forward: what autograd saved for backward
      // (plus, under ZeRO-3, the gathered parameters of the units in use).
      MemoryBytes mem = store_->Memory();
      std::printf("memory rank %d: params %lld bytes, grads %lld bytes, optimizer %lld bytes, activations_peak %lld bytes\n",
                  groups_->rank, static_cast<long long>(mem.params), static_cast<long long>(mem.grads),
                  static_cast<long long>(mem.optimizer), static_cast<long long>(activations_peak_));
      std::fflush(stdout);
      memory_printed_ = true;
    }
    if (save) {
      LTRAIN_RETURN_IF_ERROR(StartSave());
    }
    // A save of this rank that could not tell rank 0 its outcome stops the rank now (no commit could conclude).
    if (writer_) LTRAIN_RETURN_IF_ERROR(writer_->Fatal());
    if (copies_ && !stop_here && s < t.steps) {
      copies_->NoteStep(finished.ms);
      if (copies_->Due(s)) {
        Status copied = TakeCopies();
        if (!copied.ok() && Recovery::Recoverable(copied)) {
          // A peer died in the exchange: back to the newest copies every shard has, in the next membership.
          LTRAIN_RETURN_IF_ERROR(Recover(copied));
          if (Reshaped()) return Status::Ok();
          continue;
        }
        LTRAIN_RETURN_IF_ERROR(copied);
      }
    }
    if (stop_here) break;
  }
  if (profiler.running()) stop_profiler(step_);  // a stop ended the run inside the profiled window
  // The last update's bf16 copies, where their gathers were left to the next forward.
  LTRAIN_RETURN_IF_ERROR(store_->AwaitUpdates());
  const int64_t profiled_in_window = profiled_steps - profiled_at_start;
  if (printer && t.steps - window_first + 1 > profiled_in_window && window_ms > 0) {
    PrintThroughput(window_first, t.steps - window_first + 1, window_ms, profiled_in_window);
  }
  if (printer && copies_ && copies_->noted_steps_ms() > 0) {
    // What the copies cost this rank: their time beside the steps' own (they run between steps).
    std::printf("memory copies: %d taken (%.1f MB each, every %d step(s) at the end), %.0f ms in all: %+.2f%% on the %.1f s "
                "of the steps\n",
                copies_->taken(), static_cast<double>(copies_->bytes()) / 1e6, copies_->every(), copies_->taken_ms(),
                100.0 * copies_->taken_ms() / copies_->noted_steps_ms(), copies_->noted_steps_ms() / 1000.0);
  }
  if (writer_) {
    // The final save must be committed before the job may count as done.
    Progress::Global().SetPhase(step_, "checkpoint");
    // Training is over: this wait for the last save's commit blocks no step, and is told apart.
    const auto start = SteadyClock::now();
    Status last = writer_->async() ? writer_->Wait() : last_save_;
    const double final_wait_ms = MillisSince(start);
    if (!last.ok()) return Internal("the final checkpoint was not saved: " + last.message());
    if (printer && checkpoint_saves_ > 0) {
      std::printf("checkpoint: the training thread was blocked %.1f ms in %d %s save(s) (%.1f ms per save)",
                  checkpoint_blocked_ms_, checkpoint_saves_, writer_->async() ? "async" : "sync",
                  checkpoint_blocked_ms_ / checkpoint_saves_);
      if (writer_->async()) std::printf("; after the last step it waited %.1f ms for the last commit", final_wait_ms);
      std::printf("\n");
    }
  }
  Progress::Global().SetPhase(step_, "done");
  // Keeps the ranks together until rank 0's final checkpoint is committed.
  return groups_->world->Barrier();
}

}  // namespace ltrain::worker

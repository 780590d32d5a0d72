// The trainer's data: the training and validation loaders, the batches made ahead on the prefetch
// thread, their trace (LTRAIN_DATA_TRACE), and each micro-batch's way to the device.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>

#include "common/data/prepare.h"
#include "worker/train/trainer.h"

namespace ltrain::worker {
namespace {

// data.sampling "torch": window starts as a PyTorch loop draws them with torch.randint(0, span, (n,),
// generator=g), g = torch.Generator().manual_seed(seed). The CPU kernel draws element after element
// from one Mersenne Twister, so draws made in chunks of any size continue one stream: sample index i
// gets its i-th value.
class TorchRandintWindows final : public WindowStream {
 public:
  TorchRandintWindows(uint64_t seed, int64_t span) : seed_(seed), span_(span) { Restart(); }

  int64_t Start(int64_t sample_index) override {
    if (sample_index < base_) Restart();
    while (sample_index >= base_ + kChunk) {
      base_ += kChunk;
      Draw();
    }
    return chunk_[static_cast<size_t>(sample_index - base_)];
  }

 private:
  static constexpr int64_t kChunk = 4096;

  void Restart() {
    generator_ = at::make_generator<at::CPUGeneratorImpl>(seed_);
    base_ = 0;
    Draw();
  }

  void Draw() {
    torch::Tensor t = torch::randint(0, span_, {kChunk}, generator_, torch::kLong);
    const int64_t* v = t.data_ptr<int64_t>();
    chunk_.assign(v, v + kChunk);
  }

  uint64_t seed_;
  int64_t span_;
  at::Generator generator_;
  int64_t base_ = 0;
  std::vector<int64_t> chunk_;
};

}  // namespace

std::unique_ptr<WindowStream> MakeWindowStream(const Recipe& recipe, int64_t span) {
  if (recipe.data.sampling != Sampling::kTorch || span < 1) return nullptr;  // DataLoader::Open refuses a short file
  return std::make_unique<TorchRandintWindows>(static_cast<uint64_t>(DataSeed(recipe)), span);
}

StatusOr<std::unique_ptr<DataLoader>> OpenTrainingData(const Recipe& recipe) {
  const std::vector<DataSource> sources = DataSources(recipe);
  for (const DataSource& source : sources) {
    if (source.path.empty()) {
      return InvalidArgument("data.path is empty: point it at a directory written by `ltrain data prepare`");
    }
  }
  // Data another tokenizer made, or a vocabulary larger than the model's embedding: no restart helps.
  if (std::string problem = DataProblem(recipe); !problem.empty()) return FailedPrecondition(problem);
  StatusOr<std::unique_ptr<DataLoader>> opened = DataLoader::Open(
      sources, "train", recipe.model.seq_len, recipe.data.sampling, static_cast<uint64_t>(DataSeed(recipe)));
  if (!opened.ok()) {
    // A restart would find the same files: missing or short data fails the job at once (exit 3),
    // naming the path.
    const StatusCode code = opened.status().code();
    return code == StatusCode::kNotFound || code == StatusCode::kInvalidArgument
               ? FailedPrecondition(opened.status().message())
               : opened.status();
  }
  if (std::unique_ptr<WindowStream> stream = MakeWindowStream(recipe, (*opened)->windows(0))) {
    (*opened)->SetStream(std::move(stream));
  }
  return opened;
}

BatchSlice Trainer::SliceOf(int64_t position0, int64_t step, int micro_step) const {
  BatchSlice slice;
  slice.position0 = position0;
  slice.step = step;
  slice.global_batch = layout_.global_batch;
  // The ranks of a context-parallel group read the same sequences (each takes its chunks of them).
  slice.dp_rank = BatchReplica(layout_, groups_->coords);
  slice.dp = layout_.batch_replicas();
  slice.micro_step = micro_step;
  slice.micro_batch = layout_.micro_batch;
  return slice;
}

void Trainer::MakeBatches(int64_t position, BatchPrefetcher::Batches* out) {
  const int64_t n = static_cast<int64_t>(layout_.micro_batch) * recipe_.model.seq_len;
  out->inputs.resize(static_cast<size_t>(n * layout_.accumulation));
  out->targets.resize(out->inputs.size());
  for (int a = 0; a < layout_.accumulation; ++a) {
    const BatchSlice slice = SliceOf(position, 0, a);
    loader_->Fill(slice, out->inputs.data() + a * n, out->targets.data() + a * n);
    if (!options_.data_trace.empty()) TraceWindows(slice);
  }
  if (data_trace_ != nullptr) std::fflush(data_trace_);
}

void Trainer::TraceWindows(const BatchSlice& slice) {
  if (data_trace_ == nullptr) {
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(options_.data_trace).parent_path(), ec);
    data_trace_ = std::fopen(options_.data_trace.c_str(), "a");
    if (data_trace_ == nullptr) {
      std::fprintf(stderr, "LTRAIN_DATA_TRACE: cannot open %s: %s; no trace is written\n", options_.data_trace.c_str(),
                   std::strerror(errno));
      options_.data_trace.clear();
      return;
    }
  }
  for (int j = 0; j < slice.micro_batch; ++j) {
    const int64_t sample = SampleIndex(slice, j);
    const WindowRef ref = loader_->Locate(sample);
    std::fprintf(data_trace_, "%lld\t%d\t%lld\t%lld\n", static_cast<long long>(sample), ref.source,
                 static_cast<long long>(ref.start), static_cast<long long>(ref.epoch));
  }
}

Status Trainer::FillBatch(int micro_step, torch::Tensor* inputs, torch::Tensor* targets) {
  const BatchPrefetcher::Batches& batches = prefetcher_->Get(data_position_);
  const int64_t n = static_cast<int64_t>(layout_.micro_batch) * recipe_.model.seq_len;
  return ToDevice(*loader_, batches.inputs.data() + micro_step * n, batches.targets.data() + micro_step * n, inputs,
                  targets);
}

Status Trainer::ToDevice(const DataLoader& loader, const int64_t* host_inputs, const int64_t* host_targets,
                         torch::Tensor* inputs, torch::Tensor* targets) {
  // Fresh tensors per micro-batch: autograd keeps the token ids of a forward until its backward.
  // On CUDA from pinned memory, copied without waiting: the GPU keeps working meanwhile.
  const torch::TensorOptions host = torch::TensorOptions().dtype(torch::kLong).pinned_memory(device_.is_cuda());
  torch::Tensor in = torch::empty({layout_.micro_batch, recipe_.model.seq_len}, host);
  torch::Tensor tg = torch::empty({layout_.micro_batch, recipe_.model.seq_len}, host);
  const int64_t n = in.numel();
  std::copy(host_inputs, host_inputs + n, in.data_ptr<int64_t>());
  std::copy(host_targets, host_targets + n, tg.data_ptr<int64_t>());
  // Every token the model sees must be an embedding row: on a GPU an id past the table is a device
  // assert that kills the process without a word. The file's declared vocab is checked when it
  // opens; its tokens are checked here, as they are drawn (a whole-file scan would cost every
  // worker a pass over the data at start-up). A target the loss mask leaves out is kIgnoredTarget.
  const int64_t vocab = recipe_.model.vocab;
  for (const torch::Tensor* t : {&in, &tg}) {
    const int64_t* ids = t->data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      if ((ids[i] < 0 && !(t == &tg && ids[i] == kIgnoredTarget)) || ids[i] >= vocab) {
        std::string files;
        for (int s = 0; s < loader.sources(); ++s) files += (s > 0 ? " or " : "") + loader.data(s).path();
        return FailedPrecondition("token file " + files + " holds token id " + std::to_string(ids[i]) +
                                  ", outside model.vocab=" + std::to_string(vocab) +
                                  ": it is damaged or was not written by `ltrain data prepare`; prepare it again");
      }
    }
  }
  *inputs = in.to(device_, /*non_blocking=*/true);
  *targets = tg.to(device_, /*non_blocking=*/true);
  return Status::Ok();
}

}  // namespace ltrain::worker

#include "worker/control/progress.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/files.h"

namespace ltrain::worker {
namespace {

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

// JSON has no NaN or infinity: null stands for them.
// Finite values as the shortest text that reads back as the same double: the metrics file carries
// the figure the job record holds, not a rounding of it.
std::string JsonNumber(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  const std::to_chars_result written = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, written.ptr);
}

double Median(std::vector<double> values) {
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  if (values.size() % 2 == 1) return values[mid];
  return (*std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid)) + values[mid]) / 2.0;
}

}  // namespace

void StepFigures::SetCompute(const std::deque<Work>& window, bool by_core) {
  if (window.empty()) return;
  std::vector<double> all;
  for (const Work& w : window) all.push_back(w.ms);
  compute_ms = Median(all);
  std::vector<double> deviations;
  for (double ms : all) deviations.push_back(std::abs(ms - compute_ms));
  compute_spread_ms = Median(std::move(deviations));
  compute_steps = static_cast<int>(window.size());
  compute_work.clear();
  if (!by_core) return;
  for (const Work& w : window) {
    if (w.cpu >= 0) compute_work.push_back(w);
  }
}

Progress& Progress::Global() {
  static Progress* progress = new Progress();
  return *progress;
}

void Progress::SetPhase(int64_t step, const std::string& phase) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.step = step;
  state_.phase = phase;
  state_.updated_unix_ms = NowUnixMs();
}

uint64_t Progress::BeginCollective(const std::string& op, const std::string& group, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  CollectiveRecord record;
  record.seq = next_seq_++;
  record.op = op;
  record.group = group;
  record.bytes = bytes;
  record.start_unix_ms = NowUnixMs();
  state_.collectives.push_back(std::move(record));
  if (state_.collectives.size() > kRingSize) state_.collectives.pop_front();
  return next_seq_ - 1;
}

void Progress::EndCollective(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = NowUnixMs();
  for (auto it = state_.collectives.rbegin(); it != state_.collectives.rend(); ++it) {
    if (it->seq == seq) {
      it->end_unix_ms = now;
      break;
    }
  }
  state_.updated_unix_ms = now;
}

void Progress::RecordStep(const StepFigures& figures) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.completed = figures;
  if (metrics_ != nullptr) {
    std::string fields = "\"step\": " + std::to_string(figures.step) +
                         ", \"total_steps\": " + std::to_string(figures.total_steps) +
                         ", \"loss\": " + JsonNumber(figures.loss) + ", \"lr\": " + JsonNumber(figures.lr) +
                         ", \"tokens_per_s\": " + JsonNumber(figures.tokens_per_s) +
                         ", \"step_ms\": " + JsonNumber(figures.step_ms);
    if (figures.compute_steps > 0) fields += ", \"compute_ms\": " + JsonNumber(figures.compute_ms);
    if (figures.mfu > 0) fields += ", \"mfu\": " + JsonNumber(figures.mfu);
    if (figures.memory_bytes > 0) fields += ", \"memory_bytes\": " + std::to_string(figures.memory_bytes);
    if (const auto& f = figures.fp8) {
      fields += ", \"fp8\": {\"activation_amax_max\": " + JsonNumber(f->activation_amax_max) +
                ", \"activation_amax_min\": " + JsonNumber(f->activation_amax_min) +
                ", \"weight_amax_max\": " + JsonNumber(f->weight_amax_max) +
                ", \"weight_amax_min\": " + JsonNumber(f->weight_amax_min) +
                ", \"gradient_amax_max\": " + JsonNumber(f->gradient_amax_max) +
                ", \"gradient_amax_min\": " + JsonNumber(f->gradient_amax_min) +
                ", \"products\": " + std::to_string(f->products) + ", \"overflowed\": " + std::to_string(f->overflowed) +
                ", \"overflow_steps\": " + std::to_string(f->overflow_steps) + "}";
    }
    if (const auto& f = figures.moe) {
      std::string loads, counts;
      for (size_t i = 0; i < f->layers.size(); ++i) {
        loads += std::string(i ? ", " : "") + "\"" + std::to_string(f->layers[i]) + "\": " + JsonNumber(f->layer_load[i]);
      }
      fields += ", \"moe\": {\"load_max\": " + JsonNumber(f->load_max) + ", \"worst_layer\": " +
                std::to_string(f->worst_layer) + ", \"load_mean\": " + JsonNumber(f->load_mean) +
                ", \"layer_load\": {" + loads + "}";
      if (f->aux_loss >= 0) fields += ", \"aux_loss\": " + JsonNumber(f->aux_loss);
      if (f->z_loss >= 0) fields += ", \"z_loss\": " + JsonNumber(f->z_loss);
      if (f->drop_rate >= 0) fields += ", \"drop_rate\": " + JsonNumber(f->drop_rate);
      if (!f->tokens_per_expert.empty()) {
        for (size_t i = 0; i < f->tokens_per_expert.size() && i < f->layers.size(); ++i) {
          std::string row;
          for (size_t e = 0; e < f->tokens_per_expert[i].size(); ++e) {
            row += std::string(e ? ", " : "") + JsonNumber(f->tokens_per_expert[i][e]);
          }
          counts += std::string(i ? ", " : "") + "\"" + std::to_string(f->layers[i]) + "\": [" + row + "]";
        }
        fields += ", \"tokens_per_expert\": {" + counts + "}";
      }
      fields += "}";
    }
    AppendMetricsLocked(fields);
  }
  if (tensorboard_) {
    tensorboard_->AddScalar("train/loss", figures.step, figures.loss);
    if (figures.lr > 0) tensorboard_->AddScalar("train/lr", figures.step, figures.lr);
    if (figures.tokens_per_s > 0) tensorboard_->AddScalar("train/tokens_per_s", figures.step, figures.tokens_per_s);
    if (figures.step_ms > 0) tensorboard_->AddScalar("train/step_ms", figures.step, figures.step_ms);
    if (figures.mfu > 0) tensorboard_->AddScalar("train/mfu", figures.step, 100.0 * figures.mfu);
    if (figures.memory_bytes > 0) {
      tensorboard_->AddScalar("train/memory_gib", figures.step, static_cast<double>(figures.memory_bytes) / (1 << 30));
    }
    if (const auto& f = figures.fp8) {
      tensorboard_->AddScalar("fp8/activation_amax_max", figures.step, f->activation_amax_max);
      tensorboard_->AddScalar("fp8/activation_amax_min", figures.step, f->activation_amax_min);
      tensorboard_->AddScalar("fp8/weight_amax_max", figures.step, f->weight_amax_max);
      tensorboard_->AddScalar("fp8/weight_amax_min", figures.step, f->weight_amax_min);
      tensorboard_->AddScalar("fp8/gradient_amax_max", figures.step, f->gradient_amax_max);
      tensorboard_->AddScalar("fp8/gradient_amax_min", figures.step, f->gradient_amax_min);
      tensorboard_->AddScalar("fp8/overflowed", figures.step, f->overflowed);
    }
    if (const auto& f = figures.moe) {
      tensorboard_->AddScalar("moe/load_max", figures.step, f->load_max);
      tensorboard_->AddScalar("moe/load_mean", figures.step, f->load_mean);
      if (f->aux_loss >= 0) tensorboard_->AddScalar("moe/aux_loss", figures.step, f->aux_loss);
      if (f->z_loss >= 0) tensorboard_->AddScalar("moe/z_loss", figures.step, f->z_loss);
      if (f->drop_rate >= 0) tensorboard_->AddScalar("moe/drop_rate", figures.step, f->drop_rate);
      for (size_t i = 0; i < f->layers.size(); ++i) {
        tensorboard_->AddScalar("moe/layer_" + std::to_string(f->layers[i]) + "/load", figures.step, f->layer_load[i]);
      }
    }
  }
}

void Progress::RecordEval(int64_t step, double val_loss) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.eval_step = step;
  state_.val_loss = val_loss;
  if (metrics_ != nullptr) {
    AppendMetricsLocked("\"step\": " + std::to_string(step) + ", \"val_loss\": " + JsonNumber(val_loss));
  }
  if (tensorboard_) tensorboard_->AddScalar("val/loss", step, val_loss);
}

bool Progress::WriteTensorBoardTo(const std::string& dir, std::string& error) {
  std::unique_ptr<TensorBoardWriter> writer = TensorBoardWriter::Open(dir, error);
  if (!writer) return false;
  std::lock_guard<std::mutex> lock(mu_);
  tensorboard_ = std::move(writer);
  return true;
}

bool Progress::WriteMetricsTo(const std::string& path, int generation, std::string& error) {
  StatusOr<std::FILE*> opened = OpenStreamForWriting(path, /*append=*/true);
  if (!opened.ok()) {
    error = opened.status().message();
    return false;
  }
  std::FILE* file = *opened;
  std::lock_guard<std::mutex> lock(mu_);
  if (metrics_ != nullptr) std::fclose(metrics_);
  metrics_ = file;
  metrics_generation_ = generation;
  return true;
}

void Progress::AppendMetricsLocked(const std::string& fields) {
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  char head[96];
  std::snprintf(head, sizeof(head), "{\"time\": %.3f, \"generation\": %d, ", now, metrics_generation_);
  std::fputs(head, metrics_);
  std::fputs(fields.c_str(), metrics_);
  std::fputs("}\n", metrics_);
  std::fflush(metrics_);
}

void Progress::SetWork(const std::string& what, int64_t done, int64_t total, const std::string& unit,
                       bool waits_for_peers) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.work = WorkProgress{what, done, total, unit, waits_for_peers};
}

void Progress::EndWork(const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_.work.what == what) state_.work = WorkProgress{};
}

void Progress::RecordCommit(int64_t step, const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  if (step <= state_.committed_step) return;
  state_.committed_step = step;
  state_.committed_path = path;
}

void Progress::RecordSave(int64_t step, double ms, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.save_step = step;
  state_.save_ms = ms;
  state_.save_bytes = bytes;
  if (metrics_ != nullptr) {
    AppendMetricsLocked("\"checkpoint_step\": " + std::to_string(step) + ", \"save_ms\": " + JsonNumber(ms) +
                        ", \"bytes\": " + std::to_string(bytes));
  }
  if (tensorboard_) tensorboard_->AddScalar("checkpoint/save_s", step, ms / 1000.0);
}

void Progress::RecordRecovery(int epoch, int64_t step, int source, int64_t bytes, double ms, int64_t lost_steps) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.recovery_epoch = epoch;
  state_.recovery_step = step;
  state_.recovery_source = source;
  state_.recovery_bytes = bytes;
  state_.recovery_ms = ms;
  state_.recovery_lost_steps = lost_steps;
}

void Progress::RecordLoad(int64_t step, double ms, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.load_step = step;
  state_.load_ms = ms;
  state_.load_bytes = bytes;
  if (metrics_ != nullptr) {
    AppendMetricsLocked("\"loaded_step\": " + std::to_string(step) + ", \"load_ms\": " + JsonNumber(ms) +
                        ", \"bytes\": " + std::to_string(bytes));
  }
  if (tensorboard_) tensorboard_->AddScalar("checkpoint/load_s", step, ms / 1000.0);
}

void Progress::RecordStoppedAfterCheckpoint() {
  std::lock_guard<std::mutex> lock(mu_);
  state_.stopped_after_checkpoint = true;
}

ProgressSnapshot Progress::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

}  // namespace ltrain::worker

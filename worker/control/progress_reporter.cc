#include "worker/control/progress_reporter.h"

#include <filesystem>
#include <fstream>

#include <grpcpp/grpcpp.h>

#include "ltrain/v1/ltrain.grpc.pb.h"
#include "worker/control/progress.h"

namespace ltrain::worker {
namespace {

// "step-120" in <dir>/latest gives 120 and <dir>/step-120.
bool ReadLatest(const std::string& dir, int64_t* step, std::string* path) {
  std::ifstream in(std::filesystem::path(dir) / "latest");
  std::string name;
  if (!(in >> name) || name.rfind("step-", 0) != 0) return false;
  try {
    *step = std::stoll(name.substr(5));
  } catch (...) {
    return false;
  }
  *path = (std::filesystem::path(dir) / name).string();
  return true;
}

}  // namespace

ProgressReporter::ProgressReporter(ProgressReporterOptions options) : options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressReporter::~ProgressReporter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ProgressReporter::Loop() {
  auto stub = v1::WorkerService::NewStub(
      grpc::CreateChannel(options_.agent_address, grpc::InsecureChannelCredentials()));
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, options_.interval, [this] { return stop_; })) return;
    }
    ProgressSnapshot snapshot = Progress::Global().Snapshot();
    v1::RankProgress report;
    report.set_job_id(options_.job_id);
    report.set_generation(options_.generation);
    report.set_rank(options_.rank);
    report.set_step(snapshot.step);
    report.set_phase(snapshot.phase);
    report.set_updated_unix_ms(snapshot.updated_unix_ms);
    // The last few are enough to name what a rank waits in.
    size_t first = snapshot.collectives.size() > 8 ? snapshot.collectives.size() - 8 : 0;
    for (size_t i = first; i < snapshot.collectives.size(); ++i) {
      const CollectiveRecord& c = snapshot.collectives[i];
      v1::CollectiveRecord* out = report.add_collectives();
      out->set_seq(c.seq);
      out->set_op(c.op);
      out->set_group(c.group);
      out->set_bytes(c.bytes);
      out->set_start_unix_ms(c.start_unix_ms);
      out->set_end_unix_ms(c.end_unix_ms);
    }
    int64_t committed = 0;
    std::string path;
    if (options_.rank == 0 && !options_.checkpoint_dir.empty() && ReadLatest(options_.checkpoint_dir, &committed, &path)) {
      report.set_committed_step(committed);
      report.set_committed_path(path);
    }
    v1::ProgressAck ack;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    grpc::Status status = stub->ReportProgress(&context, report, &ack);
    if (status.ok() && ack.checkpoint_and_stop() && options_.on_checkpoint_stop) options_.on_checkpoint_stop();
  }
}

}  // namespace ltrain::worker

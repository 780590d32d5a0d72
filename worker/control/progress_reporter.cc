#include "worker/control/progress_reporter.h"

#include <grpcpp/grpcpp.h>

#include "ltrain/v1/ltrain.grpc.pb.h"
#include "worker/control/progress.h"

namespace ltrain::worker {

struct ProgressReporter::Connection {
  std::unique_ptr<v1::WorkerService::Stub> stub;
};

ProgressReporter::ProgressReporter(ProgressReporterOptions options)
    : options_(std::move(options)), connection_(std::make_unique<Connection>()) {
  connection_->stub = v1::WorkerService::NewStub(
      grpc::CreateChannel(options_.agent_address, grpc::InsecureChannelCredentials()));
  thread_ = std::thread([this] { Loop(); });
}

ProgressReporter::~ProgressReporter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  Send();
}

void ProgressReporter::Flush() { Send(); }

void ProgressReporter::Loop() {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, options_.interval, [this] { return stop_; })) return;
    }
    if (Send() && options_.on_checkpoint_stop) options_.on_checkpoint_stop();
  }
}

bool ProgressReporter::Send() {
  std::lock_guard<std::mutex> lock(send_mu_);
  const ProgressSnapshot snapshot = Progress::Global().Snapshot();
  v1::RankProgress report;
  report.set_job_id(options_.job_id);
  report.set_generation(options_.generation);
  report.set_rank(options_.rank);
  report.set_seq(++seq_);
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
  if (snapshot.completed) {
    v1::StepFigures* completed = report.mutable_completed();
    completed->set_step(snapshot.completed->step);
    completed->set_total_steps(snapshot.completed->total_steps);
    completed->set_loss(snapshot.completed->loss);
    completed->set_lr(snapshot.completed->lr);
    completed->set_tokens_per_s(snapshot.completed->tokens_per_s);
    completed->set_step_ms(snapshot.completed->step_ms);
    completed->set_compute_ms(snapshot.completed->compute_ms);
    completed->set_compute_steps(snapshot.completed->compute_steps);
    completed->set_compute_spread_ms(snapshot.completed->compute_spread_ms);
    for (const StepFigures::Work& work : snapshot.completed->compute_work) {
      v1::StepWork* out = completed->add_compute_work();
      out->set_step(work.step);
      out->set_cpu(work.cpu);
      out->set_compute_ms(work.ms);
    }
    completed->set_mfu(snapshot.completed->mfu);
    completed->set_memory_bytes(snapshot.completed->memory_bytes);
    if (const auto& f = snapshot.completed->fp8) {
      v1::Fp8Figures* out = completed->mutable_fp8();
      out->set_activation_amax_max(f->activation_amax_max);
      out->set_activation_amax_min(f->activation_amax_min);
      out->set_weight_amax_max(f->weight_amax_max);
      out->set_weight_amax_min(f->weight_amax_min);
      out->set_gradient_amax_max(f->gradient_amax_max);
      out->set_gradient_amax_min(f->gradient_amax_min);
      out->set_products(f->products);
      out->set_overflowed(f->overflowed);
      out->set_overflow_steps(f->overflow_steps);
      out->set_last_overflow_step(f->last_overflow_step);
    }
    if (const auto& f = snapshot.completed->moe) {
      v1::MoeFigures* out = completed->mutable_moe();
      out->set_load_max(f->load_max);
      out->set_worst_layer(f->worst_layer);
      out->set_load_mean(f->load_mean);
      out->set_aux_loss(f->aux_loss);
      out->set_z_loss(f->z_loss);
      out->set_drop_rate(f->drop_rate);
      for (size_t i = 0; i < f->layers.size(); ++i) {
        out->add_layers(f->layers[i]);
        out->add_layer_load(f->layer_load[i]);
      }
    }
  }
  report.set_save_step(snapshot.save_step);
  report.set_save_ms(snapshot.save_ms);
  report.set_save_bytes(snapshot.save_bytes);
  report.set_load_step(snapshot.load_step);
  report.set_load_ms(snapshot.load_ms);
  report.set_load_bytes(snapshot.load_bytes);
  if (snapshot.recovery_epoch > 0) {
    v1::RecoveryFigures* recovery = report.mutable_recovery();
    recovery->set_epoch(snapshot.recovery_epoch);
    recovery->set_resumed_step(snapshot.recovery_step);
    recovery->set_source_rank(snapshot.recovery_source);
    recovery->set_bytes(snapshot.recovery_bytes);
    recovery->set_ms(snapshot.recovery_ms);
    recovery->set_lost_steps(snapshot.recovery_lost_steps);
  }
  report.set_eval_step(snapshot.eval_step);
  report.set_val_loss(snapshot.val_loss);
  report.set_committed_step(snapshot.committed_step);
  report.set_committed_path(snapshot.committed_path);
  report.set_stopped_after_checkpoint(snapshot.stopped_after_checkpoint);
  if (!snapshot.work.what.empty()) {
    v1::WorkProgress* work = report.mutable_work();
    work->set_what(snapshot.work.what);
    work->set_done(snapshot.work.done);
    work->set_total(snapshot.work.total);
    work->set_unit(snapshot.work.unit);
    work->set_waits_for_peers(snapshot.work.waits_for_peers);
  }
  v1::ProgressAck ack;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (!options_.agent_secret.empty()) context.AddMetadata("authorization", "Bearer " + options_.agent_secret);
  grpc::Status status = connection_->stub->ReportProgress(&context, report, &ack);
  return status.ok() && ack.checkpoint_and_stop();
}

}  // namespace ltrain::worker

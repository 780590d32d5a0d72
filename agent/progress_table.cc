#include "agent/progress_table.h"

namespace ltrain::agent {
namespace {

std::pair<uint64_t, int64_t> NewestCollective(const v1::RankProgress& report) {
  if (report.collectives_size() == 0) return {0, 0};
  const auto& last = *report.collectives().rbegin();
  return {last.seq(), last.end_unix_ms()};
}

}  // namespace

v1::RankProgress ProgressTable::Forwarded(const Entry& entry, int64_t now) {
  v1::RankProgress report = entry.report;
  report.set_idle_ms(now - entry.changed_ms);
  report.set_silent_ms(now - entry.received_ms);
  return report;
}

std::optional<v1::RankProgress> ProgressTable::Record(const v1::RankProgress& report) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_.SteadyMs();
  auto [it, added] = entries_.try_emplace(WorkerKey{report.job_id(), report.generation(), report.rank()});
  Entry& entry = it->second;
  if (!added && report.seq() < entry.report.seq()) return std::nullopt;
  bool changed = added || entry.report.step() != report.step() || entry.report.phase() != report.phase() ||
                 NewestCollective(entry.report) != NewestCollective(report) ||
                 entry.report.work().what() != report.work().what() ||
                 entry.report.work().done() != report.work().done();
  bool news = report.committed_step() > entry.report.committed_step() ||
              (report.stopped_after_checkpoint() && !entry.report.stopped_after_checkpoint());
  entry.report = report;
  entry.received_ms = now;
  if (changed) entry.changed_ms = now;
  if (!news) return std::nullopt;
  return Forwarded(entry, now);
}

std::vector<v1::RankProgress> ProgressTable::Collect(const std::set<WorkerKey>& running) {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t now = clock_.SteadyMs();
  std::vector<v1::RankProgress> out;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (running.count(it->first)) {
      out.push_back(Forwarded(it->second, now));
    } else if (now - it->second.received_ms > kForgetMs) {
      // A report that came in after its worker's exit report took the last one.
      it = entries_.erase(it);
      continue;
    }
    ++it;
  }
  return out;
}

void ProgressTable::CompleteExitReport(v1::WorkerStateReport& report) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = entries_.find(WorkerKey{report.job_id(), report.generation(), report.rank()});
  if (found == entries_.end()) return;
  *report.mutable_progress() = Forwarded(found->second, clock_.SteadyMs());
  entries_.erase(found);
}

}  // namespace ltrain::agent

// A coordinator started on existing state (a restart on the same database, or a standby taking the
// lead on etcd) takes back the unfinished jobs; and the start command of a job's generation, which a
// replacement in place is started from too. Part of Coordinator (coordinator.h).
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "common/logging.h"
#include "launcher/coordinator.h"

namespace ltrain::launcher {

v1::StartJobCommand Coordinator::GenerationCommand(const ActiveJob& job, const Recipe& recipe, int generation) {
  v1::StartJobCommand start;
  start.set_job_id(job.job.id());
  start.set_generation(generation);
  start.set_recipe_yaml(RecipeToYaml(recipe));
  start.set_world_size(recipe.parallel.world_size());
  start.set_local_world_size(recipe.parallel.nproc_per_node);
  start.set_rendezvous_scope(job.job.id() + "/" + std::to_string(generation) + "/");
  start.set_checkpoint_dir(recipe.checkpoint.dir);
  start.set_heartbeat_interval_ms(static_cast<int64_t>(recipe.fault.heartbeat_interval_s * 1000));
  // Every new generation restarts the program: after a failure, a resume or a change of nodes.
  start.set_restart_count(generation);
  start.set_last_committed_step(job.job.last_committed_step());
  return start;
}

Status Coordinator::Recover() {
  LTRAIN_ASSIGN_OR_RETURN(std::vector<v1::Job> listed_jobs, store_->ListJobs(0));
  std::vector<v1::Job> jobs;  // the unfinished ones, with their ranks
  std::map<std::string, std::vector<v1::Event>> histories;  // their events so far
  for (const auto& listed : listed_jobs) {
    if (IsFinal(listed.state())) continue;
    LTRAIN_ASSIGN_OR_RETURN(v1::Job stored, store_->GetJob(listed.id()));
    LTRAIN_ASSIGN_OR_RETURN(histories[listed.id()], store_->EventsAfter(listed.id(), 0));
    jobs.push_back(std::move(stored));
  }
  std::vector<std::pair<std::string, std::string>> announce;  // rendezvous keys, set once the lock is let go
  std::unique_lock<std::mutex> lock(mu_);
  int64_t now = clock_->SteadyMs();
  for (const auto& stored : jobs) {
    const v1::Job& listed = stored;
    RecipeParseResult parsed = ParseRecipe(stored.recipe_yaml(), listed.id());
    ActiveJob& job = jobs_[listed.id()];
    // A follower from the start sees the job's whole history, not only what came after this start.
    job.events = std::move(histories[listed.id()]);
    for (const auto& event : job.events) {
      if (event.seq() > stored_seq_.load()) stored_seq_ = event.seq();
      next_seq_ = std::max(next_seq_, event.seq() + 1);
    }
    job.job = stored;
    for (const auto& rank : stored.ranks()) job.ranks[rank.rank()] = rank;
    job.job.clear_ranks();
    if (!parsed.ok()) {
      FinishLocked(job, v1::JOB_STATE_FAILED, "its stored recipe no longer parses: " + parsed.ErrorText());
      continue;
    }
    job.recipe = parsed.recipe;
    job.next_generation = stored.generation() + 1;
    job.committed_at_start = stored.last_committed_step();
    job.recorded_before = stored.last_committed_step();
    // A running generation's load was the earlier coordinator's to compare with what it announced.
    job.resume_compared = true;
    switch (stored.state()) {
      case v1::JOB_STATE_PENDING:
        pending_.push_back(listed.id());
        break;
      case v1::JOB_STATE_RESTARTING:
        job.restart_at_ms = now;
        break;
      case v1::JOB_STATE_RUNNING: {
        for (const auto& rank : stored.ranks()) {
          if (rank.state() == "left") {
            // It left with a lost node (in place, Job.members): done with the job, its node is not waited for.
            job.ranks_exited_ok.insert(rank.rank());
            continue;
          }
          if (std::find(job.nodes.begin(), job.nodes.end(), rank.node_id()) == job.nodes.end()) {
            job.nodes.push_back(rank.node_id());
          }
          if (rank.state() == "exited" && rank.exit_code() == 0 && rank.signal() == 0) {
            job.ranks_exited_ok.insert(rank.rank());
          }
        }
        job.generation_started_ms = now;
        job.times.Restart();
        // The generation's nodes in rank order, those of ranks that left too: a node's ranks are found by
        // its place there (a lost node's, LoseNodeLocked).
        job.generation_nodes.clear();
        for (const auto& rank : stored.ranks()) {
          if (std::find(job.generation_nodes.begin(), job.generation_nodes.end(), rank.node_id()) ==
              job.generation_nodes.end()) {
            job.generation_nodes.push_back(rank.node_id());
          }
        }
        if (job.recipe.fault.recovery == Recovery::kInPlace) {
          // In place, the next failed rank is started from the generation's command in the membership
          // after the one its ranks run in now.
          job.epoch = stored.membership_epoch();
          job.members.assign(stored.members().begin(), stored.members().end());
          Recipe generation = job.recipe;
          const int count = std::max<int>(1, stored.nodes_now() > 0 ? stored.nodes_now() : static_cast<int>(job.nodes.size()));
          generation.parallel.nodes = generation.parallel.nodes_min = generation.parallel.nodes_max = count;
          job.placed = GenerationCommand(job, generation, stored.generation());
          if (stored.has_replacing_rank()) ResumeReplacementLocked(job, stored.replacing_rank(), &announce);
        }
        for (const auto& node_id : job.nodes) {
          NodeState& node = nodes_[node_id];
          node.recovered = true;
          node.recovery_deadline_ms = now + options_.recovery_grace_ms;
          node.jobs.insert(listed.id());
        }
        break;
      }
      default:
        break;
    }
    AddEventLocked(job, "recovered",
                   "coordinator restarted; job " + listed.id() + " taken back in state " +
                       JobStateName(stored.state()),
                   -1);
  }
  lock.unlock();
  for (const auto& [key, value] : announce) {
    if (Status set = KvSet(key, value); !set.ok()) {
      LTRAIN_LOG(kWarning, "coordinator") << "announcing " << key << " after the takeover: " << set.message();
    }
  }
  return Status::Ok();
}

void Coordinator::ResumeReplacementLocked(ActiveJob& job, int rank, std::vector<std::pair<std::string, std::string>>* announce) {
  // The rendezvous keys of the membership the members were forming went with the earlier
  // coordinator. Its announcement is made again, for members still waiting for it, and the next
  // membership's: connecting to the first gives way to the second (MembershipView), where the
  // survivors and the replacement, started or about to be, all connect afresh.
  const int before = job.epoch;
  const int epoch = ++job.epoch;
  job.job.set_membership_epoch(epoch);
  job.replacing_rank = rank;
  job.replacing_since_ms = clock_->SteadyMs();
  job.replacing_from_step = 0;  // the members count the steps they train again themselves
  PersistJobLocked(job);
  const std::string scope = job.placed.rendezvous_scope();
  announce->emplace_back(scope + "/membership/" + std::to_string(before),
                         "epoch " + std::to_string(before) + ": rank " + std::to_string(rank) + " replaced");
  announce->emplace_back(scope + "/membership/" + std::to_string(epoch),
                         "epoch " + std::to_string(epoch) + ": rank " + std::to_string(rank) +
                             " replaced (announced again after a takeover)");
  AddEventLocked(job, "recovering",
                 "the replacement of rank " + std::to_string(rank) + " (membership epoch " + std::to_string(before) +
                     ") was under way when this coordinator took over: its rendezvous went with the earlier "
                     "one, and the members connect again in membership epoch " + std::to_string(epoch),
                 rank);
}

}  // namespace ltrain::launcher

// The coordinator's view of its jobs and nodes in Prometheus' text exposition format (version
// 0.0.4), for `GET /metrics` (http_server.h). Pure: it formats what GetJob, ListJobs and ListNodes
// return, so tests feed it protos.
//
// Series, all gauges but ltrain_job_restarts_total (a counter); labels job_id (not job: Prometheus
// keeps that for its scrape job and would rename ours exported_job), name, rank,
// node, state, phase:
//   ltrain_job_info{job_id,name,state} 1            one per job the coordinator holds
//   ltrain_job_step, _total_steps, _loss, _tokens_per_second, _mfu (GPU jobs), _eta_seconds,
//   ltrain_job_val_loss, _val_step, _committed_step, _generation, _world_size, _restarts_total,
//   ltrain_job_checkpoint_save_seconds, _checkpoint_load_seconds (once measured)
//   ltrain_job_fp8_amax{job_id,name,operand,stat}, ltrain_job_fp8_overflow_steps_total (parallel.precision fp8)
//   ltrain_jobs{state}                           how many jobs are in each state
//   ltrain_rank_step{job_id,rank,node}, ltrain_rank_progress_age_seconds, ltrain_rank_phase{...,phase} 1,
//   ltrain_rank_compute_seconds (where measured), ltrain_rank_memory_bytes (where known), ltrain_rank_straggler (straggler.h)
//   ltrain_node_up{node}, ltrain_node_heartbeat_age_seconds, ltrain_node_gpus, ltrain_node_cpus
// A loss appears once the job has completed a step; a validation loss once it has measured one;
// tokens/s and the ETA while it has not ended.
#pragma once

#include <string>
#include <vector>

#include "launcher/rpc_figures.h"
#include "ltrain/v1/ltrain.pb.h"

namespace ltrain::launcher {

std::string PrometheusText(const std::vector<v1::Job>& jobs, const std::vector<v1::NodeStatus>& nodes);

// The coordinator's own time (rpc_figures.h), counters all:
//   ltrain_coordinator_rpc_calls_total{rpc}, ltrain_coordinator_rpc_seconds_total{rpc} (the handlers'
//   time; for KvGetAnswered until the answer), ltrain_coordinator_rpc_seconds_max{rpc} (a gauge: the
//   longest call since the start), ltrain_coordinator_state_writes_total,
//   ltrain_coordinator_state_write_batches_total, ltrain_coordinator_state_write_seconds_total, and
//   the gauge ltrain_coordinator_state_writes_queued.
std::string ServerFiguresText(const RpcFigures& rpc, const StateWriterFigures& writer, const HeldFigures& held);

// A label value as the format wants it: backslash, double quote and line feed escaped.
std::string EscapeLabelValue(const std::string& value);

}  // namespace ltrain::launcher

#!/bin/bash
# Runs one ltrain job over the Slurm allocation it is started in (from an sbatch script):
#
#   ltrain-slurm.sh RECIPE [ltrain launch options, e.g. --set training.steps=1000]...
#
# On the first node of the allocation (where the batch script runs) it starts `ltrain coordinator`,
# then one `ltrain agent` per node through srun, then `ltrain launch`, which follows the job; the
# job's exit code (0 SUCCEEDED, 1 FAILED, 4 STOPPED, ...) is this script's. On the way out it stops
# the agents and the coordinator.
#
# State (the coordinator's SQLite, checkpoints, per-node logs) goes to LTRAIN_SLURM_STATE_DIR, by
# default $HOME/.ltrain/slurm/$SLURM_JOB_ID: it must be on a filesystem every node shares. A
# requeued job (scontrol requeue, or a node failure with --requeue) keeps its SLURM_JOB_ID, finds
# the ltrain job recorded there and resumes it from its last committed checkpoint.
#
# A SIGTERM to this script (the warning of --signal=B:TERM@SECONDS before the time limit, or
# `scancel --batch --signal=TERM`) stops the job after a final checkpoint (`ltrain stop --checkpoint`):
# the ranks train on to a step they all reach, commit a checkpoint of it and exit, the job ends
# STOPPED with that commit, and every process ends. A job that cannot take the final checkpoint within
# LTRAIN_SLURM_STOP_TIMEOUT seconds is stopped as is, keeping its last commit. A plain scancel signals
# every process of the job at once: the job ends STOPPED at its last commit (the coordinator ignores
# SIGTERM and outlives the agents, which say goodbye; `ltrain launch` stops the job on its SIGTERM).
#
# The coordinator requires a token made for each allocation ($LTRAIN_SLURM_STATE_DIR/token, 0600)
# and serves TLS with a CA made for the allocation; LTRAIN_SLURM_TLS=0 turns TLS off, and the token
# then travels in clear text on the cluster's network.
#
# Environment: LTRAIN_BIN (default: ltrain on PATH), LTRAIN_SLURM_STATE_DIR, LTRAIN_SLURM_PORT
# (default 0: any free port), LTRAIN_SLURM_STOP_TIMEOUT (default 60: seconds the final checkpoint on
# SIGTERM may take; keep it well below the lead time of --signal), LTRAIN_SLURM_REQUEUE_ON_TERM=1
# (requeue the Slurm job after a stop on SIGTERM, so a job that reaches its time limit continues in a
# new allocation).
set -euo pipefail

ltrain=${LTRAIN_BIN:-ltrain}

# Address of a Slurm node: its NodeAddr (the node name unless slurm.conf says otherwise), as an IP.
node_address() {
  local addr
  addr=$(scontrol show node -o "$1" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
  getent hosts "${addr:-$1}" | awk '{ print $1; exit }'
}

# Internal: the task srun starts on every node.
if [[ ${1:-} == --agent ]]; then
  coordinator=$2 state_dir=$3
  echo "$SLURM_JOB_ID.$SLURM_STEP_ID" >"$state_dir/agents.step"  # for a graceful stop (see cleanup)
  # Warnings and errors only: the job's events already say what the agents do.
  exec "$ltrain" --log-level warning agent --coordinator "$coordinator" --node-id "$SLURMD_NODENAME" \
    --bind-address "$(node_address "$SLURMD_NODENAME")" --work-dir "$state_dir/nodes/$SLURMD_NODENAME"
fi

recipe=${1:?usage: ltrain-slurm.sh RECIPE [ltrain launch options]...}
shift
if [[ -z ${SLURM_JOB_ID:-} || -z ${SLURM_JOB_NODELIST:-} ]]; then
  echo "ltrain-slurm.sh: not inside a Slurm allocation (SLURM_JOB_ID is not set); run it from sbatch or salloc" >&2
  exit 2
fi
state_dir=${LTRAIN_SLURM_STATE_DIR:-$HOME/.ltrain/slurm/$SLURM_JOB_ID}
mkdir -p "$state_dir"
log() { echo "ltrain-slurm: $*"; }
# The coordinator listens on every interface: a token of this run (0600, new each allocation) lets
# only this user's processes drive it. Every ltrain below, the agents srun starts included, reads it
# from LTRAIN_TOKEN_FILE; the workers never see it (their agents leave it out).
(umask 077 && head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$state_dir/token")
export LTRAIN_TOKEN_FILE=$state_dir/token
trap 'log "line $LINENO failed: $BASH_COMMAND"' ERR

coordinator_pid='' agents_pid='' launch_pid='' job=''
await_end() {  # waits up to 10 s for pid to end after `kill -TERM`, then kills it
  for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
}
cleanup() {
  # To the end whatever comes: a plain scancel's SIGTERM reaches this shell and its `sleep` too, and
  # the coordinator, which ignores SIGTERM, would outlive the job if the cleanup stopped half-way.
  set +e
  trap '' TERM INT
  # Agents first: SIGTERM through Slurm reaches every agent, which stops its workers (a SIGTERM to
  # srun itself would make it SIGKILL the step).
  if [[ -n $agents_pid ]]; then
    scancel --signal=TERM "$(cat "$state_dir/agents.step" 2>/dev/null)" 2>/dev/null || kill -TERM "$agents_pid" 2>/dev/null || true
    await_end "$agents_pid"
  fi
  if [[ -n $coordinator_pid ]]; then
    kill -INT "$coordinator_pid" 2>/dev/null || true
    await_end "$coordinator_pid"
  fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
on_term() {  # the batch shell's SIGTERM: a final checkpoint, then the job ends STOPPED (launch reports it)
  if [[ -n $job ]]; then
    log "SIGTERM: stopping job $job after a final checkpoint"
    # Returns once the job has ended; launch (or resume) then ends with it.
    "$ltrain" stop "$job" --checkpoint --checkpoint-timeout "${LTRAIN_SLURM_STOP_TIMEOUT:-60}" \
      --coordinator "$address" || { [[ -n $launch_pid ]] && kill -TERM "$launch_pid" 2>/dev/null; } || true
  else
    log "SIGTERM: stopping job (not submitted yet)"
    [[ -n $launch_pid ]] && kill -TERM "$launch_pid" 2>/dev/null || true
  fi
  if [[ ${LTRAIN_SLURM_REQUEUE_ON_TERM:-0} == 1 ]]; then scontrol requeue "$SLURM_JOB_ID" || true; fi
}
trap on_term TERM INT

# Coordinator on this (the first) node, on a free port unless one is given.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
coordinator_host=$(node_address "$first")
rm -f "$state_dir/coordinator.port" "$state_dir/agents.step"
# The token crosses the cluster's network: in TLS (a CA and a certificate for this node, made for this
# allocation), or with LTRAIN_SLURM_TLS=0 in clear text, which the clients must be told is meant.
tls_args=()
if [[ ${LTRAIN_SLURM_TLS:-1} != 0 ]]; then
  rm -rf "$state_dir/tls"
  "$ltrain" coordinator --init-tls "$state_dir/tls" --tls-hosts "$coordinator_host" "$first" localhost 127.0.0.1 >/dev/null
  tls_args=(--tls-cert "$state_dir/tls/server.pem" --tls-key "$state_dir/tls/server.key")
  export LTRAIN_TLS_CA=$state_dir/tls/ca.pem
else
  export LTRAIN_INSECURE=1
fi
# The coordinator ignores SIGTERM: a plain scancel signals every process at once, and the coordinator
# must outlive the agents, which tell it they are leaving, so that the job ends STOPPED. This script
# stops it with SIGINT at the end.
( trap '' TERM; exec "$ltrain" coordinator --listen "0.0.0.0:${LTRAIN_SLURM_PORT:-0}" --state-dir "$state_dir" \
  --port-file "$state_dir/coordinator.port" "${tls_args[@]}" >>"$state_dir/coordinator.log" 2>&1 ) &
coordinator_pid=$!
for _ in $(seq 300); do [[ -s $state_dir/coordinator.port ]] && break; sleep 0.1; done
[[ -s $state_dir/coordinator.port ]] || { log "the coordinator did not start; see $state_dir/coordinator.log"; exit 3; }
address=$coordinator_host:$(cat "$state_dir/coordinator.port")
log "Slurm job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): coordinator at $address, state in $state_dir"

job_state() {  # the state of job $1 in the coordinator's record
  "$ltrain" status "$1" --coordinator "$address" -o json | sed -n 's/.*"state": *"\([A-Z][A-Z]*\)".*/\1/p' | head -n 1
}

# A job recorded by an earlier run of this Slurm job (requeue): finished, or to be resumed.
if [[ -s $state_dir/job_id ]]; then
  job=$(cat "$state_dir/job_id")
  state=$(job_state "$job")
  log "job $job was $state"
  [[ $state == SUCCEEDED ]] && exit 0
  # Still RUNNING in the record: its workers died with the previous allocation.
  [[ $state != FAILED && $state != STOPPED ]] && "$ltrain" stop "$job" --coordinator "$address" >/dev/null
fi

# One agent per node. --kill-on-bad-exit=0: a node's agent that fails is the coordinator's to handle.
srun --ntasks-per-node=1 --kill-on-bad-exit=0 "${BASH_SOURCE[0]}" --agent "$address" "$state_dir" &
agents_pid=$!
# The job is submitted once every node's agent is there (up to 60 s; after that the coordinator
# waits for the missing ones and says so).
nodes=${SLURM_JOB_NUM_NODES:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | wc -l)}
for _ in $(seq 600); do
  up=$("$ltrain" nodes --coordinator "$address" -o json 2>/dev/null | grep -c '"connected": true') || true
  (( ${up:-0} >= nodes )) && break
  kill -0 "$agents_pid" 2>/dev/null || break
  sleep 0.1
done

if [[ -n $job ]]; then
  "$ltrain" resume "$job" --coordinator "$address" &
  launch_pid=$!
else
  # --slurm takes the nodes (and, for GPU recipes, processes per node) from the allocation.
  # Checkpoints go to the shared state directory unless the recipe names one; a --set of the
  # caller comes later and wins.
  sets=(--slurm)
  [[ -z $("$ltrain" validate "$recipe" | sed -n '/^checkpoint:/,/^[a-z]/s/^  dir: *"\{0,1\}\([^"]*\).*/\1/p') ]] &&
    sets+=(--set "checkpoint.dir=$state_dir/checkpoints")
  "$ltrain" launch --coordinator "$address" "${sets[@]}" "$@" "$recipe" &
  launch_pid=$!
  # The job's id, kept for a requeued run: the only job this coordinator has.
  for _ in $(seq 300); do
    job=$("$ltrain" status --coordinator "$address" -o json 2>/dev/null | sed -n 's/.*"id": *"\([^"]*\)".*/\1/p' | head -n 1) || true
    [[ -n $job ]] && { echo "$job" >"$state_dir/job_id"; break; }
    kill -0 "$launch_pid" 2>/dev/null || break
    sleep 0.1
  done
fi

# A trapped SIGTERM interrupts `wait` (status > 128) while launch goes on to report the stopped job:
# the trap has stopped the job by then, so launch has 5 s to report it and end (sooner if the
# coordinator is gone, when launch would retry it for 30 s); then its second SIGTERM ends it at once.
# Unbounded, a launch slow to end would hold the allocation until Slurm's KillWait.
code=''
while [[ -z $code ]]; do
  status=0; wait "$launch_pid" || status=$?
  if (( status > 128 )) && kill -0 "$launch_pid" 2>/dev/null; then
    for _ in $(seq 25); do
      kill -0 "$launch_pid" 2>/dev/null && kill -0 "$coordinator_pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -TERM "$launch_pid" 2>/dev/null || true
    continue
  fi
  code=$status
done
if (( code > 128 )) && [[ -n $job ]]; then
  # launch ended just as the signal came, and the trap took the `wait` that would have had its exit
  # status. That status follows from the job's record (launch exits 0, 1 or 4 for SUCCEEDED, FAILED,
  # STOPPED). A second `wait` for it could block: bash 5.2 can lose a child reaped while a trap runs
  # and then waits for any other child, here the coordinator, which ends only at Slurm's KillWait.
  case $(job_state "$job" 2>/dev/null) in
    SUCCEEDED) code=0 ;;
    FAILED) code=1 ;;
    STOPPED) code=4 ;;
  esac
fi
log "job ${job:-?} ended with exit code $code"
exit "$code"

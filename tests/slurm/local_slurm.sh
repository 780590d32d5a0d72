#!/bin/bash
# A throw-away Slurm on this machine for tests: munged, slurmctld and two slurmd (fake nodes n1 and
# n2 on 127.0.0.1), everything under DIR. Facts behind each setting: /work/shared/slurm-testing.md.
#   local_slurm.sh start DIR   # prints SLURM_CONF=DIR/slurm.conf once both nodes are idle
#   local_slurm.sh stop DIR    # stops what start started, by the pids in DIR (slurmd, slurmctld, munged)
# Needs root and Debian's packages slurmd slurmctld slurm-client munge; the munge user must be able
# to reach DIR (its parents need o+x).
set -euo pipefail

command=${1:?usage: local_slurm.sh start|stop DIR}
dir=${2:?usage: local_slurm.sh start|stop DIR}

stop_pid_files() {  # SIGTERM to each, then SIGKILL to any still running after 10 s
  local file pids=()
  for file in "$@"; do [[ -s $file ]] && pids+=("$(cat "$file")"); done
  (( ${#pids[@]} )) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 0.1; done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

if [[ $command == stop ]]; then
  stop_pid_files "$dir/slurmd-n1.pid" "$dir/slurmd-n2.pid"
  stop_pid_files "$dir/slurmctld.pid"
  stop_pid_files "$dir/munge/munged.pid"
  exit 0
fi
[[ $command == start ]] || { echo "local_slurm.sh: unknown command $command" >&2; exit 2; }

mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 755 "$dir"                    # munged runs as the munge user and needs to reach its folder
chown munge: "$dir/munge"
[[ -e /etc/munge/munge.key ]] || runuser -u munge -- mungekey --create
runuser -u munge -- munged --socket="$dir/munge/munge.socket.2" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

# Ports of this instance: slurmctld, then one per fake node.
base=$((20000 + $$ % 20000))
host=$(hostname -s)
cat > "$dir/slurm.conf" <<CONF
ClusterName=ltraintest
SlurmctldHost=$host
SlurmctldPort=$base
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
ReturnToService=2
MailProg=/bin/true
GresTypes=gpu
SlurmdParameters=config_overrides
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((base + 1))-$((base + 2))] CPUs=2 Gres=gpu:4 State=UNKNOWN
PartitionName=test Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf
# Four GPUs per node that are only files, so that --gpus-per-node=4 is granted (SLURM_GPUS_ON_NODE=4)
# as on a GPU cluster; a GPU-count gres needs a device file per GPU.
for i in 0 1 2 3; do : >"$dir/gpu$i"; done
echo "NodeName=n[1-2] Name=gpu File=$dir/gpu[0-3]" >"$dir/gres.conf"

for _ in $(seq 50); do munge -n -S "$dir/munge/munge.socket.2" | unmunge -S "$dir/munge/munge.socket.2" >/dev/null 2>&1 && break; sleep 0.1; done
slurmctld -i -f "$SLURM_CONF"
for node in n1 n2; do slurmd -f "$SLURM_CONF" -N "$node"; done
for _ in $(seq 150); do
  [[ $(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) -ge 2 ]] && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "local_slurm.sh: the nodes did not become idle within 30 s" >&2
sinfo -N >&2 || true
exit 1

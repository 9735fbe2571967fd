#!/usr/bin/env bash
# Start a real two-node Slurm cluster on this machine: munged, slurmctld and two slurmd daemons
# (nodes n1 and n2, both 127.0.0.1 on ports 17001/17002), partition "local" over both.
# Idempotent: a second call finds the nodes up and returns. Needs root and Debian's slurm-wlm and
# munge (installed by .ci/run); installs nothing. Fails with the daemons' logs after a timeout.
set -euo pipefail
timeout_s=${SLURM_UP_TIMEOUT:-60}
state=${SLURM_LOCAL_STATE:-/var/lib/slurm-local}
conf=/etc/slurm/slurm.conf
host=$(hostname -s)

for tool in munged slurmctld slurmd sinfo scontrol; do
  command -v "$tool" >/dev/null || { echo "slurm_up: $tool not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
done

nodes_up() {  # how many of n1, n2 the controller reports as usable
  sinfo -h -N -p local -o '%N %t' 2>/dev/null | awk '$1 ~ /^n[12]$/ && $2 ~ /^(idle|mix|alloc|comp)/' | wc -l
}
if [[ $(nodes_up) -eq 2 ]]; then echo "slurm_up: already running"; exit 0; fi

# munge: one key, its runtime directory owned by the munge user, the daemon running as munge.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || mungekey -c -k /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged --force
  munge -n | unmunge >/dev/null || { echo "slurm_up: munged does not answer" >&2; exit 1; }
fi

mkdir -p "$state/ctld" "$state/spool/n1" "$state/spool/n2" /etc/slurm
cat > "$conf" <<CONF
# Written by .ci/slurm_up.sh: two slurmd daemons on this host act as the nodes of a cluster.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
# scancel: SIGTERM, then SIGKILL after KillWait seconds
KillWait=10
MinJobAge=600
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd-%n.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd-%n.log
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
running "$state/slurmctld.pid" || slurmctld
for n in n1 n2; do
  running "$state/slurmd-$n.pid" || slurmd -N "$n"
done

deadline=$(( $(date +%s) + timeout_s ))
until [[ $(nodes_up) -eq 2 ]]; do
  if (( $(date +%s) > deadline )); then
    echo "slurm_up: nodes n1 and n2 not idle after ${timeout_s}s; sinfo says:" >&2
    sinfo -N -p local >&2 || true
    for log in "$state"/slurmctld.log "$state"/slurmd-n1.log "$state"/slurmd-n2.log; do
      echo "--- $log" >&2; tail -n 15 "$log" >&2 || true
    done
    exit 1
  fi
  # a node that registered before the controller knew it may sit in "down"; ask once per second
  scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm_up: partition local with nodes n1 n2 ready (state in $state)"

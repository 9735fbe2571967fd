#!/bin/bash
# megatron-areal on a cluster without Slurm: run this on every rollout node.
#
#   launch/rollout_node.sh CONFIG.yaml [key=value ...]     # relative paths of the config are from the working directory
#
# Its place in the run comes from the environment Kubernetes (or the user) sets (README.md, "Clusters without Slurm"):
#   NNODES (or PET_NNODES, WORLD_SIZE)       rollout nodes          NODE_RANK (or JOB_COMPLETION_INDEX, RANK)  this one's index
#   MEGATRON_AREAL_TRAINER_NODES             trainer nodes (default 1)
#   MEGATRON_AREAL_NODE_ADDR (or POD_IP)     the address the trainer reaches this node's servers at
# Starts the servers the plan puts on this node, registers them in the run directory (a filesystem every
# node sees), restarts one that dies, and runs until stopped: SIGTERM stops its servers.
set -euo pipefail
[[ $# -ge 1 && -f $1 ]] || { echo "usage: $0 CONFIG.yaml [key=value ...] (no config file ${1:-given})" >&2; exit 2; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several torch processes share each node's cores
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$1" --node-role rollout "${@:2}"

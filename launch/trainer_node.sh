#!/bin/bash
# megatron-areal on a cluster without Slurm: run this on every trainer node.
#
#   launch/trainer_node.sh CONFIG.yaml [key=value ...]     # relative paths of the config are from the working directory
#
# Its place in the run comes from the environment torchrun and Kubernetes set (README.md, "Clusters without Slurm"):
#   NNODES (or PET_NNODES, WORLD_SIZE)       trainer nodes          NODE_RANK (or PET_NODE_RANK, RANK)  this one's index
#   MASTER_ADDR, MASTER_PORT                 the first trainer node, the rendezvous of the trainer ranks
#   MEGATRON_AREAL_ROLLOUT_NODES             rollout nodes (default cluster.gen_nodes, at least 1)
#   MEGATRON_AREAL_NODE_ADDR (or POD_IP)     this node's address (the first trainer node: MASTER_ADDR)
# The run directory (train.run_dir) must be on a filesystem every node sees: the rollout nodes' servers
# register there and this node waits for them. Exits with the trainer's code.
set -euo pipefail
[[ $# -ge 1 && -f $1 ]] || { echo "usage: $0 CONFIG.yaml [key=value ...] (no config file ${1:-given})" >&2; exit 2; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several torch processes share each node's cores
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$1" --node-role trainer "${@:2}"

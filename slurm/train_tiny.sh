#!/bin/bash
# megatron-areal on a CPU Slurm cluster: a few RL steps of a tiny random Llama on two nodes.
#
#   sbatch slurm/train_tiny.sh [key=value ...]    # from the repository root; overrides go to configs/train_tiny.yaml
#
# == layout (tests/test_plan.py checks these numbers against the planner) ==
# nodes:    2 x 0 GPUs
# rollout:  1 nodes, 0 GPUs, 2 servers x TP 1
# trainer:  1 nodes, 0 GPUs, TP 1 x PP 1 x DP 1
# eta:      1
# ==
# The first node trains (one gloo rank), the second runs two embedded rollout servers that
# register in RUN_DIR/servers. Logs: RUN_DIR/logs/{rollout,trainer}-<node>.log (node agents),
# torchrun-<node>.log, server-<id>.log.
# CI submits this to its two-node local cluster (.ci/slurm_up.sh) and checks the steps and the
# TensorBoard events; a requeued job resumes from the newest checkpoint in RUN_DIR. USR1 (here 2 min
# before the time limit, as in the GPU scripts) saves a checkpoint at the next step boundary and
# requeues the job.
#SBATCH --job-name=areal-tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=00:15:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=slurm-%x-%j.log
set -euo pipefail
cd "${MEGATRON_AREAL_ROOT:-${SLURM_SUBMIT_DIR:-.}}"
config=configs/train_tiny.yaml
[[ -f $config ]] || { echo "$config not found in $PWD: submit from the repository root or set MEGATRON_AREAL_ROOT" >&2; exit 2; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # several torch processes share each node's cores
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$config" --slurm "$@"

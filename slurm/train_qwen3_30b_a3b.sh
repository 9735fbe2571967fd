#!/bin/bash
# megatron-areal: asynchronous RL of Qwen3-30B-A3B (Mixture-of-Experts, 16 nodes x 8 GPUs = 128 GPUs) on Slurm.
#
#   sbatch slurm/train_qwen3_30b_a3b.sh [key=value ...]   # from the repository root; overrides go to configs/train_qwen3_30b_a3b.yaml
#   sbatch -N 32 slurm/train_qwen3_30b_a3b.sh             # another size: the planner re-splits the nodes
#   megatron-areal train configs/train_qwen3_30b_a3b.yaml --dry-run --nodes 16 --gpus-per-node 8   # the plan, anywhere
#
# == layout (tests/test_plan.py checks these numbers against the planner) ==
# nodes:    16 x 8 GPUs
# rollout:  12 nodes, 96 GPUs, 48 servers x TP 2
# trainer:  4 nodes, 32 GPUs, TP 2 x PP 1 x DP 16
# experts:  EP 8 x ETP 1
# eta:      4
# ==
# Why: 3/4 of the GPUs generate (the reference's 3:1 split). 61 GB of bf16 weights (30.5B
# parameters, all experts) do not leave room for KV cache on one 80 GB GPU: servers use TP 2 (31 GB
# of weights per GPU). A token passes through 3.3B of the parameters (8 of 128 experts per layer),
# so generation and training cost about what a 3B dense model costs in FLOPs, while memory holds
# all 30.5B. The trainer splits the experts over EP 8 (16 experts per rank; EP ranks come from data
# parallel, and 8 divides both the 128 experts and DP 16) and the rest over TP 2 with sequence
# parallelism: about 38 GB of model state per GPU (the planner's estimate, not a measurement).
# Node counts whose trainer share is an odd number of nodes (e.g. 12 nodes: 3 trainer nodes, DP 12)
# fail the plan's check that EP divides DP; the dry run names it.
#
# Roles are given per node by megatron_areal/run/plan.py: the first trainer nodes run torchrun
# (rendezvous on the first of them), the other nodes run SGLang servers that register in
# RUN_DIR/servers. Logs: RUN_DIR/logs/{rollout,trainer}-<node>.log (node agents), torchrun-<node>.log
# and server-<id>.log.
# Requeue (node failure, preemption, or the time limit) reruns this script; the trainer resumes from the
# newest checkpoint in RUN_DIR. Before the time limit USR1 reaches the batch step (--signal, 10 min
# ahead): the trainer saves a checkpoint at its next step boundary (RUN_DIR/control/checkpoint) and
# stops, then the job requeues itself; without an answer within cluster.requeue_grace_s (8 min) it
# requeues anyway. The rollout API key: `export MEGATRON_AREAL_API_KEY=...` before sbatch (the job
# inherits the environment; the key never appears on a command line).
#SBATCH --job-name=areal-qwen3-30b-a3b
#SBATCH --nodes=16
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --output=slurm-%x-%j.log
set -euo pipefail
cd "${MEGATRON_AREAL_ROOT:-${SLURM_SUBMIT_DIR:-.}}"
config=configs/train_qwen3_30b_a3b.yaml
[[ -f $config ]] || { echo "$config not found in $PWD: submit from the repository root or set MEGATRON_AREAL_ROOT" >&2; exit 2; }
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$config" --slurm "$@"

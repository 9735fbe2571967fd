#!/bin/bash
# megatron-areal: asynchronous RL of DeepSeek-R1-Distill-Qwen-7B (24 nodes x 8 GPUs, the paper's 7B scale) on Slurm.
#
#   sbatch slurm/train_7b.sh [key=value ...]      # from the repository root; overrides go to configs/train_7b.yaml
#   sbatch -N 8 slurm/train_7b.sh                 # another size: the planner re-splits the nodes
#   megatron-areal train configs/train_7b.yaml --dry-run --nodes 24 --gpus-per-node 8   # the plan, anywhere
#
# == layout (tests/test_plan.py checks these numbers against the planner) ==
# nodes:    24 x 8 GPUs
# rollout:  18 nodes, 144 GPUs, 144 servers x TP 1
# trainer:  6 nodes, 48 GPUs, TP 2 x PP 1 x DP 24
# eta:      4
# ==
# Why: 3/4 of the GPUs generate, the 3:1 split of the reference's 16-node allocation. 15 GB of
# bf16 weights fit one GPU with about 50 GB left for KV cache, so servers use TP 1 (more
# independent servers, no all-reduce per token). The trainer uses TP 2 with sequence parallelism:
# 25 GB of model state per GPU and half the activations of 28k-token sequences. eta 4 as for 1.5B
# (the paper's staleness ablation).
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
#SBATCH --job-name=areal-7b
#SBATCH --nodes=24
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --output=slurm-%x-%j.log
set -euo pipefail
cd "${MEGATRON_AREAL_ROOT:-${SLURM_SUBMIT_DIR:-.}}"
config=configs/train_7b.yaml
[[ -f $config ]] || { echo "$config not found in $PWD: submit from the repository root or set MEGATRON_AREAL_ROOT" >&2; exit 2; }
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$config" --slurm "$@"

#!/bin/bash
# megatron-areal: asynchronous RL of DeepSeek-R1-Distill-Qwen-1.5B (16 nodes x 8 GPUs, the paper's 1.5B scale) on Slurm.
#
#   sbatch slurm/train_1.5b.sh [key=value ...]      # from the repository root; overrides go to configs/train_1.5b.yaml
#   sbatch -N 8 slurm/train_1.5b.sh                 # another size: the planner re-splits the nodes
#   megatron-areal train configs/train_1.5b.yaml --dry-run --nodes 16 --gpus-per-node 8   # the plan, anywhere
#
# == layout (tests/test_plan.py checks these numbers against the planner) ==
# nodes:    16 x 8 GPUs
# rollout:  12 nodes, 96 GPUs, 96 servers x TP 1
# trainer:  4 nodes, 32 GPUs, TP 1 x PP 1 x DP 32
# eta:      4
# ==
# Why: the reference system's documented 16-node Slurm example allocates exactly this: 12 nodes of
# SGLang (DP 96 x TP 1) and 4 training nodes (DP 32). 3/4 of the GPUs generate because decoding
# traces of up to 27k tokens costs far more than training on them. A 1.5B model needs no model
# parallelism (11 GB of weights, gradients and sharded Adam state per GPU), so every trainer GPU
# is a data-parallel rank and every rollout GPU is its own server. eta 4: the paper's ablation
# shows decoupled PPO at eta <= 4 keeps AIME24 accuracy (42.2 vs 42.0 synchronous).
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
#SBATCH --job-name=areal-1.5b
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
config=configs/train_1.5b.yaml
[[ -f $config ]] || { echo "$config not found in $PWD: submit from the repository root or set MEGATRON_AREAL_ROOT" >&2; exit 2; }
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$config" --slurm "$@"

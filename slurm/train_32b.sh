#!/bin/bash
# megatron-areal: asynchronous RL of DeepSeek-R1-Distill-Qwen-32B (up to 64 nodes x 8 GPUs = 512 GPUs) on Slurm.
#
#   sbatch slurm/train_32b.sh [key=value ...]      # from the repository root; overrides go to configs/train_32b.yaml
#   sbatch -N 8 slurm/train_32b.sh                 # another size: the planner re-splits the nodes
#   megatron-areal train configs/train_32b.yaml --dry-run --nodes 64 --gpus-per-node 8   # the plan, anywhere
#
# == layout (tests/test_plan.py checks these numbers against the planner) ==
# nodes:    64 x 8 GPUs
# rollout:  48 nodes, 384 GPUs, 96 servers x TP 4
# trainer:  16 nodes, 128 GPUs, TP 8 x PP 2 x DP 8
# eta:      4
# ==
# Why: 3/4 of the GPUs generate (the reference's 3:1 split). 66 GB of bf16 weights need model
# parallelism on 80 GB GPUs: servers use TP 4 (16 GB of weights per GPU, room for long KV caches,
# lower per-token latency than TP 2); the trainer uses TP 8 inside a node (NVLink) and PP 2 across
# nodes: 15 GB of model state per GPU and half the activation memory per stage; 64 layers split
# evenly. eta 4 as for 1.5B (the paper's staleness ablation).
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
#SBATCH --job-name=areal-32b
#SBATCH --nodes=64
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@600
#SBATCH --output=slurm-%x-%j.log
set -euo pipefail
cd "${MEGATRON_AREAL_ROOT:-${SLURM_SUBMIT_DIR:-.}}"
config=configs/train_32b.yaml
[[ -f $config ]] || { echo "$config not found in $PWD: submit from the repository root or set MEGATRON_AREAL_ROOT" >&2; exit 2; }
exec "${PYTHON:-python3}" -m megatron_areal.cli train "$config" --slurm "$@"

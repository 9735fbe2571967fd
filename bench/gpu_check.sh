#!/usr/bin/env bash
# The CUDA paths in one run, printing figures: run it once on a GPU machine.
#
#   bash bench/gpu_check.sh
#
# Needs python3 with a CUDA torch and megatron-core 0.16.1, either installed or as a wheel in
# $WHEELS_DIR (default: .whl, then wheels/), installed here with --no-index into a temporary
# folder on PYTHONPATH. Without CUDA every section still runs its CPU counterpart (gloo, fp32,
# tiny sizes) and says which CUDA parts it skipped, so the script itself is tested on CPU.
# Sections are appended below by each part of the system; each prints "== <name>" first.
set -euo pipefail
cd "$(dirname "$0")/.."
failed=()  # a failing section is reported at the end; the sections after it still run
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  wheel=$(ls "${WHEELS_DIR:-.whl}"/megatron_core-*.whl wheels/megatron_core-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "megatron-core is not importable and no megatron_core-*.whl was found in ${WHEELS_DIR:-.whl} or wheels/" >&2
    exit 1
  fi
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
  export PYTHONPATH="$PYTHONPATH:$site"
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
EOF

echo "== actor: packed logprobs and one decoupled-PPO step on NCCL (world size 1), local and TE spec"
MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29561} RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 "$PY" - <<'EOF' || failed+=(actor)
import math
import random
import time

import torch

from megatron_areal.actor.actor import Actor
from megatron_areal.actor.config import ModelConfig, OptimizerConfig, ParallelConfig
from megatron_areal.actor.model import build_model, te_available
from megatron_areal.actor.parallel import init_parallel
from megatron_areal.algorithm.config import PPOConfig
from megatron_areal.model.arch import ModelArch
from megatron_areal.records import Trajectory

cuda = torch.cuda.is_available()
if not cuda:
    print("CUDA not available: skipping NCCL, bf16 and the TE spec; running the same step on CPU/gloo, fp32")
hidden, layers, vocab, n_seq, max_len = (1024, 8, 32000, 64, 1024) if cuda else (64, 2, 512, 8, 64)
arch = ModelArch(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                 num_layers=layers, num_heads=16 if cuda else 4, num_kv_heads=4 if cuda else 2,
                 head_dim=64 if cuda else 16, max_position_embeddings=max_len, rms_norm_eps=1e-6, rope_theta=1e6,
                 rope_scaling=None, qkv_bias=True, qk_norm=False, tie_word_embeddings=False)
groups = init_parallel(1, 1, seed=1, backend="nccl" if cuda else "gloo")
print(f"backend {groups.backend}, device {groups.device}")
rng = random.Random(0)
trajs = []
for i in range(n_seq):
    p, o = rng.randint(8, max_len // 4), min(int(rng.paretovariate(1.2) * max_len // 16) + 1, max_len // 2)
    trajs.append(Trajectory(prompt_ids=[rng.randrange(vocab) for _ in range(p)],
                            output_ids=[rng.randrange(vocab) for _ in range(o)],
                            output_logprobs=[-math.log(vocab) - 0.2 * rng.random() for _ in range(o)], group_id=i // 8,
                            reward=float(rng.random() < 0.4)))
seqs = [t.input_ids for t in trajs]
tokens = sum(map(len, seqs))

def sync():
    if cuda:
        torch.cuda.synchronize()

start = time.perf_counter()
# TE is required on CUDA unless the config opts out: opt out when it is absent, so the step still runs
impl = "auto" if not cuda or te_available() else "local"
actor = Actor(arch, ModelConfig(max_seq_len=max_len, transformer_impl=impl),
              ParallelConfig(max_tokens_per_mb=4 * max_len),
              OptimizerConfig(lr=1e-5), PPOConfig(n_minibatches=2), groups, total_steps=10)
sync()
print(f"build {time.perf_counter() - start:.2f} s, dtype {actor.dtype}, "
      f"{sum(p.numel() for c in actor.model for p in c.parameters()) / 1e6:.1f}M parameters")
for rep in range(2):
    start = time.perf_counter()
    packed = actor.compute_logprobs(seqs, 1.0)
    sync()
    print(f"logprobs, {len(seqs)} sequences / {tokens} tokens packed: {time.perf_counter() - start:.3f} s")
single = [actor.compute_logprobs([s], 1.0)[0] for s in seqs[:4]]
diff = max(float((a - b).abs().max()) for a, b in zip(packed[:4], single))
print(f"packed vs one-at-a-time logprobs, max |diff| {diff:.3g} ({actor.dtype})")
for rep in range(2):
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    stats = actor.ppo_update(trajs, 1.0)
    sync()
    peak = f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else ""
    print(f"ppo_update {time.perf_counter() - start:.3f} s{peak}: "
          + ", ".join(f"{k} {v:.4g}" for k, v in sorted(stats.items())))

if not cuda:
    print("TE spec: skipped (no CUDA)")
elif not te_available():
    print("TE spec: skipped (transformer_engine is not importable)")
else:
    from megatron_areal.actor.engine import run_microbatches
    from megatron_areal.actor.microbatch import pack

    mb = pack(seqs, list(range(8)))

    @torch.no_grad()
    def fresh_logprobs(use_te):  # same seed, same weights: the two specs must agree
        chunks = build_model(arch, groups, seed=1, dtype=actor.dtype, use_te=use_te)
        out = run_microbatches(chunks, [mb], groups, vocab_size=vocab, temperature=1.0, forward_only=True,
                               loss_fn=lambda m, lp, ent: (lp.sum() * 0, {"lp": lp.float()}))
        return mb.split(out[0]["lp"])

    te_lp, local_lp = fresh_logprobs(True), fresh_logprobs(False)
    print("TE spec (THD) vs local spec logprobs, max |diff| "
          f"{max(float((a - b).abs().max()) for a, b in zip(te_lp, local_lp)):.3g}")
EOF

echo "== server: the embedded server on the accelerator, output tokens/s under concurrency"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" bench/gpu_server.py --device cuda || failed+=(server)
else
  echo "CUDA not available: skipping the embedded server on CUDA (bench/serve.py measures it on CPU)"
fi

echo "== realloc: trainer-side gather/convert/bucket stream vs a plain device copy (one GPU: no second rank for NCCL)"
MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT_REALLOC:-29571} RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 "$PY" bench/gpu_realloc.py || failed+=(realloc)

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED sections: ${failed[*]}" >&2
  exit 1
fi

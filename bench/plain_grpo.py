"""The baseline a user would write: a plain synchronous GRPO loop on transformers, about 100 lines.

By default it takes the main job's own settings from its config (``--config``, default
``configs/smollm2_arith.yaml``): learning rate, prompts and samples per step, temperature, response
length, steps, gradient clip, PPO clip, seeds, training prompts in the main job's order
(``data.stream.PromptStream``) and held-out set; ``--lr`` / ``--batch`` / ... override one of them.

Each step takes the next ``batch`` training prompts, generates ``group`` answers per prompt with
``model.generate`` (temperature ``temperature``), scores them with the same verifier as the main
job, normalises rewards within each group (groups whose rewards are all equal carry no signal and
are skipped), and takes one token-level PPO-clip step (one update per batch, so the ratio is 1 and
the clip never binds) with AdamW and gradient clipping. That is the vanilla loop: a step whose groups
were all equal trains nothing and still counts. With ``--dynamic-sampling`` a step is the main job's
(``rollout.filter_equal_rewards``): all-equal groups are dropped and the next prompts generated until
``batch`` informative groups are in hand (at most ``MAX_ROUNDS`` generate calls a step), so every
step is an update. Held-out accuracy is greedy decoding of the
main job's 200 fixed problems with the main job's chat template and answer check. It computes in the
main job's ``model.dtype`` as the main job would on this CPU (``compute_dtype.runnable_dtype``: bf16
only where the CPU multiplies bf16 natively), bf16 as a user writes it: ``torch.autocast`` over fp32
weights and an fp32 AdamW.

Held-out accuracy is measured before the first step and after the last (and every ``--eval-every``
steps); each evaluation point carries the wall-clock time (Unix seconds) its result was known, and
``--evals FILE`` appends each to a JSON-lines file as it is made (``bench/time_to_accuracy.py``
watches it). ``--out FILE`` writes the evaluation points, the settings and the whole command's wall
time as JSON. Used by ``bench/time_to_accuracy.py``; runs alone too:

    python bench/plain_grpo.py [--config configs/smollm2_arith.yaml] [--steps 20] --out plain.json [key=value ...]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MAX_ROUNDS = 64  # generate calls one dynamic-sampling step may make before it trains what it has


def load(model_name: str, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_areal.model.assets import resolve_model

    torch.set_num_threads(threads)
    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, tokenizer


def encode(tokenizer, prompts) -> list[list[int]]:
    from megatron_areal.data.template import encode_prompt

    return [encode_prompt(tokenizer, p, True) for p in prompts]


@torch.no_grad()
def generate(model, tokenizer, ids: list[list[int]], *, n: int, max_new_tokens: int,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts, each repeated ``n`` times -> the full sequences and the prompts' attention
    mask (padding is the eos id, which also occurs inside the chat template)."""
    batch = tokenizer.pad({"input_ids": [x for x in ids for _ in range(n)]}, return_tensors="pt")
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **sampling)
    return out, batch["attention_mask"]


def replies(tokenizer, out: torch.Tensor, width: int) -> list[str]:
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def accuracy(model, tokenizer, prompts, *, max_new_tokens: int) -> float:
    """Greedy held-out accuracy, the whole set in one ``generate`` call: the fastest batching measured on
    2 cores (docs/benchmarks.md, the time-to-accuracy section)."""
    from megatron_areal.reward.arithmetic import verify_number

    model.eval()
    out, prompt_mask = generate(model, tokenizer, encode(tokenizer, prompts), n=1, max_new_tokens=max_new_tokens,
                                temperature=0.0)
    texts = replies(tokenizer, out, prompt_mask.shape[1])
    correct = sum(verify_number(r, p.answer).reward >= 1 for r, p in zip(texts, prompts, strict=True))
    return correct / len(prompts)


def response_mask(out: torch.Tensor, width: int, eos: int) -> torch.Tensor:
    """1 for each generated token up to and including the first eos, 0 for padding after it."""
    gen = out[:, width:]
    ended = torch.cumsum((gen == eos).int(), 1)
    keep = (ended == 0) | ((ended == 1) & (gen == eos))
    mask = torch.zeros_like(out, dtype=torch.float32)
    mask[:, width:] = keep.float()
    return mask


def trained_sequences(out: torch.Tensor, width: int, eos: int) -> list[list[int]]:
    """Each row of ``out`` (prompt of ``width`` tokens, then the reply) cut after the reply tokens ``response_mask``
    trains: up to and including the first eos."""
    kept = response_mask(out, width, eos)[:, width:].sum(1).long().tolist()
    return [row[:width + n] for row, n in zip(out.tolist(), kept, strict=True)]


@torch.no_grad()
def token_logprobs(model, sequences: list[list[int]], temperature: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Each sequence's teacher-forced logprob of its tokens 1..n under ``model`` at ``temperature``, one at a time."""
    model.eval()
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])
        with autocast(dtype):
            logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def autocast(dtype: torch.dtype):
    """Forward passes in ``dtype`` over fp32 weights (mixed precision), or as they are for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def grpo_step(model, optimizer, out: torch.Tensor, prompt_mask: torch.Tensor, rewards: torch.Tensor, group: int,
              eos: int, eps_clip: float = 0.2, clip_grad: float = 1.0, dtype: torch.dtype = torch.float32) -> int:
    """One token-level PPO-clip update on the groups whose rewards differ; returns the trained samples."""
    r = rewards.view(-1, group)
    keep = (r.max(1).values > r.min(1).values).repeat_interleave(group)
    if not keep.any():
        return 0
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)[keep]
    seqs, width = out[keep], prompt_mask.shape[1]
    mask = response_mask(seqs, width, eos)[:, 1:]
    attn = torch.ones_like(seqs)
    attn[:, :width] = prompt_mask[keep]
    model.train()
    with autocast(dtype):
        logits = model(input_ids=seqs, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    a = adv[:, None]
    loss_tok = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip) * a)
    loss = (loss_tok * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return int(keep.sum())


@dataclass(frozen=True)
class Groups:
    """Sampled groups: ``out`` the prompts (left-padded to ``prompt_mask``'s width) and their replies, one row a
    sample, ``group`` rows a prompt; ``rewards`` one a sample."""

    out: torch.Tensor
    prompt_mask: torch.Tensor
    rewards: torch.Tensor

    def informative(self, group: int) -> torch.Tensor:
        """Per group: do its rewards differ (else its advantages are all zero)?"""
        r = self.rewards.view(-1, group)
        return r.max(1).values > r.min(1).values

    def only(self, groups: torch.Tensor, group: int) -> Groups:
        rows = groups.repeat_interleave(group)
        return Groups(self.out[rows], self.prompt_mask[rows], self.rewards[rows])


def concat_groups(parts: list[Groups], pad: int) -> Groups:
    """Groups of several ``generate`` calls as one batch: prompts left-padded to the widest, replies right-padded
    with ``pad`` (the eos id). Padding a reply never adds a trained token: a call whose replies are shorter than
    another's stopped because every reply had ended with eos, and ``response_mask`` stops at the first eos."""
    width = max(p.prompt_mask.shape[1] for p in parts)
    length = max(p.out.shape[1] - p.prompt_mask.shape[1] for p in parts)
    outs, masks = [], []
    for p in parts:
        w = p.prompt_mask.shape[1]
        left, right = width - w, length - (p.out.shape[1] - w)
        outs.append(torch.nn.functional.pad(p.out, (left, right), value=pad))
        masks.append(torch.nn.functional.pad(p.prompt_mask, (left, 0), value=0))
    return Groups(torch.cat(outs), torch.cat(masks), torch.cat([p.rewards for p in parts]))


def informative_batch(sample: Callable[[int], Groups], batch: int, group: int, pad: int) -> tuple[Groups, int]:
    """Dynamic sampling: ``sample(n)`` (the next ``n`` prompts' groups) until ``batch`` groups whose rewards differ
    are in hand, or ``MAX_ROUNDS`` calls -> those groups (possibly fewer) and the groups generated."""
    parts, have, generated = [], 0, 0
    for _ in range(MAX_ROUNDS):
        sampled = sample(batch - have)
        generated += batch - have
        keep = sampled.informative(group)
        if keep.any():
            parts.append(sampled.only(keep, group))
            have += int(keep.sum())
        if have == batch:
            break
    else:
        logger.warning("dynamic sampling: %d of %d informative groups after %d generate calls", have, batch,
                       MAX_ROUNDS)
    if not parts:
        return Groups(sampled.out[:0], sampled.prompt_mask[:0], sampled.rewards[:0]), generated
    return concat_groups(parts, pad), generated


def run(args: argparse.Namespace, log=logger.info) -> list[dict]:
    """``args.steps`` GRPO steps; held-out accuracy at step 0, every ``eval_every`` steps and at the end.
    Returns the evaluation points (``train_s``: seconds of training steps before it, evaluations excluded)."""
    from megatron_areal.data.stream import PromptStream
    from megatron_areal.data.tasks import load_task
    from megatron_areal.reward.arithmetic import verify_number
    from megatron_areal.util.compute_dtype import runnable_dtype

    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model, args.threads)
    dtype = runnable_dtype(getattr(torch, args.dtype), torch.device("cpu"), "--dtype")
    held_out = load_task(args.eval_task, size=args.eval_size or None)
    prompts_in_order = PromptStream(load_task(args.train_task, args.data_seed, args.train_size or None),
                                    seed=args.data_seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    points, trained_s, step = [], 0.0, 0

    def evaluate() -> None:
        t = time.monotonic()
        with autocast(dtype):
            acc = accuracy(model, tokenizer, held_out, max_new_tokens=args.max_new_tokens)
        point = {"step": step, "train_s": trained_s, "accuracy": acc, "n": len(held_out),
                 "eval_s": time.monotonic() - t, "time": time.time()}
        points.append(point)
        if getattr(args, "evals", None):
            with open(args.evals, "a") as f:
                f.write(json.dumps(point) + "\n")
        log(f"plain step {step:3d}  train {trained_s:6.0f} s  held-out {100 * acc:.1f}%")

    def sample(n: int) -> Groups:
        """The next ``n`` training prompts, ``group`` sampled replies each, scored."""
        prompts = [next(prompts_in_order) for _ in range(n)]
        model.eval()
        with autocast(dtype):
            out, prompt_mask = generate(model, tokenizer, encode(tokenizer, prompts), n=args.group,
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        texts = replies(tokenizer, out, prompt_mask.shape[1])
        rewards = torch.tensor([verify_number(x, prompts[i // args.group].answer).reward for i, x in enumerate(texts)])
        return Groups(out, prompt_mask, rewards)

    evaluate()
    while step < args.steps:
        t = time.monotonic()
        if getattr(args, "dynamic_sampling", False):
            groups, generated_groups = informative_batch(sample, args.batch, args.group, tokenizer.pad_token_id)
        else:
            groups, generated_groups = sample(args.batch), args.batch
        generated = time.monotonic()
        kept = 0
        if len(groups.rewards):
            kept = grpo_step(model, optimizer, groups.out, groups.prompt_mask, groups.rewards, args.group,
                             tokenizer.eos_token_id, eps_clip=args.eps_clip, clip_grad=args.clip_grad, dtype=dtype)
        step += 1
        trained_s += time.monotonic() - t
        log(f"plain step {step:3d}  generate {generated - t:5.1f} s ({generated_groups} groups), train "
            f"{time.monotonic() - generated:5.1f} s on {kept} samples, reward {groups.rewards.mean():.3f}")
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            evaluate()
    evaluate()
    return points


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The loop's settings; each defaults to the main job's (``--config``) when not given."""
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arith.yaml"),
                        help="the main job's config: the settings not given below come from it")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: both cores)")
    parser.add_argument("--seed", type=int, default=None, help="torch seed (default: train.seed)")
    parser.add_argument("--data-seed", type=int, default=None, help="training prompts and their order (data.seed)")
    parser.add_argument("--batch", type=int, default=None, help="prompts per step (rollout.batch_size)")
    parser.add_argument("--group", type=int, default=None, help="samples per prompt (rollout.group_size)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (optimizer.lr)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (train.steps)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (rollout.temperature)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="response length (rollout.max_new_tokens)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (model.dtype; bf16 falls back to fp32 where the CPU has no native bf16)")
    parser.add_argument("--eval-every", type=int, default=0, help="steps between held-out evaluations (0: end only)")
    parser.add_argument("--dynamic-sampling", action="store_true",
                        help="regenerate until every step has --batch informative groups (the main job's "
                             "rollout.filter_equal_rewards); default: the vanilla loop, a step of all-equal groups "
                             "trains nothing and counts")
    parser.add_argument("--evals", type=Path, default=None,
                        help="append each evaluation point (with its wall-clock time) to this JSON-lines file")
    parser.add_argument("override", nargs="*", help="key=value overrides of the main job's config, as for train")


def fill_from_config(args: argparse.Namespace) -> argparse.Namespace:
    """Every setting not given on the command line takes the main job's value from ``args.config``."""
    from megatron_areal.config import load_config

    cfg = load_config(str(args.config), args.override)
    main_job = {"seed": cfg.train.seed, "data_seed": cfg.data.seed, "batch": cfg.rollout.batch_size,
                "group": cfg.rollout.group_size, "lr": cfg.optimizer.lr, "steps": cfg.train.steps,
                "temperature": cfg.rollout.temperature, "max_new_tokens": cfg.rollout.max_new_tokens,
                "dtype": "float32" if cfg.model.dtype == "auto" else cfg.model.dtype}
    for key, value in main_job.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model, args.eps_clip, args.clip_grad = cfg.model.path, cfg.ppo.eps_clip, cfg.optimizer.clip_grad
    args.train_task, args.train_size = cfg.data.train, cfg.data.train_size
    args.eval_task, args.eval_size = cfg.data.eval, cfg.data.eval_size
    return args


SETTINGS = ("lr", "batch", "group", "steps", "temperature", "max_new_tokens", "seed", "data_seed", "threads", "dtype",
            "dynamic_sampling")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    t0 = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", type=Path, default=None, help="write points, settings and wall time here (JSON)")
    args = fill_from_config(parser.parse_args())
    logger.info("plain GRPO: %s", ", ".join(f"{k}={getattr(args, k)}" for k in SETTINGS))
    points = run(args)
    wall = time.monotonic() - t0  # the interpreter's start-up and imports before main() are not counted
    if args.out:
        args.out.write_text(json.dumps({"points": points, "wall_s": wall, "steps": args.steps,
                                        "settings": {k: getattr(args, k) for k in SETTINGS}}))
    before, after = points[0]["accuracy"], points[-1]["accuracy"]
    logger.info("plain: held-out %.1f%% -> %.1f%% (%+.1f points) in %.0f s", 100 * before, 100 * after,
                100 * (after - before), wall)


if __name__ == "__main__":
    main()

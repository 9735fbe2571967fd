"""Do the run's prompts fit the servers' sequences with ``rollout.max_new_tokens`` after them?

A server refuses a request whose prompt plus ``max_new_tokens`` exceeds its context (SGLang and the
embedded server alike), and the trainer takes no sequence longer than ``model.max_seq_len``. When
even the shortest prompt does not fit, every request of the run is refused and nothing trains, so
``--dry-run`` fails; when only the longest do not, those groups are skipped, which it warns about.

Prompt lengths come from the model's own tokenizer and chat template when the model is on this
machine already (a dry-run prepares nothing). Only the prompts longest and shortest in characters
are tokenized, since token counts follow character counts closely and a dataset may hold tens of
thousands of prompts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from megatron_areal.config import Config
from megatron_areal.run.plan import Plan

log = logging.getLogger(__name__)

SAMPLE_EACH_END = 32  # prompts tokenized from each end of the character-length order


@dataclass(frozen=True)
class SequenceLimit:
    """The longest sequence a run can generate and train, and which settings make it so."""

    tokens: int
    source: str


def sequence_limit(cfg: Config) -> SequenceLimit:
    """The servers hold ``server.context_length`` tokens (model.max_seq_len when unset: launch/commands.py),
    and the trainer takes at most ``model.max_seq_len``."""
    server = cfg.server.context_length or cfg.model.max_seq_len
    if server < cfg.model.max_seq_len:
        return SequenceLimit(server, f"server.context_length = {server}")
    return SequenceLimit(cfg.model.max_seq_len, f"model.max_seq_len = {cfg.model.max_seq_len}")


def prompt_token_range(cfg: Config, model_dir: Path) -> tuple[int, int, int]:
    """(shortest, longest, prompts) of ``data.train`` in tokens, as the rollout controller encodes them."""
    from transformers import AutoTokenizer

    from megatron_areal.data import encode_prompt, load_task

    prompts = load_task(cfg.data.train, cfg.data.seed, cfg.data.train_size or None)
    by_chars = sorted(prompts, key=lambda p: sum(len(m["content"]) for m in p.as_messages()))
    sample = by_chars[:SAMPLE_EACH_END] + by_chars[-SAMPLE_EACH_END:]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lengths = [len(encode_prompt(tokenizer, p, cfg.data.chat_template)) for p in sample]
    return min(lengths), max(lengths), len(prompts)


def check_context(plan: Plan, cfg: Config) -> None:
    """Append to ``plan.errors`` when no prompt leaves room for ``rollout.max_new_tokens`` (and to
    ``plan.warnings`` when the longest prompts do not)."""
    from megatron_areal.data import DataError
    from megatron_areal.model.assets import prepared_model

    new, limit = cfg.rollout.max_new_tokens, sequence_limit(cfg)
    fix = f"lower rollout.max_new_tokens or raise {limit.source.split(' ')[0]}"
    if new >= limit.tokens:
        plan.errors.append(f"rollout.max_new_tokens ({new}) leaves no room for a prompt in sequences of "
                           f"{limit.tokens} tokens ({limit.source}): every request would be refused; {fix}")
        return
    _check_eval_data(plan, cfg)
    model_dir = prepared_model(cfg.model.path)
    if model_dir is None:
        plan.notes.append(f"prompt lengths not checked against rollout.max_new_tokens: {cfg.model.path} "
                          "is not on this machine yet")
        return
    try:
        shortest, longest, count = prompt_token_range(cfg, model_dir)
    except (DataError, OSError, ValueError) as e:
        plan.errors.append(f"data.train: cannot read the prompts to check their length ({e})")
        return
    plan.notes.append(f"{count} prompts of data.train: {shortest}-{longest} tokens, + rollout.max_new_tokens "
                      f"{new} against {limit.tokens} ({limit.source})")
    if shortest + new > limit.tokens:
        plan.errors.append(f"rollout.max_new_tokens ({new}) + the shortest prompt of data.train ({shortest} "
                           f"tokens) exceeds {limit.tokens} ({limit.source}): every request would be refused "
                           f"and nothing would train; {fix} (at most {limit.tokens - shortest} new tokens fit)")
    elif longest + new > limit.tokens:
        plan.warnings.append(f"the longest prompts of data.train ({longest} tokens) + rollout.max_new_tokens "
                             f"({new}) exceed {limit.tokens} ({limit.source}): the servers refuse them and their "
                             f"groups are skipped ({limit.tokens - longest} new tokens would fit every prompt)")


def _check_eval_data(plan: Plan, cfg: Config) -> None:
    """``data.eval`` names a built-in task or a file here: the run reads it after it has started (the
    starting policy's evaluation), where a missing file ends it."""
    from megatron_areal.data import BUILTIN_TASKS

    name = cfg.data.eval
    if name and name not in BUILTIN_TASKS and not Path(name).is_file():
        plan.errors.append(f"data.eval: '{name}' is neither a built-in task ({', '.join(sorted(BUILTIN_TASKS))}) "
                           "nor a file on this machine")

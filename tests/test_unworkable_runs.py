"""Runs whose every request the servers must refuse are stopped before they start, or within moments.

``configs/train_tiny.yaml rollout.max_new_tokens=250`` leaves no prompt room in the 256-token
sequences its servers hold: ``--dry-run`` must fail naming the key, and a run started anyway (here:
a real embedded server whose context is too short for the real prompts) must stop with the
server's reason instead of skipping groups until ``get_batch`` times out.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_areal.launch.cli import main as train_main
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.controller import RolloutController, RolloutError

ROOT = Path(__file__).resolve().parents[1]


def _dry(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    rc = train_main([str(ROOT / "configs/train_tiny.yaml"), "--dry-run", *overrides])
    return rc, capsys.readouterr().out


def test_dry_run_refuses_max_new_tokens_that_leave_no_room_for_a_prompt(tiny_llama, capsys):
    rc, out = _dry(capsys, "rollout.max_new_tokens=250")
    assert rc == 1, out
    failed = [line for line in out.splitlines() if "FAILED: " in line]
    assert any("rollout.max_new_tokens (250)" in line and "256" in line for line in failed), out


def test_dry_run_passes_the_tiny_config_as_shipped(tiny_llama, capsys):
    rc, out = _dry(capsys)
    assert rc == 0 and "checks: all passed" in out, out
    assert "prompts of data.train" in out, out  # the lengths were measured, not skipped


def test_dry_run_warns_when_only_the_longest_prompts_do_not_fit(tiny_llama, capsys):
    """tiny-llama's character tokenizer makes arithmetic prompts 67-69 tokens long: 188 new tokens fit
    the shortest (67 + 188 = 255 <= 256) but not the longest."""
    rc, out = _dry(capsys, "rollout.max_new_tokens=188")
    assert rc == 0, out
    assert any(line.startswith("warning: ") and "longest prompts of data.train" in line for line in out.splitlines())


@pytest.mark.slow
def test_run_whose_every_request_is_refused_stops_with_the_reason(tiny_llama):
    """A real embedded server with an 80-token context against 67-token prompts and 64 new tokens:
    it refuses every request (400). The controller must give up with that reason, long before
    ``get_batch``'s timeout, rather than skip group after group."""
    from transformers import AutoTokenizer

    from megatron_areal.data import PromptStream, encode_prompt, load_task
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.reward import RewardConfig, RewardService

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    stream = PromptStream(load_task("arithmetic", seed=0, size=2000), seed=0)
    cfg = RolloutConfig(batch_size=2, group_size=2, max_new_tokens=64, max_concurrent=4,
                        filter_equal_rewards=False)
    with start_embedded(tiny_llama, args=["--context-length", "80"]) as server, \
            RewardService(RewardConfig(workers=1), tasks=["arithmetic"]) as rewards:
        ctl = RolloutController(cfg, StalenessConfig(eta=1), [server.url], stream,
                                lambda p: encode_prompt(tokenizer, p, True), tokenizer.decode, rewards)
        with ctl, pytest.raises(RolloutError) as e:
            ctl.get_batch(timeout=180)
    message = str(e.value)
    assert "timed out" not in message, message
    assert "every request" in message and "exceeds the context length 80" in message, message


def test_refusals_of_a_few_prompts_do_not_stop_a_run():
    """Groups that succeed in between, or refusals for reasons that differ beyond their numbers, keep it going;
    the same reason with other numbers (prompt lengths, request ids) counts as one."""
    from megatron_areal.rollout.refusals import RefusalWatch

    watch = RefusalWatch(3)
    too_long = [RuntimeError(f"request r-{i}: prompt of {60 + i} tokens exceeds the context length 80")
                for i in range(3)]
    assert watch.refused(too_long[0]) is None and watch.refused(too_long[1]) is None
    watch.succeeded()
    assert watch.refused(too_long[2]) is None and watch.refused(RuntimeError("top_k unsupported")) is None
    assert [watch.refused(e) for e in too_long] == [None, None, str(too_long[2])]


def test_prepared_model_is_the_folder_resolve_model_prepares():
    from megatron_areal.model.assets import BUILTIN_MODELS, prepared_model, resolve_model

    for name in BUILTIN_MODELS:
        if prepared_model(name) is not None:
            assert prepared_model(name) == resolve_model(name)
    assert prepared_model("/nowhere/model") is None

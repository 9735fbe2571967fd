"""``bench/plain_grpo.py --dynamic-sampling``: the plain loop with the main job's dynamic sampling.

A step draws the next prompts until it holds ``batch`` groups whose rewards differ (hand-counted
example), and groups drawn by several ``generate`` calls (different prompt widths, different reply
lengths) train as one batch with every sample's reply tokens scored exactly as that sample alone
would be: the reference is transformers' forward over the unpadded sequence.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

PLAIN = Path(__file__).resolve().parent.parent / "bench" / "plain_grpo.py"
EOS = 2
GROUP = 4


def _plain_loop():
    spec = importlib.util.spec_from_file_location("plain_grpo", PLAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(plain, seed: int, prompts: int, width: int, reply: int, rewards: list[float], ended: bool):
    """One ``generate`` call's groups: left-padded prompts of ``width`` tokens (the first prompt two shorter),
    replies of up to ``reply`` tokens ending in eos when ``ended`` (padded with eos), else running to the end."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * GROUP
    out = torch.full((rows, width + reply), EOS)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:GROUP, :2] = 0  # the first prompt is shorter: left padding
    out[:, :width] = torch.randint(3, 128, (prompts, width), generator=g).repeat_interleave(GROUP, 0)
    out[:GROUP, :2] = EOS
    for i in range(rows):
        n = reply - (i % 3) if ended else reply
        out[i, width:width + n - ended] = torch.randint(3, 128, (n - ended,), generator=g)
    return plain.Groups(out, mask, torch.tensor(rewards))


def test_a_step_draws_until_it_holds_batch_informative_groups() -> None:
    plain = _plain_loop()
    calls = iter([
        (2, [0, 0, 0, 0, 1, 0, 1, 0]),  # asked for 2: one all-equal, one informative
        (1, [1, 1, 1, 1]),              # asked for the 1 missing: all equal
        (1, [0, 1, 1, 1]),              # asked again: informative, the batch is full
    ])
    asked = []

    def sample(n: int):
        want, rewards = next(calls)
        asked.append(n)
        assert n == want
        return _call(plain, len(asked), n, 5, 4, rewards, ended=True)

    groups, generated = plain.informative_batch(sample, batch=2, group=GROUP, pad=EOS)
    assert asked == [2, 1, 1] and generated == 4
    assert groups.rewards.tolist() == [1, 0, 1, 0, 0, 1, 1, 1]
    assert bool(groups.informative(GROUP).all())


def test_groups_of_two_calls_train_each_reply_as_it_stands_alone(tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    plain = _plain_loop()
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    first = _call(plain, 1, 1, 6, 9, [1, 0, 0, 1], ended=False)  # a reply ran to max_new_tokens
    second = _call(plain, 2, 2, 9, 5, [0, 1, 0, 0, 1, 1, 0, 1], ended=True)  # shorter: every reply ended
    merged = plain.concat_groups([first, second], pad=EOS)
    width = merged.prompt_mask.shape[1]
    assert merged.out.shape == (3 * GROUP, 9 + 9) and merged.rewards.tolist() == first.rewards.tolist() + \
        second.rewards.tolist()

    # as grpo_step scores the merged batch: the prompts' mask, then every position attended
    attn = torch.ones_like(merged.out)
    attn[:, :width] = merged.prompt_mask
    with torch.no_grad():
        logits = model(input_ids=merged.out, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, merged.out[:, 1:, None]).squeeze(-1)
    trained = plain.response_mask(merged.out, width, EOS)[:, 1:].bool()

    for row, (part, i) in enumerate([(first, i) for i in range(GROUP)] + [(second, i) for i in range(2 * GROUP)]):
        w, pads = part.prompt_mask.shape[1], int((part.prompt_mask[i] == 0).sum())
        alone = plain.trained_sequences(part.out[i:i + 1], w, EOS)[0][pads:]  # no padding at all
        reference = plain.token_logprobs(model, [alone])[0][w - pads - 1:]  # its reply tokens' logprobs
        ours = logp[row][trained[row]]
        assert ours.shape == reference.shape, (row, ours.shape, reference.shape)
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)

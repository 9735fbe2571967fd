"""``VLLMClient``'s translation, without a server: hand-written vLLM answers and SGLang-style parameters.

The live behaviour against a real vLLM server is in ``tests/test_vllm.py``; these pin the parts a
server cannot show on demand: malformed or partial answers are refused with the field named, and the
sampling keys the controller sends are mapped (or refused) by name.
"""
from __future__ import annotations

import pytest

from megatron_areal.fleet.vllm_client import results_from_reply, versions_per_token, vllm_sampling_params


def choice(ids: list[int], spans: list[dict] | None, reason: str = "length") -> dict:
    return {"index": 0, "token_ids": ids, "finish_reason": reason, "weight_versions": spans,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(ids)]}}


def test_spans_become_one_version_per_token() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    [r] = results_from_reply({"choices": [choice([7, 8, 9, 10, 11], spans)], "usage": {"prompt_tokens": 4}})
    assert r.output_versions == ["3", "3", "4", "4", "4"] and r.weight_version == "4"
    assert r.output_logprobs == [-0.5, -1.0, -1.5, -2.0, -2.5] and r.prompt_tokens == 4


@pytest.mark.parametrize("spans", [None, [{"version": "1", "start": 0, "end": 2}],
                                   [{"version": "1", "start": 1, "end": 3}],
                                   [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 1, "end": 3}]])
def test_spans_that_do_not_cover_the_tokens_are_refused(spans) -> None:
    with pytest.raises(ValueError, match="weight_versions"):
        versions_per_token(spans, 3)


def test_an_answer_missing_logprobs_is_refused() -> None:
    bad = choice([1, 2], [{"version": "1", "start": 0, "end": 2}])
    bad["logprobs"]["content"].pop()
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        results_from_reply({"choices": [bad]})


def test_aborted_answer_without_tokens_needs_no_spans() -> None:
    [r] = results_from_reply({"choices": [choice([], None, reason="abort")]})
    assert r.finish_reason == "abort" and r.output_ids == [] and r.output_versions == []


def test_sampling_keys_are_mapped_and_unknown_ones_named() -> None:
    out = vllm_sampling_params({"max_new_tokens": 5, "temperature": 0.7, "top_k": -1, "stop_token_ids": [2]})
    assert out == {"max_tokens": 5, "temperature": 0.7, "top_k": 0, "stop_token_ids": [2], "logprobs": 0,
                   "detokenize": False}
    assert vllm_sampling_params({"stop": ["\n"]})["detokenize"] is True
    with pytest.raises(ValueError, match="sampling_params.json_schema"):
        vllm_sampling_params({"json_schema": "{}"})

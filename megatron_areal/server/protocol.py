"""The /generate request and response of SGLang's native API: validation and formatting.

Bad input raises ``BadRequest`` with a message naming the field; the HTTP layer answers 400.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from megatron_areal.server.sampler import SamplingParams
from megatron_areal.server.scheduler import Request


class BadRequest(ValueError):
    pass


TOP_LEVEL_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}
# Accepted only at their neutral value: the embedded server does not implement them.
NEUTRAL_PARAMS: dict[str, Any] = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                  "repetition_penalty": 1.0, "logit_bias": None, "json_schema": None,
                                  "regex": None, "ebnf": None}
IGNORED_PARAMS = {"stop", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"}


@dataclass
class Parsed:
    prompts: list[tuple[str, list[int], SamplingParams]]
    single: bool  # one prompt with n == 1: the reply is an object, else an array
    return_logprob: bool


def _number(sp: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = sp.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"sampling_params.{key}: expected a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def _int(sp: dict[str, Any], key: str, default: int, lo: int) -> int:
    v = sp.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"sampling_params.{key}: expected an integer >= {lo}, got {v!r}")
    return v


def parse_sampling(sp: Any, prompt_len: int, max_len: int, vocab: int, has_tokenizer: bool) -> SamplingParams:
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params: expected an object, got {type(sp).__name__}")
    for key, value in sp.items():
        if key in NEUTRAL_PARAMS:
            if value not in (NEUTRAL_PARAMS[key], [], ""):
                raise BadRequest(f"sampling_params.{key} is not supported by this server")
        elif key not in IGNORED_PARAMS and key not in SamplingParams.__dataclass_fields__ \
                and key not in ("sampling_seed",):
            raise BadRequest(f"sampling_params: unknown field {key!r}")
    max_new = sp.get("max_new_tokens", 128)
    if max_new is None:
        max_new = max_len - prompt_len
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
        raise BadRequest(f"sampling_params.max_new_tokens: expected an integer >= 0, got {max_new!r}")
    if prompt_len + max_new > max_len:
        raise BadRequest(f"prompt of {prompt_len} tokens + max_new_tokens {max_new} exceeds the context "
                         f"length {max_len}")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in stop_ids):
        raise BadRequest("sampling_params.stop_token_ids: expected a list of token ids")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 32 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("sampling_params.stop: expected a string or a list of at most 32 non-empty strings")
    if stop and not has_tokenizer:
        raise BadRequest("sampling_params.stop: stop strings need a tokenizer; this server has none "
                         "(use stop_token_ids)")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"sampling_params.ignore_eos: expected true/false, got {ignore_eos!r}")
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.sampling_seed: expected an integer, got {seed!r}")
    top_k = _int(sp, "top_k", -1, -1)
    return SamplingParams(
        max_new_tokens=max_new, temperature=_number(sp, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(sp, "top_p", 1.0, 1e-9, 1.0), top_k=-1 if top_k == 0 else top_k,
        min_new_tokens=_int(sp, "min_new_tokens", 0, 0), stop_token_ids=tuple(stop_ids), stop=tuple(stop),
        ignore_eos=ignore_eos, n=_int(sp, "n", 1, 1), seed=seed)


def _prompts(body: dict[str, Any], tokenizer: Any, vocab: int) -> tuple[list[list[int]], bool]:
    if ("text" in body) == ("input_ids" in body):
        raise BadRequest("send exactly one of 'text' and 'input_ids'")
    if "text" in body:
        text = body["text"]
        if tokenizer is None:
            raise BadRequest("'text' needs a tokenizer; this server has none: send 'input_ids'")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text: expected a string or a non-empty list of strings")
        return [list(tokenizer.encode(t)) for t in texts], isinstance(text, str)
    ids = body["input_ids"]
    single = isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)
    batch = [ids] if single else ids
    if not isinstance(batch, list) or not batch:
        raise BadRequest("input_ids: expected a non-empty list of token ids or a list of such lists")
    for i, row in enumerate(batch):
        if not isinstance(row, list) or not row or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row):
            raise BadRequest(f"input_ids[{i}]: expected a non-empty list of token ids in [0, {vocab})")
    return batch, single


def parse_generate(body: Any, *, tokenizer: Any, vocab: int, max_len: int) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = set(body) - TOP_LEVEL_KEYS
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    if body.get("stream"):
        raise BadRequest("stream: streaming is not supported by this server")
    if body.get("top_logprobs_num", 0) not in (0, None):
        raise BadRequest("top_logprobs_num: only 0 is supported")
    if body.get("logprob_start_len", -1) not in (-1, None):
        raise BadRequest("logprob_start_len: only -1 (output logprobs) is supported")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest(f"return_logprob: expected true/false, got {return_logprob!r}")
    batch, single = _prompts(body, tokenizer, vocab)
    sps = body.get("sampling_params") or {}
    sps = sps if isinstance(sps, list) else [sps] * len(batch)
    if len(sps) != len(batch):
        raise BadRequest(f"sampling_params: {len(sps)} given for {len(batch)} prompts")
    rids = body.get("rid")
    if rids is None or isinstance(rids, str):
        base = rids or uuid.uuid4().hex
        rids = [base] if single else [f"{base}_{i}" for i in range(len(batch))]
    if not isinstance(rids, list) or len(rids) != len(batch) or not all(isinstance(r, str) for r in rids):
        raise BadRequest("rid: expected a string or one string per prompt")
    prompts = []
    for ids, sp, rid in zip(batch, sps, rids, strict=True):
        params = parse_sampling(sp, len(ids), max_len, vocab, tokenizer is not None)
        for j in range(params.n):
            child = rid if params.n == 1 else f"{rid}_{j}"
            prompts.append((child, ids, params))
    return Parsed(prompts=prompts, single=single and len(prompts) == 1, return_logprob=return_logprob)


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def response(req: Request, *, return_logprob: bool, weight_version: str, tokenizer: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids), "cached_tokens": 0, "weight_version": weight_version,
        "weight_versions": version_spans(req.output_versions),
        "e2e_latency": round(req.finished_at - req.created, 6)}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids,
                                                                        strict=True)]
    out: dict[str, Any] = {"output_ids": req.output_ids, "meta_info": meta}
    if tokenizer is not None:
        ids = req.output_ids
        reason = req.finish_reason or {}
        matched = reason.get("matched") if reason.get("type") == "stop" else None
        if isinstance(matched, int) and ids:
            ids = ids[:-1]  # SGLang leaves the matched stop token out of the text
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(matched, str) and matched in text:
            text = text[:text.rindex(matched)]  # ... and the stop string
        out["text"] = text
    return out

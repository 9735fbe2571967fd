"""The /generate request and response of SGLang's native API: validation and formatting.

Bad input raises ``BadRequest`` with a message naming the field; the HTTP layer answers 400.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from megatron_areal.server.routes import encode_routes
from megatron_areal.server.sampler import SamplingParams
from megatron_areal.server.scheduler import Request


class BadRequest(ValueError):
    pass


TOP_LEVEL_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                  "return_routed_experts", "routed_experts_start_len"}
# Accepted only at their neutral value: the embedded server does not implement them.
NEUTRAL_PARAMS: dict[str, Any] = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                  "repetition_penalty": 1.0, "logit_bias": None, "json_schema": None,
                                  "regex": None, "ebnf": None}
IGNORED_PARAMS = {"stop", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"}


# sampling_seed goes to torch.Generator.manual_seed, which takes exactly this range.
SEED_RANGE = (-(2**63), 2**64 - 1)
# A rid is copied into every child of n > 1 and into each reply; SGLang's own are 32 hex digits.
MAX_RID_CHARS = 256
# The last longest-stop-string tokens are decoded at every step of a request that has stop strings.
MAX_STOP_CHARS = 256
# Output tokens one /generate may ask for (prompts x n x max_new_tokens): about 40 bytes each in the
# reply (id, logprob entry, text), so a reply stays near 10 MB whatever the request.
DEFAULT_MAX_REQUEST_TOKENS = 2**18


@dataclass(frozen=True)
class Limits:
    """What one /generate may cost: prompts x n (the queue), context tokens per sequence, output tokens
    in all, and characters of ``text`` per prompt (checked before tokenising)."""

    max_len: int
    max_requests: int = 2**31
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    max_text_chars: int | None = None  # None: no bound (no tokenizer)


@dataclass
class Parsed:
    """A valid /generate body: one (rid, prompt ids, params) group per prompt, before ``n`` fans out.

    ``count`` is known before any child exists, so the caller can check capacity first and only
    then ``expand()``.
    """
    groups: list[tuple[str, list[int], SamplingParams]]
    single: bool  # one prompt with n == 1: the reply is an object, else an array
    return_logprob: bool
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0  # routes cover positions [start, prompt + output - 1)

    @property
    def count(self) -> int:
        return sum(params.n for _, _, params in self.groups)

    def expand(self) -> list[tuple[str, list[int], SamplingParams]]:
        """One entry per sequence to generate: n > 1 children are ``{rid}_{j}``."""
        return [(rid if params.n == 1 else f"{rid}_{j}", ids, params)
                for rid, ids, params in self.groups for j in range(params.n)]


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


def parse_sampling(sp: Any, prompt_len: int, max_len: int, vocab: int, has_tokenizer: bool,
                   max_n: int = 2**31) -> SamplingParams:
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
    stop = [_check_str(x, "sampling_params.stop") for x in stop]
    if any(len(x) > MAX_STOP_CHARS for x in stop):
        raise BadRequest(f"sampling_params.stop: each stop string may have at most {MAX_STOP_CHARS} characters")
    if stop and not has_tokenizer:
        raise BadRequest("sampling_params.stop: stop strings need a tokenizer; this server has none "
                         "(use stop_token_ids)")
    ignore_eos = sp.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"sampling_params.ignore_eos: expected true/false, got {ignore_eos!r}")
    n = _int(sp, "n", 1, 1)
    if n > max_n:
        raise BadRequest(f"sampling_params.n: at most {max_n} (this server's queue), got {n}")
    return SamplingParams(
        max_new_tokens=max_new, temperature=_number(sp, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(sp, "top_p", 1.0, 1e-9, 1.0), top_k=_top_k(sp, vocab),
        min_new_tokens=_int(sp, "min_new_tokens", 0, 0), stop_token_ids=tuple(stop_ids), stop=tuple(stop),
        ignore_eos=ignore_eos, n=n, seed=_seed(sp))


def _top_k(sp: dict[str, Any], vocab: int) -> int:
    """-1 (or 0) and anything from the vocabulary size up mean the whole vocabulary.

    SGLang's own default is 2^30, so large values must be accepted; they are clamped here so that
    the sampler never sees a number that overflows a tensor.
    """
    top_k = _int(sp, "top_k", -1, -1)
    return -1 if top_k == 0 or top_k >= vocab else top_k


def _seed(sp: dict[str, Any]) -> int | None:
    seed = sp.get("sampling_seed", sp.get("seed"))
    lo, hi = SEED_RANGE
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not lo <= seed <= hi):
        raise BadRequest(f"sampling_params.sampling_seed: expected an integer in [-2^63, 2^64), got {seed!r}")
    return seed


def _check_str(value: str, field: str) -> str:
    """Reject strings that are not valid Unicode (JSON allows lone surrogates such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{field}: not valid Unicode ({e.reason} at position {e.start})") from None
    return value


def _prompts(body: dict[str, Any], tokenizer: Any, vocab: int, limits: Limits) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether a single prompt (not a batch) was sent.

    The number of prompts is checked before any is tokenized or scanned.
    """
    max_requests = limits.max_requests
    if ("text" in body) == ("input_ids" in body):
        raise BadRequest("send exactly one of 'text' and 'input_ids'")
    if "text" in body:
        return _text_prompts(body["text"], tokenizer, limits)
    ids = body["input_ids"]
    single = isinstance(ids, list) and bool(ids) and all(isinstance(t, int) for t in ids)
    batch = [ids] if single else ids
    if not isinstance(batch, list) or not batch:
        raise BadRequest("input_ids: expected a non-empty list of token ids or a list of such lists")
    _check_batch_size(len(batch), "input_ids", max_requests)
    for i, row in enumerate(batch):
        if isinstance(row, list) and len(row) > limits.max_len:  # refused before its ids are scanned
            raise BadRequest(f"input_ids[{i}]: {len(row)} tokens cannot fit the context length {limits.max_len}")
        if not isinstance(row, list) or not row or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row):
            raise BadRequest(f"input_ids[{i}]: expected a non-empty list of token ids in [0, {vocab})")
    return batch, single


def _text_prompts(text: Any, tokenizer: Any, limits: Limits) -> tuple[list[list[int]], bool]:
    """Tokenize ``text``; a prompt that is empty (or tokenizes to nothing) has nothing to continue.

    Every prompt is checked (its length in characters among it) before any is tokenized: a text
    longer than ``max_text_chars`` cannot fit the context, however it tokenizes.
    """
    if tokenizer is None:
        raise BadRequest("'text' needs a tokenizer; this server has none: send 'input_ids'")
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("text: expected a string or a non-empty list of strings")
    _check_batch_size(len(texts), "text", limits.max_requests)
    fields = ["text"] if isinstance(text, str) else [f"text[{i}]" for i in range(len(texts))]
    for field, t in zip(fields, texts, strict=True):
        if limits.max_text_chars is not None and len(t) > limits.max_text_chars:
            raise BadRequest(f"{field}: {len(t)} characters cannot fit the context of {limits.max_len} tokens "
                             f"(this tokenizer's longest token has {limits.max_text_chars // limits.max_len} "
                             f"characters, so at most {limits.max_text_chars} characters fit)")
        _check_str(t, field)
    batch = [list(ids) for ids in tokenizer.encode_many(texts)]
    for field, ids in zip(fields, batch, strict=True):
        if not ids:
            raise BadRequest(f"{field}: the prompt is empty (it has no tokens)")
    return batch, isinstance(text, str)


def _check_batch_size(size: int, field: str, max_requests: int) -> None:
    if size > max_requests:
        raise BadRequest(f"{field}: {size} prompts; this server queues at most {max_requests}")


def _rids(body: dict[str, Any], size: int, single: bool) -> list[str]:
    """One id per prompt: a string rid becomes ``{rid}_{i}`` for a batch, as in SGLang."""
    rids = body.get("rid")
    if rids is None or isinstance(rids, str):
        base = _check_rid(rids) if rids else uuid.uuid4().hex
        return [base] if single else [f"{base}_{i}" for i in range(size)]
    if not isinstance(rids, list) or len(rids) != size or not all(isinstance(r, str) for r in rids):
        raise BadRequest("rid: expected a string or one string per prompt")
    return [_check_rid(r) for r in rids]


def _check_rid(rid: str) -> str:
    if len(rid) > MAX_RID_CHARS:
        raise BadRequest(f"rid: {len(rid)} characters; at most {MAX_RID_CHARS}")
    return _check_str(rid, "rid")


def parse_generate(body: Any, *, tokenizer: Any, vocab: int, limits: Limits) -> Parsed:
    """Validate a /generate body within ``limits`` (prompts x n, context, output tokens, text length)."""
    max_len, max_requests = limits.max_len, limits.max_requests
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
    batch, single = _prompts(body, tokenizer, vocab, limits)
    return_routes, routes_start = _routes_fields(body, min(len(ids) for ids in batch))
    sps = body.get("sampling_params") or {}
    sps = sps if isinstance(sps, list) else [sps] * len(batch)
    if len(sps) != len(batch):
        raise BadRequest(f"sampling_params: {len(sps)} given for {len(batch)} prompts")
    rids = _rids(body, len(batch), single)
    groups = []
    for ids, sp, rid in zip(batch, sps, rids, strict=True):
        groups.append((rid, ids, parse_sampling(sp, len(ids), max_len, vocab, tokenizer is not None,
                                                max_n=max_requests)))
    parsed = Parsed(groups=groups, single=False, return_logprob=return_logprob,
                    return_routed_experts=return_routes, routed_experts_start_len=routes_start)
    if parsed.count > max_requests:
        raise BadRequest(f"sampling_params.n: {len(batch)} prompts x n make {parsed.count} sequences; "
                         f"this server queues at most {max_requests}")
    _check_reply_budget(parsed, limits.max_request_tokens)
    parsed.single = single and parsed.count == 1
    return parsed


def _check_reply_budget(parsed: Parsed, limit: int) -> None:
    """Refuse a request whose reply could exceed ``limit`` output tokens, before anything is queued."""
    total = sum(params.n * params.max_new_tokens for _, _, params in parsed.groups)
    if total > limit:
        raise BadRequest(f"sampling_params.max_new_tokens: {parsed.count} sequences of up to "
                         f"{max(p.max_new_tokens for _, _, p in parsed.groups)} new tokens make {total} tokens; "
                         f"this server answers at most {limit} per request (send fewer or shorter)")


def _routes_fields(body: dict[str, Any], shortest_prompt: int) -> tuple[bool, int]:
    """``return_routed_experts`` and ``routed_experts_start_len``, which must lie in [0, prompt tokens]
    (SGLang 0.5.23 refuses the request otherwise)."""
    wanted = body.get("return_routed_experts", False)
    if not isinstance(wanted, bool):
        raise BadRequest(f"return_routed_experts: expected true/false, got {wanted!r}")
    start = body.get("routed_experts_start_len", 0)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise BadRequest(f"routed_experts_start_len: expected an integer >= 0, got {start!r}")
    if wanted and start > shortest_prompt:
        raise BadRequest(f"routed_experts_start_len: {start} is higher than the number of input tokens "
                         f"({shortest_prompt})")
    return wanted, start


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def response(req: Request, *, return_logprob: bool, weight_version: str, tokenizer: Any,
             routed_experts_start_len: int = 0) -> dict[str, Any]:
    """The answer for one finished request; ``meta_info.routed_experts`` when its routes were kept."""
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": req.finish_reason, "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.output_ids), "cached_tokens": 0, "weight_version": weight_version,
        "weight_versions": version_spans(req.output_versions),
        "e2e_latency": round(req.finished_at - req.created, 6)}
    if return_logprob:
        meta["output_token_logprobs"] = [[_finite(lp), t, None] for lp, t in zip(req.output_logprobs,
                                                                                 req.output_ids, strict=True)]
    routes = _routes(req, routed_experts_start_len)
    if routes is not None:
        meta["routed_experts"] = routes
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


def _routes(req: Request, start: int) -> str | None:
    """Positions ``[start, seqlen - 1)`` of prompt + output, encoded as SGLang does; None when the
    request kept no routes or never got through the model (aborted while queued)."""
    end = len(req.prompt_ids) + len(req.output_ids) - 1
    if req.routes is None or req.routes.length < end:
        return None
    return encode_routes(req.routes.rows(min(start, end), end))


def _finite(logprob: float) -> float | None:
    """JSON has no NaN or infinity (Python would write a bare ``NaN``): such a logprob is null."""
    return logprob if math.isfinite(logprob) else None

"""``VLLMClient``: the rollout client's interface spoken to a vLLM server (0.32, started by ``launch/vllm.py``).

The fleet, the rollout requests and the weight push call the same methods as on ``RolloutClient``;
this class maps them onto vLLM's routes (served with ``VLLM_SERVER_DEV_MODE=1``; the weight-transfer
routes are the weight path's, ``weights/endpoints.py``):

| interface                               | vLLM                                                        |
|-----------------------------------------|-------------------------------------------------------------|
| ``generate``                            | ``POST /inference/v1/generate`` (token ids in and out)      |
| ``pause(mode)`` / ``resume``            | ``POST /pause?mode=abort|keep`` / ``POST /resume``          |
| ``abort`` / ``abort_all``               | ``POST /abort_requests``                                    |
| ``weight_version``                      | ``GET /weight_info``                                        |

Per-token versions are vLLM's own: its engine core labels each step's output with the weight
version set at ``/finish_weight_update``, and the final answer carries ``weight_versions`` spans
over the output tokens. Weights change only while the server is paused, so a request kept across a
pause (``keep``) comes back with a span per version, exact to the token.
"""
from __future__ import annotations

import logging
from typing import Any

from megatron_areal.fleet.client import GenerateResult, RolloutClient, ServerError

log = logging.getLogger(__name__)

# The project's pause modes (weights.pause_mode) as vLLM's: "retract" keeps the requests inside the
# server, which on vLLM is "keep" (frozen with their KV cache, continued under the new weights).
PAUSE_MODES = {"abort": "abort", "retract": "keep", "keep": "keep"}

# SGLang-style sampling keys (what the controller sends) -> vLLM SamplingParams fields
SAMPLING_KEYS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
                 "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
                 "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "n": "n",
                 "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                 "repetition_penalty": "repetition_penalty", "sampling_seed": "seed", "seed": "seed",
                 "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "include_stop_str_in_output"}

# vLLM's request ids of /inference/v1/generate: the caller's id behind this prefix
REQUEST_ID_PREFIX = "generate-tokens-"


def vllm_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang-style ``sampling_params`` as vLLM's, with the sampled token's logprob asked for.

    An unknown key raises ``ValueError`` naming it (vLLM would ignore or reject it less clearly)."""
    out: dict[str, Any] = {"logprobs": 0, "detokenize": False}
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"sampling_params.{key} is not supported by the vLLM backend "
                             f"(supported: {', '.join(sorted(SAMPLING_KEYS))})")
        out[SAMPLING_KEYS[key]] = value
    if out.get("top_k") is not None and out["top_k"] < 0:
        out["top_k"] = 0  # SGLang's "all tokens" is -1, vLLM's is 0
    if out.get("stop"):
        out["detokenize"] = True  # stop strings are matched on text
    return out


def results_from_reply(body: Any) -> list[GenerateResult]:
    """One ``GenerateResult`` per choice of a ``/inference/v1/generate`` answer, in choice order."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError(f"expected an object with choices, got {str(body)[:200]}")
    prompt_tokens = int((body.get("usage") or {}).get("prompt_tokens") or len(body.get("prompt_token_ids") or []))
    out = []
    for choice in sorted(body["choices"], key=lambda c: int(c.get("index", 0))):
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(entry["logprob"]) for entry in content]
        if len(logprobs) != len(ids):
            raise ValueError(f"choice {choice.get('index')}: {len(ids)} tokens but {len(logprobs)} logprobs")
        versions = versions_per_token(choice.get("weight_versions"), len(ids))
        reason = choice.get("finish_reason") or "abort"
        if reason not in ("stop", "length", "abort"):
            raise ValueError(f"choice {choice.get('index')}: unknown finish_reason {reason!r}")
        if choice.get("routed_experts") is not None:
            raise ValueError("routed_experts from vLLM are not supported yet (docs/backends.md)")
        out.append(GenerateResult(output_ids=ids, output_logprobs=logprobs, finish_reason=reason,
                                  weight_version=versions[-1] if versions else "default",
                                  prompt_tokens=prompt_tokens, completion_tokens=len(ids),
                                  output_versions=versions,
                                  meta_info={"request_id": body.get("request_id"),
                                             "stop_reason": choice.get("stop_reason"),
                                             "weight_versions": choice.get("weight_versions")}))
    return out


def versions_per_token(spans: Any, n: int) -> list[str]:
    """Expand vLLM's ``[{version, start, end}]`` spans to one label per output token; the spans must
    cover ``0 .. n`` exactly (vLLM labels every step), or ``ValueError``. No tokens: no spans needed."""
    if n == 0:
        return []
    if not isinstance(spans, list) or not spans:
        raise ValueError(f"{n} output tokens came without weight_versions")
    out: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(out) or end < start:
            raise ValueError(f"weight_versions {spans} do not cover the {n} output tokens in order")
        out += [str(span["version"])] * (end - start)
    if len(out) != n:
        raise ValueError(f"weight_versions {spans} cover {len(out)} of {n} output tokens")
    return out


class VLLMClient(RolloutClient):
    """Talks to one vLLM server with ``RolloutClient``'s methods (and its HTTP plumbing)."""

    # ---- generation ----------------------------------------------------------------------
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       rid: str | None = None, *, return_routed_experts: bool = False,
                       routed_experts_start_len: int = 0) -> GenerateResult:
        """One sample (``n`` must be 1 here: see ``generate_n``)."""
        results = await self.generate_n(input_ids, sampling_params, rid,
                                        return_routed_experts=return_routed_experts)
        if len(results) != 1:
            raise ServerError(self.url, "/inference/v1/generate", f"{len(results)} choices for one sample (n > 1)")
        return results[0]

    async def generate_n(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None,
                         *, return_routed_experts: bool = False) -> list[GenerateResult]:
        """``sampling_params["n"]`` samples of one prompt in one request, in choice order."""
        endpoint = "/inference/v1/generate"
        if return_routed_experts:
            raise ServerError(self.url, endpoint, "routed experts are not supported by the vLLM backend yet "
                              "(docs/backends.md)", status=400)
        try:
            params = vllm_sampling_params(sampling_params)
        except ValueError as e:
            raise ServerError(self.url, endpoint, str(e), status=400) from None
        body: dict[str, Any] = {"token_ids": list(input_ids), "sampling_params": params, "stream": False}
        if rid is not None:
            body["request_id"] = rid
        reply = await self.request("POST", endpoint, body, timeout_s=self.timeout_s)
        try:
            return results_from_reply(reply)
        except (ValueError, KeyError, TypeError) as e:
            raise ServerError(self.url, endpoint, f"malformed reply: {e}") from None

    async def pause(self, mode: str = "abort") -> None:
        """``/pause``: ``abort`` returns the running requests with what they have; ``keep`` (the
        project's ``retract``) freezes them until ``resume``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {sorted(PAUSE_MODES)}")
        await self.require_ours("/pause")  # the first call of every weight push
        await self.request("POST", f"/pause?mode={PAUSE_MODES[mode]}", {})

    async def resume(self) -> None:
        """``/resume``."""
        await self.request("POST", "/resume", {})

    async def abort_all(self) -> None:
        """Abort every request the server tracks."""
        await self.request("POST", "/abort_requests", {})

    async def abort(self, rid: str) -> None:
        """Abort the request the caller sent as ``rid``."""
        await self.request("POST", "/abort_requests", {"request_ids": [REQUEST_ID_PREFIX + rid]})

    async def flush_cache(self) -> None:
        """``/reset_prefix_cache`` (servers start without prefix caching: ``launch/vllm.py``)."""
        await self.request("POST", "/reset_prefix_cache", {})

    async def alive(self, timeout_s: float = 5.0) -> bool:
        """``/health`` (vLLM's does not generate: it answers while paused and during updates)."""
        return await self.health(timeout_s)

    async def load(self) -> int:
        """Running + waiting requests are not served without server-load tracking: report none."""
        return 0

    async def weight_version(self) -> str:
        """``/weight_info``: ``"default"`` until the first update names one."""
        reply = await self.request("GET", "/weight_info")
        return str(reply["weight_version"])

    async def model_info(self) -> dict[str, Any]:
        """``/v1/models``' first model, with the weight version added."""
        models = await self.request("GET", "/v1/models")
        info = dict(models["data"][0]) if models.get("data") else {}
        info["weight_version"] = await self.weight_version()
        return info

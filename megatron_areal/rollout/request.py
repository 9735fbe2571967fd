"""One sample generated across interruptions, server failures and weight updates.

A request runs as a chain of *segments*. Each segment posts ``prompt + tokens so far`` with the
remaining token budget to the least-loaded healthy server. A segment that comes back with
``finish_reason == "abort"`` (the fleet was paused for a weight update) keeps its tokens; the
next segment is posted once generation resumes, so it runs under the new weights. A server that
fails (connection lost, timeout, 5xx) is marked down and the segment is re-posted elsewhere from
the last tokens that did come back. Each token's version is the one the server reported for the
segment (per token where the server gives spans), never the controller's own idea of it.

With ``return_routed_experts`` (MoE models), each segment asks for the experts of the positions
it computes that no earlier segment did: from ``prompt + tokens so far - 1`` (the last token of
the previous segment, which this one feeds first) on. Concatenated, the segments' routes cover
positions ``0 .. len(input_ids) - 2``, each from the weights that produced the token after it.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_areal.fleet.client import GenerateResult, ServerError
from megatron_areal.fleet.routing import ServerPool

log = logging.getLogger(__name__)

# Aborts that return no new token while generation is not paused mean the server refuses the
# request in a loop; past this many in a row the sample fails instead of spinning. A weight mover
# that pauses the servers behind our back also returns queued requests empty, once per update,
# so the bound is far above any plausible number of updates a request waits through.
MAX_FRUITLESS_ABORTS = 1000


class SampleError(RuntimeError):
    """A sample cannot be generated (the server rejected the request itself)."""


@dataclass
class SampleOutput:
    """What one sample has generated so far, over every segment an interruption split it into."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    interruptions: int = 0  # segments ended by an abort
    # int32 (positions, layers, top_k) in C order over positions 0 .. route_positions - 1, when asked for
    routed_experts: bytes | None = None
    route_positions: int = 0

    def extend(self, result: GenerateResult, versions: list[int]) -> None:
        """Append one segment's tokens with their logprobs and versions (their lengths must agree)."""
        n = len(result.output_ids)
        if len(result.output_logprobs) != n or len(versions) != n:
            raise SampleError(f"server answer misaligned: {n} tokens, {len(result.output_logprobs)} "
                              f"logprobs, {len(versions)} versions")
        self.output_ids += result.output_ids
        self.output_logprobs += result.output_logprobs
        self.output_versions += versions

    def extend_routes(self, result: GenerateResult, positions: int, url: str) -> None:
        """Append a segment's routes, which must cover ``positions`` positions (after ``extend``)."""
        raw = result.routed_experts
        if raw is None:
            if result.output_ids:
                raise SampleError(f"{url} returned no routed_experts; a MoE model served by SGLang needs "
                                  "--enable-return-routed-experts (a dense model has none: turn "
                                  "rollout.return_routed_experts off)")
            return  # aborted before it ran: it computed nothing
        width = len(self.routed_experts) // self.route_positions if self.route_positions else None
        if len(raw) % max(positions, 1) or (positions == 0 and raw) or (
                width is not None and len(raw) != width * positions):
            raise SampleError(f"{url} returned {len(raw)} bytes of routed_experts for {positions} positions"
                              + (f" of {width} bytes each" if width else ""))
        self.routed_experts = (self.routed_experts or b"") + raw
        self.route_positions += positions


class VersionParser:
    """Server versions are strings. Integers are ours (set with each weight update); a server that
    was never updated reports its launch label (SGLang's ``"default"``), which means the weights
    it was started with: the controller's base version."""

    def __init__(self, base_version: int) -> None:
        self.base_version = base_version

    def __call__(self, label: str) -> int:
        try:
            return int(label)
        except ValueError:
            return self.base_version


async def generate_sample(pool: ServerPool, prompt_ids: list[int], sampling: dict[str, Any],
                          max_new_tokens: int, rid: str, wait_running: Callable[[], Awaitable[None]],
                          parse_version: Callable[[str], int],
                          is_paused: Callable[[], bool] = lambda: False,
                          on_tokens: Callable[[int], None] = lambda n: None,
                          return_routed_experts: bool = False) -> SampleOutput:
    """Generate one sample to completion (``stop`` or ``length``) through any interruptions."""
    out = SampleOutput()
    segment = fruitless = 0
    while True:
        remaining = max_new_tokens - len(out.output_ids)
        if remaining <= 0:
            out.finish_reason = "length"
            return out
        await wait_running()
        await pool.wait_healthy()
        slot = pool.pick()
        params = {**sampling, "max_new_tokens": remaining}
        pool.begin(slot)
        try:
            result = await slot.client.generate(prompt_ids + out.output_ids, params, rid=f"{rid}.{segment}",
                                                return_routed_experts=return_routed_experts,
                                                routed_experts_start_len=out.route_positions)
        except ServerError as e:
            if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                raise SampleError(f"request {rid} rejected by {slot.url}: {e}") from e
            pool.mark_down(slot, str(e))
            continue
        finally:
            pool.end(slot)
            segment += 1
        pool.succeeded(slot)
        out.extend(result, [parse_version(v) for v in result.output_versions])
        if return_routed_experts:
            out.extend_routes(result, len(prompt_ids) + len(out.output_ids) - 1 - out.route_positions, slot.url)
        on_tokens(len(result.output_ids))
        if result.finish_reason != "abort":
            out.finish_reason = result.finish_reason
            return out
        out.interruptions += 1
        fruitless = 0 if result.output_ids or is_paused() else fruitless + 1
        if fruitless > MAX_FRUITLESS_ABORTS:
            raise SampleError(f"request {rid}: {slot.url} aborted it {fruitless} times without progress")

"""Test servers speaking the subset of the SGLang protocol the rollout controller uses.

Each emitted token encodes the weight version that produced it (``token // 1000``) and its
logprob encodes the token (``-(token % 1000) / 1000``), so a test can check per-token versions
and alignment from the tokens alone. ``/pause_generation`` aborts running requests (they return
200 with their partial output, finish_reason abort) and holds new ones until continue, as
SGLang's default pause mode does. Servers run on their own event loop in a background thread.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

STOP_OFFSET = 999  # token % 1000 == 999 is the end-of-sequence token


@dataclass
class FakeServer:
    seed: int
    token_delay: tuple[float, float] = (0.0005, 0.003)  # seconds per token, uniform
    stop_prob: float = 0.05  # per token: geometric (long-tailed) output lengths
    version: int = 0
    paused: bool = False
    port: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)  # rid, time, version, n_input
    inflight: set[str] = field(default_factory=set)  # rids being generated
    cut: set[str] = field(default_factory=set)  # rids in flight when the server was killed
    active: int = 0
    max_active: int = 0
    reject_prompt: int | None = None  # answer 400 to requests for this prompt index (a bad request)
    slow_prompt: int | None = None  # this prompt index decodes 20x slower and never stops early

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._abort_epoch = 0
        self._resumed: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._transports: set[Any] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _token(self) -> int:
        if self.rng.random() < self.stop_prob:
            return 1000 * self.version + STOP_OFFSET
        return 1000 * self.version + self.rng.randrange(2, STOP_OFFSET)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["input_ids"][2] == self.reject_prompt:
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        while self.paused:
            await self._resumed.wait()
        max_new = int(body["sampling_params"]["max_new_tokens"])
        self.requests.append({"rid": body.get("rid"), "time": time.monotonic(), "version": self.version,
                              "n_input": len(body["input_ids"])})
        epoch, out, reason = self._abort_epoch, [], "length"
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self._transports.add(request.transport)
        self.inflight.add(body.get("rid"))
        try:
            slow = body["input_ids"][2] == self.slow_prompt
            while len(out) < max_new:
                await asyncio.sleep(self.rng.uniform(*self.token_delay) * (20 if slow else 1))
                if self._abort_epoch != epoch:
                    reason = "abort"
                    break
                out.append(self._token())
                if out[-1] % 1000 == STOP_OFFSET and not slow:
                    reason = "stop"
                    break
        finally:
            self.active -= 1
            self._transports.discard(request.transport)
            self.inflight.discard(body.get("rid"))
        meta = {"finish_reason": {"type": reason}, "weight_version": str(self.version),
                "output_token_logprobs": [[-(t % 1000) / 1000, t, None] for t in out],
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out)}
        return web.json_response({"output_ids": out, "meta_info": meta})

    async def do_pause(self) -> None:
        self.paused = True
        self._resumed.clear()
        self._abort_epoch += 1
        while self.active:  # abort mode returns once the running requests have drained
            await asyncio.sleep(0.001)

    async def do_resume(self) -> None:
        self.paused = False
        self._resumed.set()

    async def pause(self, request: web.Request) -> web.Response:
        await self.do_pause()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.do_resume()
        return web.json_response({"message": "ok", "status": "ok"})

    async def abort(self, request: web.Request) -> web.Response:
        self._abort_epoch += 1
        return web.Response(text="")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    async def start(self) -> None:
        """Listen (again, on the same port once one was bound): a (re)started, unpaused server."""
        self.paused, self._resumed = False, asyncio.Event()
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.resume)
        app.router.add_post("/abort_request", self.abort)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_weight_version", self.get_weight_version)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def kill(self) -> None:
        """Stop answering: open connections are cut and new ones refused (a crashed server)."""
        self.cut = set(self.inflight)
        for transport in list(self._transports):
            transport.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class FakeFleet:
    """Several FakeServers on one background event loop."""

    def __init__(self, servers: list[FakeServer]) -> None:
        self.servers = servers
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        for s in servers:
            self.run(s.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def set_version(self, version: int) -> None:
        """The weight update itself (done while the fleet is paused)."""
        for s in self.servers:
            s.version = version

    def update_behind_controllers_back(self, version: int) -> None:
        """A weight mover that pauses, updates and continues the servers on its own."""
        for s in self.servers:
            self.run(s.do_pause())
        self.set_version(version)
        for s in self.servers:
            self.run(s.do_resume())

    def close(self) -> None:
        for s in self.servers:
            self.run(s.kill())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@dataclass
class ListPrompt:
    index: int
    text: str
    answer: Any
    task: str = "parity"

    def reward_answer(self) -> Any:
        return self.answer


class ListPrompts:
    """A finite resumable prompt stream over ``range(n)`` with push-back (the PromptSourceLike shape)."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.pushed = n, 0, []

    def __next__(self) -> ListPrompt:
        if self.pushed:
            i = self.pushed.pop(0)
        elif self.pos < self.n:
            i, self.pos = self.pos, self.pos + 1
        else:
            raise StopIteration
        return ListPrompt(index=i, text=f"prompt {i}", answer=i % 2)

    def push_back(self, indices: list[int]) -> None:
        self.pushed = list(indices) + self.pushed

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "pushed": list(self.pushed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos, self.pushed = state["pos"], list(state["pushed"])


@dataclass
class ParityReward:
    reward: float
    status: str = "ok"


class ParityScorer:
    """Reward 1 when the response has an even number of tokens (a cheap, varied signal)."""

    async def score(self, task: str, response_text: str, answer: Any) -> ParityReward:
        return ParityReward(reward=float(len(response_text.split()) % 2 == 0))


def encode(prompt: ListPrompt) -> list[int]:
    return [7, 8, prompt.index]


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids))

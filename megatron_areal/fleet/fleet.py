"""``Fleet``: the rollout servers as one trainer process knows them, on one event loop.

Trainer rank 0 holds one ``Fleet`` and shares it: the rollout controller routes generation over
its members (``routing``, with their health and load), the weight path pauses, updates, drops and
re-admits servers through it, and evaluation answers on it. A server the weight path drops is
therefore out of the routing at once, and every HTTP client of the process is created, driven and
closed on the same background loop. (Each other pipeline stage's head holds a ``Fleet`` of its own
for its weight stream, with nobody routing over it.)

Blocking methods (``run``, ``each``, ``alive``, ``drop``, ``join``, ``close``) are for plain
threads; code already on the loop uses ``routing`` directly.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from megatron_areal.fleet.backends import client_class
from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.routing import ServerPool

T = TypeVar("T")


def normalize_url(url: str) -> str:
    """The one spelling of a server's address: a scheme, no trailing slash."""
    url = url.rstrip("/")
    return url if "://" in url else "http://" + url


class Fleet:
    """One client per server on one background event loop, and the members' routing state."""

    def __init__(self, urls: Iterable[str] = (), *, api_key: str | None = None, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic,
                 engine: str = "embedded") -> None:
        self.api_key, self.timeout_s = api_key, control_timeout_s
        self.engine, self._client_class = engine, client_class(engine)  # server.engine: which client speaks
        self.request_timeout_s = request_timeout_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fleet", daemon=True)
        self._thread.start()
        self._clients: dict[str, RolloutClient] = {}
        self.routing: ServerPool = self.run(self._make_routing([normalize_url(u) for u in urls], clock))

    async def _make_routing(self, urls: list[str], clock: Callable[[], float]) -> ServerPool:
        return ServerPool([self.client(u) for u in urls], clock=clock)

    def client(self, url: str) -> RolloutClient:
        """The one client of ``url`` (made on first use); call on the loop (aiohttp's rule)."""
        url = normalize_url(url)
        if url not in self._clients:
            self._clients[url] = self._client_class(url, api_key=self.api_key, timeout_s=self.request_timeout_s,
                                                    control_timeout_s=self.timeout_s)
        return self._clients[url]

    @property
    def urls(self) -> list[str]:
        """The members, in the order they joined."""
        return [slot.url for slot in list(self.routing.slots)]

    # ----- from a plain thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the fleet's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, url: str, call: Callable[[RolloutClient], Awaitable[T]]) -> cf.Future[T]:
        """Start ``call(client of url)`` on the loop; the future is returned at once."""
        async def go() -> T:
            return await call(self.client(url))
        return asyncio.run_coroutine_threadsafe(go(), self.loop)

    def each(self, urls: Iterable[str], call: Callable[[RolloutClient], Awaitable[object]],
             timeout_s: float | None = None) -> dict[str, str]:
        """Run ``call`` on every server concurrently; returns {url: error message} of the failures."""
        futures = {url: self.submit(url, call) for url in urls}
        return wait_all(futures, timeout_s or self.timeout_s)

    def alive(self, urls: Iterable[str], timeout_s: float = 5.0) -> dict[str, bool]:
        """{url: answers ``/model_info``}: the servers may be paused, so no generation probe."""
        futures = {url: self.submit(url, lambda c: c.alive(timeout_s)) for url in urls}
        out: dict[str, bool] = {}
        for url, future in futures.items():
            try:
                out[url] = bool(future.result(timeout_s + 5.0))
            except Exception:  # noqa: BLE001 - no answer of any kind means "not healthy"
                out[url] = False
        return out

    def drop(self, url: str, reason: str) -> None:
        """Route nothing more to ``url`` (the weight path dropped it: it will not get new weights)."""
        async def go() -> None:
            self.routing.remove(normalize_url(url), reason)
        self.run(go())

    def join(self, url: str) -> None:
        """Route to ``url`` (again): the weight path gave it the current weights."""
        async def go() -> None:
            self.routing.add(self.client(url))
        self.run(go())

    def close(self) -> None:
        """Close every client and stop the fleet's event loop thread."""
        if not self._thread.is_alive():
            return
        async def close_clients() -> None:
            await asyncio.gather(*(c.close() for c in self._clients.values()), return_exceptions=True)
        self.run(close_clients())
        self._clients.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def wait_all(futures: dict[str, cf.Future], timeout_s: float) -> dict[str, str]:
    """Wait for all futures until one shared deadline; {url: message} for those that failed or hung."""
    deadline = time.monotonic() + timeout_s
    errors: dict[str, str] = {}
    for url, future in futures.items():
        try:
            future.result(max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            future.cancel()
            errors[url] = f"{url}: no reply within {timeout_s:.0f}s"
        except Exception as e:  # noqa: BLE001 - ServerError or transport errors, reported by name
            errors[url] = str(e) if url in str(e) else f"{url}: {type(e).__name__}: {e}"
    return errors

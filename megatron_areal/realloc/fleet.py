"""The trainer's HTTP side of the weight transfer: rollout clients on a private event loop.

The trainer's ranks are synchronous code that blocks in collectives, so the clients live on an
asyncio loop in a background thread. ``submit`` returns a ``concurrent.futures.Future`` at once:
the HTTP request to ``/update_weights_from_distributed`` is in flight while the calling thread
runs the broadcast that the server is waiting for.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from megatron_areal.rollout.client import RolloutClient

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServerPool:
    """One ``RolloutClient`` per server URL, all driven by one background event loop."""

    def __init__(self, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        self.api_key, self.timeout_s = api_key, timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="realloc-http", daemon=True)
        self._thread.start()
        self._clients: dict[str, RolloutClient] = {}

    def _client(self, url: str) -> RolloutClient:
        if url not in self._clients:
            # aiohttp sessions must be created on the loop that uses them
            self._clients[url] = self._run(self._make_client(url))
        return self._clients[url]

    async def _make_client(self, url: str) -> RolloutClient:
        return RolloutClient(url, api_key=self.api_key, control_timeout_s=self.timeout_s)

    def _run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    def submit(self, url: str, call: Callable[[RolloutClient], Awaitable[T]]) -> cf.Future[T]:
        client = self._client(url)
        return asyncio.run_coroutine_threadsafe(call(client), self._loop)  # type: ignore[arg-type]

    def each(self, urls: Iterable[str], call: Callable[[RolloutClient], Awaitable[object]],
             timeout_s: float | None = None) -> dict[str, str]:
        """Run ``call`` on every server concurrently; returns {url: error message} of the failures."""
        futures = {url: self.submit(url, call) for url in urls}
        return wait_all(futures, timeout_s or self.timeout_s)

    def alive(self, urls: Iterable[str], timeout_s: float = 5.0) -> dict[str, bool]:
        """{url: answers ``/model_info``}: the servers are paused here, so no generation probe."""
        futures = {url: self.submit(url, lambda c: c.alive(timeout_s)) for url in urls}
        out: dict[str, bool] = {}
        for url, future in futures.items():
            try:
                out[url] = bool(future.result(timeout_s + 5.0))
            except Exception:  # noqa: BLE001 - no answer of any kind means "not healthy"
                out[url] = False
        return out

    def close(self) -> None:
        for client in self._clients.values():
            self._run(client.close())
        self._clients.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


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

"""A broadcast wake-up for coroutines of one event loop waiting on "something changed"."""
from __future__ import annotations

import asyncio


class Signal:
    """A broadcast wake-up for coroutines waiting on "something changed" (asyncio, one loop)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        """Wake every coroutine waiting now; later waiters wait for the next notify."""
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None = None) -> bool:
        """True if notified, False on timeout."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
            return True
        except TimeoutError:
            return False

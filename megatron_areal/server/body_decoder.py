"""Large JSON bodies decoded in helper processes, so that decoding never holds the server's GIL.

``json.loads`` holds the GIL for the whole call: a 15 MB body takes about a second (3.7 million
empty lists, close to four), and on a thread of the server that is a second in which the event
loop cannot answer even ``/health``. So a large body is decoded in a helper process (spawned: it
imports only this module and the standard library), which sends back what the server needs in a
form that is cheap to rebuild: a list of at least ``PACK_MIN`` integers travels as an
``array('q')`` (one copy of its bytes), everything else as the decoded objects, at most
``MAX_VALUES`` of them (more is refused: rebuilding them would hold the GIL too).
"""
from __future__ import annotations

import gc
import json
import multiprocessing
from array import array
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

PACK_MIN = 64  # shorter integer lists travel as they are
# JSON values in a body besides the integers of packed lists: a bucket announcement of 100,000
# tensors (name, dtype, shape) has about 500,000; rebuilding a million takes a few tenths of a second.
MAX_VALUES = 2**20
DECODER_PROCESSES = 2


class DecodeError(ValueError):
    """The body is not JSON the server can take (its message says why)."""


def decode_packed(raw: bytes) -> tuple[bool, Any]:
    """In a helper process: (True, the body with integer lists packed) or (False, why it was refused)."""
    gc.disable()  # millions of fresh containers would set off collection after collection; this process keeps none
    try:
        return True, _pack(json.loads(raw), [0])
    except ValueError as e:  # bad syntax or encoding, an integer past Python's 4300-digit limit
        return False, f"malformed JSON body: {e}"
    except RecursionError:
        return False, "malformed JSON body: nested too deeply"
    except _TooMany:
        return False, (f"the body holds more than {MAX_VALUES} JSON values (besides the integers of token-id "
                       "lists); send fewer")
    finally:
        gc.enable()


class _TooMany(Exception):
    pass


def _pack(value: Any, counted: list[int]) -> Any:
    counted[0] += 1
    if counted[0] > MAX_VALUES:
        raise _TooMany
    if isinstance(value, list):
        if len(value) >= PACK_MIN and set(map(type, value)) == {int}:  # not bool, a subclass of int
            try:
                return array("q", value)
            except OverflowError:  # past 64 bits: sent as it is (and refused by the route)
                pass
        return [_pack(x, counted) for x in value]
    if isinstance(value, dict):
        return {k: _pack(v, counted) for k, v in value.items()}
    return value


def unpack(value: Any) -> Any:
    """The body as ``json.loads`` would have returned it (run on a worker thread: a bounded walk)."""
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, list):
        return [unpack(x) for x in value]
    if isinstance(value, dict):
        return {k: unpack(v) for k, v in value.items()}
    return value


class BodyDecoder:
    """The helper processes; ``decode`` from a thread of the server (it blocks until the helper answers)."""

    def __init__(self, processes: int = DECODER_PROCESSES) -> None:
        self._processes = processes
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # started at the first large body
            self._pool = ProcessPoolExecutor(max_workers=self._processes,
                                             mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def decode(self, raw: bytes) -> Any:
        """The decoded body; DecodeError when it is refused or a helper died on it (a new one takes over)."""
        pool = self._executor()
        try:
            ok, result = pool.submit(decode_packed, raw).result()
        except BrokenProcessPool:
            self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise DecodeError("the body could not be decoded (its decoder process died)") from None
        if not ok:
            raise DecodeError(result)
        return unpack(result)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

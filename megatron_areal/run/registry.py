"""Server registration through the run directory (on the filesystem all nodes share).

A healthy server writes ``<run_dir>/servers/<id>`` (JSON with its ``url``). The launcher and the
trainer wait for the servers the plan expects, with a timeout and an error that names the
directory, the servers that did not arrive and - when a server process has already died - the end
of its log. A launch that hangs forever is the most common multi-node failure; this never does.

With the run's nonce (``megatron_areal/run_identity.py``), a registered server counts only once it proves
it is this run's: a registration names an address, and whoever answers there may be another job's server
that took the port our server failed to bind.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from megatron_areal.run.errors import LaunchError
from megatron_areal.run.plan import ServerSlot
from megatron_areal.util.run_identity import identity_problem

logger = logging.getLogger(__name__)


def clear_registrations(reg_dir: Path) -> None:
    """Forget servers of an earlier attempt (a requeued job must not trust dead addresses)."""
    reg_dir.mkdir(parents=True, exist_ok=True)
    for f in reg_dir.iterdir():
        if f.is_file():
            f.unlink(missing_ok=True)


def read_registrations(reg_dir: Path) -> dict[str, str]:
    """File name -> registered url; half-written or foreign files are skipped."""
    found: dict[str, str] = {}
    if not reg_dir.is_dir():
        return found
    for f in sorted(reg_dir.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        try:
            url = json.loads(f.read_text()).get("url")
        except (OSError, ValueError, AttributeError):
            continue  # being written right now; the next poll reads it
        if isinstance(url, str):
            found[f.name] = url.rstrip("/")
    return found


def _matches(slot: ServerSlot, url: str) -> bool:
    parts = urlsplit(url)
    return parts.port == slot.port and parts.hostname in (slot.addr, slot.node)


def match_servers(slots: list[ServerSlot], registered: dict[str, str]) -> dict[str, str]:
    """Slot id -> registered url for every expected server that has registered."""
    out: dict[str, str] = {}
    for slot in slots:
        for name, url in registered.items():
            if name == slot.id or _matches(slot, url):
                out[slot.id] = url
                break
    return out


def wait_for_servers(reg_dir: Path, slots: list[ServerSlot], timeout_s: float,
                     failure: Callable[[], str | None] = lambda: None, poll_s: float = 0.5,
                     nonce: str | None = None) -> list[str]:
    """Urls of ``slots`` in order, once all registered (and, given the run's ``nonce``, each proved it is this
    run's server). ``failure()`` returns a message when a server is known dead, which ends the wait at once
    instead of at the timeout."""
    start = time.monotonic()
    last_report = start
    proven: set[str] = set()
    impostors: dict[str, str] = {}
    while True:
        found = match_servers(slots, read_registrations(reg_dir))
        if nonce:
            found = _proven(found, nonce, proven, impostors)
        if len(found) == len(slots):
            logger.info("all %d servers registered in %s after %.1f s", len(slots), reg_dir,
                        time.monotonic() - start)
            return [found[s.id] for s in slots]
        dead = failure()
        missing = [s for s in slots if s.id not in found]
        if dead:
            raise LaunchError(f"{dead}\nstill waiting for {_describe(missing)} to register in {reg_dir}"
                              f"{_impostors(impostors)}")
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            raise LaunchError(
                f"timed out after {timeout_s:.0f} s waiting for {len(missing)} of {len(slots)} rollout servers "
                f"to register in {reg_dir}: missing {_describe(missing)}; registered: "
                f"{', '.join(sorted(found)) or 'none'}{_impostors(impostors)}. Check the server logs, and that "
                f"{reg_dir} is on a filesystem every node shares.")
        if time.monotonic() - last_report > 30:
            logger.info("waiting for %d of %d servers in %s (%.0f s)", len(missing), len(slots), reg_dir, elapsed)
            last_report = time.monotonic()
        time.sleep(poll_s)


def _proven(found: dict[str, str], nonce: str, proven: set[str], impostors: dict[str, str]) -> dict[str, str]:
    """The registered servers that proved they are this run's (each proven url is asked once)."""
    out = {}
    for slot_id, url in found.items():
        if url not in proven:
            problem = identity_problem(url, nonce)
            if problem is not None:
                if impostors.get(slot_id) != problem:
                    logger.warning("server %s registered %s, but %s; not admitted", slot_id, url, problem)
                impostors[slot_id] = problem
                continue
            proven.add(url)
            impostors.pop(slot_id, None)
        out[slot_id] = url
    return out


def _impostors(impostors: dict[str, str]) -> str:
    return "".join(f"; {slot_id}: {why}" for slot_id, why in sorted(impostors.items()))


def _describe(slots: list[ServerSlot], limit: int = 8) -> str:
    text = ", ".join(f"{s.id} ({s.url})" for s in slots[:limit])
    return text + (f" and {len(slots) - limit} more" if len(slots) > limit else "")

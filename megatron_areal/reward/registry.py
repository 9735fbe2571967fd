"""Verifiers by task name.

A verifier is a picklable callable ``(response_text, answer) -> float | Verdict``. The registry
travels to every worker process of the reward pool, so verifiers must be module-level functions
or instances of module-level classes. Tasks are looked up by name in a dict; adding a task is a
``register`` call, never a new branch in the service.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple


class Verdict(NamedTuple):
    reward: float
    detail: str = ""


Verifier = Callable[[str, Any], "float | Verdict"]


class UnknownTask(KeyError):
    """No verifier is registered under the task name."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class VerifierRegistry:
    def __init__(self) -> None:
        self._verifiers: dict[str, Verifier] = {}

    def register(self, task: str, verifier: Verifier, *, replace: bool = False) -> None:
        if not task:
            raise ValueError("task name must be non-empty")
        if task in self._verifiers and not replace:
            raise ValueError(f"a verifier for task '{task}' is already registered (pass replace=True)")
        self._verifiers[task] = verifier

    def get(self, task: str) -> Verifier:
        try:
            return self._verifiers[task]
        except KeyError:
            known = ", ".join(sorted(self._verifiers)) or "none"
            raise UnknownTask(f"no verifier registered for task '{task}' (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._verifiers)

    def __contains__(self, task: str) -> bool:
        return task in self._verifiers

    def preflight(self, tasks: Iterable[str]) -> None:
        """Let verifiers that depend on the host (the code sandbox) fail now, not mid-run."""
        for task in tasks:
            check = getattr(self.get(task), "preflight", None)
            if check is not None:
                check()

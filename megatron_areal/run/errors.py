"""The error every launch step raises: a server that did not come up, a plan that does not fit."""
from __future__ import annotations


class LaunchError(RuntimeError):
    """A launch step failed; the message says what and where (a URL, a folder, a log's last lines)."""

"""What went wrong when a checkpoint could not be written, in words a user can act on.

Megatron's writer processes write with ``torch.save``, whose zip writer does not keep the errno of a
short write: a full disk surfaces as "unexpected pos 704 vs 598" inside a ``CheckpointException``
gathered from every rank. A short write on a local or network filesystem means the device or the
quota is full, so that message, or an ENOSPC/EDQUOT anywhere in the failure, is reported as "no
space left on device" with the folder, the space free there and what the previous checkpoint took.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# how a failed write reads once it has been turned into text by a writer process or torch's zip writer
_NO_SPACE_TEXTS = ("no space left on device", "disk quota exceeded", "unexpected pos")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message says why and where. Earlier checkpoints are untouched."""


def _failures(error: BaseException) -> list[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures a ``CheckpointException`` carries."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return seen


def _last_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


def is_out_of_space(error: BaseException) -> bool:
    for e in _failures(error):
        if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(e).lower() for text in _NO_SPACE_TEXTS):
            return True
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            st = os.statvfs(candidate)
            return st.f_bavail * st.f_frsize
    return None


def describe_write_failure(error: BaseException, folder: Path, previous_bytes: int | None) -> str:
    """The message of the ``CheckpointWriteError`` for ``error``, raised while writing into ``folder``."""
    cause = _last_line(_failures(error)[-1]) if _failures(error) else _last_line(error)
    if not is_out_of_space(error):
        return f"cannot write checkpoint into {folder}: {cause}"
    free = free_bytes(folder)
    room = f"{free / 2**20:.1f} MiB free there" if free is not None else "free space unknown"
    need = f"; the previous checkpoint took {previous_bytes / 2**20:.1f} MiB" if previous_bytes else ""
    return (f"no space left on device while writing checkpoint into {folder} ({room}{need}); earlier checkpoints "
            f"are untouched. Free space or point checkpoint.dir at a larger filesystem ({cause})")

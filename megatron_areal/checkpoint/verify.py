"""Whether a checkpoint's files are whole, read without building a model or a process group.

A node that died while a checkpoint was copied, or a disk that filled, leaves files cut short.
Every tensor file is checked against the byte ranges the checkpoint's own tensor index
(``.metadata``, torch.distributed.checkpoint's) says it holds; the index itself, the common state
(``common.pt``: step, scheduler, the trainer's own state) and the description
(``megatron_areal.json``) must load. A flipped byte inside a tensor is not found here; a cut is.
"""
from __future__ import annotations

from pathlib import Path

from megatron_areal.checkpoint import dist_ckpt

COMMON_STATE = "common.pt"  # megatron.core.dist_checkpointing's file of the non-sharded state


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def checkpoint_damage(path: str | Path) -> str | None:
    """None when every file of checkpoint ``path`` is whole; otherwise what is wrong, naming the file."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    try:
        dist_ckpt.read_meta(path)
    except (OSError, ValueError) as e:
        return str(e)
    try:
        index = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read the index (EOFError, UnpicklingError, ...)
        return f"{path / '.metadata'}: the tensor index cannot be read ({_first_line(e)})"
    needed: dict[str, int] = {}
    for item in (index.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file}: missing (the tensor index refers to it)"
        size = file.stat().st_size
        if size < end:
            return f"{file}: truncated ({size} bytes; the tensor index needs {end})"
    try:
        dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:  # noqa: BLE001 - as above: whatever stops the common state from loading
        return f"{path / COMMON_STATE}: the common state cannot be read ({_first_line(e)})"
    return None

"""Loading, checking and fingerprinting the server's weights (by Hugging Face tensor name)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, load_file
from torch import nn

from megatron_areal.weights.wire import SLICE_SUM, format_sum, slice_sum

# Reads that outlived their deadline keep a thread each, blocked in the kernel; past this many,
# loads from disk are refused until one of them returns.
MAX_BLOCKED_READS = 4
_blocked_reads: set[str] = set()
_blocked_lock = threading.Lock()
# Reads go in chunks of this size, so that a reader told to stop (at the load's timeout) stops
# after at most one more chunk.
READ_CHUNK_BYTES = 16 * 2**20
# Safetensors headers (JSON, a few hundred bytes per tensor) and an index file, on top of the
# tensors' own bytes.
HEADER_ALLOWANCE_BYTES = 64 * 2**20
# How long a reader told to stop may take to finish its chunk before the load answers anyway.
STOP_GRACE_S = 1.0


class WeightError(ValueError):
    """Weights that do not fit the model; the served weights are left unchanged."""


_NAMED: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by HF name: the live objects (``state_dict(keep_vars=True)``),
    built once per model; ``state_dict()`` walks every module on each call, milliseconds a weight install paid
    three times over. A load swaps a parameter's ``.data`` or copies into it, never replaces the object."""
    named = _NAMED.get(model)
    if named is None:
        named = _NAMED[model] = model.state_dict(keep_vars=True)
    return named


def disk_bytes_bound(model: nn.Module) -> int:
    """The most bytes a weights folder for ``model`` may hold: every tensor (plus a tied head) at
    8 bytes per element, the widest floating-point type, and the safetensors headers."""
    sizes = [t.numel() for t in named_tensors(model).values()]
    return 8 * (sum(sizes) + max(sizes, default=0)) + HEADER_ALLOWANCE_BYTES


def read_safetensors(hf_dir: str | Path, timeout_s: float | None = None,
                     max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (single file or sharded with an index).

    A broken index or shard is the caller's input, not a server fault: it raises WeightError
    naming the file, so a weight update answers 400 and keeps the served weights.

    With ``timeout_s`` every file is opened and read on a thread of its own, in chunks (plain reads,
    which release the GIL), and parsed from memory. A file that is not a regular file (a device such
    as /dev/zero, a FIFO, a socket) is refused before anything is read, and so is a folder whose files
    add up to more than ``max_bytes`` by their size on record (a sparse file counts in full). A
    folder not read within ``timeout_s`` raises WeightError and its reader stops after its current
    chunk: a hung network filesystem then costs one blocked thread, not the server. Without
    ``timeout_s`` the files are memory-mapped (the server's start, from its own model folder).
    """
    folder = Path(hf_dir)
    deadline = None if timeout_s is None else _Deadline(time.monotonic() + timeout_s, timeout_s,
                                                        _Budget(max_bytes))
    index = folder / "model.safetensors.index.json"
    files = _indexed_files(index, deadline) if index.is_file() else sorted(
        p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{folder}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(_load_shard(folder / name, deadline))
    return tensors


@dataclass
class _Budget:
    """Bytes the files of one load may still take (None: no bound)."""

    left: int | None
    total: int | None = None

    def __post_init__(self) -> None:
        self.total = self.left

    def take(self, path: Path, size: int) -> None:
        if self.left is None:
            return
        if size > self.left:
            raise WeightError(f"{path}: {size} bytes would make the folder larger than the {self.total} bytes "
                              "a checkpoint of this model can take (8 bytes per parameter and the headers); "
                              "the served weights are kept")
        self.left -= size


@dataclass(frozen=True)
class _Deadline:
    at: float  # time.monotonic()
    seconds: float  # the whole load's budget, for messages
    budget: _Budget


class _Stopped(Exception):
    """The reader was told to stop (the load's timeout passed)."""


def _read_chunks(fd: int, name: str, limit: int, stop: threading.Event) -> bytes:
    """``fd`` to its end in chunks; WeightError past ``limit`` bytes, ``_Stopped`` once ``stop`` is set."""
    chunks, total = [], 0
    while True:
        if stop.is_set():
            raise _Stopped
        chunk = os.read(fd, min(READ_CHUNK_BYTES, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            raise WeightError(f"{name}: more than the {limit} bytes expected (it grew while read?); "
                              "the served weights are kept")
        chunks.append(chunk)


def _read_regular_file(path: Path, budget: _Budget, stop: threading.Event) -> bytes:
    """Open ``path`` without blocking (a FIFO would wait for a writer), refuse what is not a regular file or
    does not fit ``budget``, then read exactly its recorded size."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WeightError(f"{path}: not a regular file (a device, FIFO or socket); the served weights are kept")
        budget.take(path, info.st_size)
        os.set_blocking(fd, True)
        return _read_chunks(fd, str(path), info.st_size, stop)
    finally:
        os.close(fd)


def read_fd_bounded(fd: int, name: str, *, max_bytes: int, timeout_s: float) -> bytes:
    """The bytes of the open file ``fd`` up to its end, at most ``max_bytes``, read on a thread of its own
    that stops at ``timeout_s`` (WeightError naming ``name``)."""
    deadline = _Deadline(time.monotonic() + timeout_s, timeout_s, _Budget(max_bytes))
    return _on_reader_thread(lambda stop: _read_chunks(fd, name, max_bytes, stop), name, deadline)


def _read_by(path: Path, deadline: _Deadline) -> bytes:
    """The bytes of the regular file ``path``; WeightError when they are not all there by ``deadline``."""
    return _on_reader_thread(lambda stop: _read_regular_file(path, deadline.budget, stop), str(path), deadline)


def _on_reader_thread(read: Callable[[threading.Event], bytes], name: str, deadline: _Deadline) -> bytes:
    """``read(stop)`` on a daemon thread; at the deadline ``stop`` is set and WeightError raised."""
    with _blocked_lock:
        if len(_blocked_reads) >= MAX_BLOCKED_READS:
            raise WeightError(f"{name}: refused: {len(_blocked_reads)} earlier weight reads are still blocked "
                              f"({', '.join(sorted(_blocked_reads))})")
        _blocked_reads.add(name)
    outcome: list[bytes | Exception] = []
    stop = threading.Event()

    def run() -> None:
        try:
            outcome.append(read(stop))
        except _Stopped:
            pass
        except (OSError, MemoryError, WeightError) as e:
            outcome.append(e)
        finally:
            with _blocked_lock:
                _blocked_reads.discard(name)

    reader = threading.Thread(target=run, name=f"read {Path(name).name}", daemon=True)
    reader.start()
    reader.join(max(0.0, deadline.at - time.monotonic()))
    if not outcome:
        stop.set()
        reader.join(STOP_GRACE_S)  # a reader between chunks is gone before the reply
        raise WeightError(f"{name}: not read within the weight-load timeout of {deadline.seconds:g}s (a filesystem "
                          "that does not answer?); the served weights are kept")
    result = outcome[0]
    if isinstance(result, WeightError):
        raise result
    if isinstance(result, MemoryError):
        raise WeightError(f"{name}: cannot read: out of memory") from None
    if isinstance(result, OSError):
        raise WeightError(f"{name}: cannot read: {result}")
    return result


def _indexed_files(index: Path, deadline: _Deadline | None = None) -> list[str]:
    """The shard names an index's ``weight_map`` points to."""
    try:
        text = index.read_text() if deadline is None else _read_by(index, deadline).decode()
        weight_map = json.loads(text).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise WeightError(f"{index}: not a readable JSON index: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightError(f"{index}: 'weight_map' must map tensor names to file names")
    return sorted(set(weight_map.values()))


def _load_shard(path: Path, deadline: _Deadline | None = None) -> dict[str, torch.Tensor]:
    data = None if deadline is None else _read_by(path, deadline)
    try:
        return load_file(str(path)) if data is None else load(data)
    except Exception as e:  # safetensors raises its own SafetensorError, the OS FileNotFoundError
        raise WeightError(f"{path}: cannot read safetensors: {e}") from None


def check_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *, complete: bool) -> None:
    """Raise WeightError unless every name is a model tensor of the same shape and a floating-point dtype.

    ``complete`` also requires every model tensor to be present (a load from disk); distributed
    updates may come bucket by bucket, each naming a subset.
    """
    params = named_tensors(model)
    tied = getattr(getattr(model, "arch", None), "tie_word_embeddings", False)
    unknown = [n for n in tensors if n not in params and not (tied and n == "lm_head.weight")]
    if unknown:
        raise WeightError(f"unknown tensor names: {', '.join(unknown[:5])}"
                          + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""))
    for name, t in tensors.items():
        if name in params and tuple(t.shape) != tuple(params[name].shape):
            raise WeightError(f"{name}: shape {list(t.shape)} does not match the model's "
                              f"{list(params[name].shape)}")
        # Copying integers or booleans into a float parameter would succeed and truncate the weights.
        target = params.get(name)  # None: a tied lm_head.weight, which is the (float) embedding
        if (target is None or target.is_floating_point()) and not t.is_floating_point():
            raise WeightError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not a floating-point "
                              "type; weights must be floating point (the served weights are kept)")
    if complete:
        missing = [n for n in params if n not in tensors]
        if missing:
            raise WeightError(f"missing tensors: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))


@torch.no_grad()
def check_finite(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> None:
    """Raise WeightError naming the tensors with a NaN, an infinity, or a value the model's dtype
    (``dtypes[name]``) cannot hold.

    A tensor whose finite values the model's dtype always holds (the same dtype or a wider one) is read
    once for its sum, which is finite unless an element is NaN or infinite, or the sum overflowed; only
    the tensors whose sum is not finite, and those cast to a narrower dtype, take the exact min/max pass.
    One device sync for the sums and one for the exact pass, when it runs."""
    quick, exact = [], []  # (name, tensor, the largest value the model's dtype holds)
    for name, t in tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        target = dtypes.get(name, t.dtype)
        limit = torch.finfo(target if target.is_floating_point else t.dtype).max
        (quick if limit >= torch.finfo(t.dtype).max else exact).append((name, t, limit))
    if quick:
        finite = torch.stack([t.sum().isfinite() for _, t, _ in quick]).tolist()
        exact += [q for q, ok in zip(quick, finite, strict=True) if not ok]
    if not exact:
        return
    flags = []
    for _, t, limit in exact:
        lo, hi = torch.aminmax(t)
        flags.append((lo >= -limit) & (hi <= limit))  # false for NaN too: every comparison with NaN is false
    bad = [name for (name, _, _), ok in zip(exact, torch.stack(flags).tolist(), strict=True) if not ok]
    if bad:
        raise WeightError(f"non-finite values (NaN, infinity, or beyond the model's dtype) in {', '.join(bad[:5])}"
                          + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "") + "; the served weights are kept")


@torch.no_grad()
def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], *, complete: bool,
                 replaced: list[torch.Tensor] | None = None) -> int:
    """Check everything first (names, shapes, finiteness), then copy (casting to the model's dtype);
    returns tensors loaded. With ``replaced`` the caller hands the tensors over (fresh, referenced by no
    one else): one of the parameter's dtype, device and layout becomes the parameter's storage, not
    copied, and the tensor it replaces is appended to ``replaced``."""
    check_weights(model, tensors, complete=complete)
    params = named_tensors(model)
    check_finite(tensors, {name: params[name].dtype for name in tensors if name in params})
    loaded = 0
    for name, t in tensors.items():
        param = params.get(name)
        if param is None:  # a tied lm_head.weight is the embedding, already loaded
            continue
        if replaced is not None and isinstance(param, nn.Parameter) and t.dtype == param.dtype \
                and t.device == param.device and t.is_contiguous():
            replaced.append(param.data)
            param.data = t
        else:
            param.copy_(t)
        loaded += 1
    return loaded


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes (contiguous, on CPU, in its own dtype)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def checksums(model: nn.Module, dtype: torch.dtype | None = None, kind: str = "sha256") -> dict[str, dict[str, object]]:
    """Per-tensor fingerprints, optionally after casting to ``dtype`` (to compare a bf16 folder): sha256, or
    the weight push's additive checksum (``kind`` ``wire.SLICE_SUM``, which the trainer verifies a push with)."""
    out: dict[str, dict[str, object]] = {}
    for name, t in model.state_dict().items():
        t = t if dtype is None else t.to(dtype)
        fingerprint = format_sum(slice_sum(t)) if kind == SLICE_SUM else tensor_checksum(t)
        out[name] = {kind: fingerprint, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    return out


def check_bucket_offsets(specs: list[tuple[str, torch.dtype, list[int]]]) -> list[int]:
    """Byte sizes of a flattened bucket's tensors; refuses an unaligned one before anything is received.

    Each tensor is a view into one uint8 buffer, packed without padding, so its byte offset must
    be a multiple of its element size (SGLang 0.5.23 refuses the same buckets the same way).
    """
    sizes, offset = [], 0
    for name, dtype, shape in specs:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise WeightError(f"{name}: byte offset {offset} in the flattened bucket is not a multiple of "
                              f"its element size ({itemsize} bytes, {str(dtype).removeprefix('torch.')})")
        sizes.append(torch.Size(shape).numel() * itemsize)
        offset += sizes[-1]
    return sizes


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its name (``bfloat16`` or ``torch.bfloat16``); ``WeightError`` for an unknown one."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightError(f"unknown dtype {name!r}")
    return dtype

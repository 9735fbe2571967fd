"""Training checkpoints: model, distributed optimizer, LR schedule, RNG and the trainer's own state.

One checkpoint is one ``megatron.core.dist_checkpointing`` directory ``<root>/step_<N>``:

- model and optimizer state as global sharded tensors (the optimizer in Megatron's
  ``fully_reshardable`` form), so a checkpoint saved at one TP/PP/DP layout resumes at
  another;
- the scheduler state and the user's ``extra`` dict (policy version, dataset position, replay
  buffer, ...) as common state written once by rank 0;
- every rank's RNG states (torch, Python, NumPy, Megatron's model-parallel tracker), restored only
  when the layout is unchanged, since a different layout has different ranks;
- ``megatron_areal.json`` and ``hf/`` as in a conversion checkpoint, so ``convert mcore-to-hf``
  turns any training checkpoint into an HF folder.

Saving is atomic: ranks write into ``<root>/.step_<N>.tmp`` and rank 0 renames it once all ranks
are done, then deletes all but the newest ``keep``. A crash mid-save leaves the previous
checkpoints untouched and the temporary directory is ignored (and removed by the next save); a
save that fails (a full disk: ``write_error.py``) removes it at once and says why.

Resuming takes the newest checkpoint whose files are whole (``verify.py``): one cut short by a
node that died mid-copy is skipped with a warning naming the file, and the previous one is used.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_areal.actor.lora import lora_settings
from megatron_areal.actor.parallel import ParallelGroups
from megatron_areal.checkpoint import dist_ckpt
from megatron_areal.checkpoint.verify import checkpoint_damage
from megatron_areal.checkpoint.write_error import CheckpointWriteError, describe_write_failure
from megatron_areal.model.arch import ModelArch
from megatron_areal.model.hf_io import HFReader
from megatron_areal.model.weights import unwrap
from megatron_areal.patches.checkpoint_writer import written_in_place
from megatron_areal.patches.optimizer_state_views import state_as_views
from megatron_areal.util.heap import release_freed_memory

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_OPTIMIZER_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (path / dist_ckpt.META).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest finished checkpoint under ``root`` (whole or not: see ``newest_intact_checkpoint``)."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def newest_intact_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under ``root`` whose files are whole; each newer damaged one is logged with why it is
    skipped. Raises ``CheckpointReadError`` when checkpoints exist but none is whole (starting over silently would
    discard the run)."""
    skipped = []
    for _, path in reversed(list_checkpoints(root)):
        damage = checkpoint_damage(path)
        if damage is None:
            return path
        log.warning("skipping checkpoint %s: %s; trying the previous one", path, damage)
        skipped.append(f"{path.name}: {damage}")
    if skipped:
        raise dist_ckpt.CheckpointReadError(f"{root}: no checkpoint is whole ({'; '.join(skipped)}); "
                                            "set checkpoint.resume=false to start over")
    return None


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_sharded(groups: ParallelGroups, state: Any) -> Any:
    from megatron.core.dist_checkpointing import ShardedObject

    return ShardedObject("rng_state", state, (groups.pp, groups.tp, groups.dp),
                         (groups.pp_rank, groups.tp_rank, groups.dp_rank), replica_id=0)


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped Adam its state tensors, so its sharded state dict can describe them.

    Megatron's distributed optimizer builds its save and load requests from its current state
    and, with torch's Adam (no Apex/TE), asserts that every parameter has a ``step``; a fresh
    optimizer has none. Zero moments at step 0 are exactly what Adam starts from; on load they
    are replaced by the loaded values.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                state = inner.state[p]
                if state:
                    continue
                if hasattr(inner, "initialize_state"):  # actor/precision_adam.py: its own dtypes and remainders
                    inner.initialize_state(p)
                else:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def _load_optimizer(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict`` for the fully reshardable format with torch's Adam.

    megatron-core 0.16.1 copies every key of a parameter's Adam state from the loaded tensors,
    but the loaded tensors never carry ``step`` (it travels in the param groups), so the copy
    fails with KeyError('step'). The common part is loaded first (it sets ``step``), then the
    per-parameter tensors with ``step`` set aside. Megatron also hands every parameter the same
    ``step`` tensor, which Adam then increments once per parameter; each gets its own copy.
    """
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    per_sub = [state] if len(subs) == 1 else [v for _, v in sorted(state.items())]
    for sub, sub_state in zip(subs, per_sub, strict=True):
        param_state = None
        if sub_state.get("param_state_sharding_type") == "fully_reshardable":
            param_state = sub_state.pop("param_state")
        sub.load_state_dict(sub_state)
        inner_state = sub.optimizer.state
        steps = {p: st.pop("step") for p, st in inner_state.items() if "step" in st}
        if param_state is not None:
            sub.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            inner_state[p]["step"] = step.clone() if isinstance(step, torch.Tensor) else step
    if len(subs) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


@contextmanager
def _fp32_masters(optimizer: Any) -> Iterator[None]:
    """While saving or loading, precision-aware optimizers (actor/precision_adam.py) hold their masters in fp32,
    the form a checkpoint stores, instead of as remainders beside them; after a load the remainders are taken
    against the weights as loaded."""
    if optimizer is not None:  # every save and load runs inside: the one place a never-stepped optimizer
        _ensure_optimizer_state(optimizer)  # (a run resuming) gets the state its requests and masters need
    with ExitStack() as stack:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]) if optimizer is not None else []:
            if hasattr(getattr(sub, "optimizer", None), "fp32_masters"):
                stack.enter_context(sub.optimizer.fp32_masters())
        yield


@contextmanager
def _grad_buffers_released(model: list[torch.nn.Module]) -> Iterator[None]:
    """Free the DDP gradient buffers while saving (Megatron's ``offload_grad_buffers``): a saved step's
    gradients are spent, and the save itself needs memory (copies of the weights and optimizer state
    it writes). They come back zeroed, as the next step starts them."""
    chunks = [c for c in model if hasattr(c, "offload_grad_buffers")]
    for c in chunks:
        c.offload_grad_buffers(synchronize=False, empty_cache=False)
    try:
        yield
    finally:
        for c in chunks:
            c.restore_grad_buffers(synchronize=False)


def _check_same_adapters(path: Path, live: dict[str, Any] | None) -> None:
    """Refuse to resume a run whose ``model.lora`` differs from the checkpoint's (other adapter tensors, or none)."""
    saved = dist_ckpt.read_meta(path).get("lora")
    shape = lambda s: None if not s else (s["rank"], s["alpha"], sorted(s["targets"]))  # noqa: E731
    if shape(saved) != shape(live):
        raise dist_ckpt.CheckpointMismatchError(
            f"{path / dist_ckpt.META}: saved with model.lora {saved or 'off'}, this run has {live or 'off'}; "
            "resume with the same rank, alpha and targets (or start a new run directory)")


class Checkpointer:
    """Save and resume the training state of one run under ``root`` (collective calls)."""

    def __init__(self, root: str | Path, arch: ModelArch, groups: ParallelGroups, *, keep: int = 2,
                 hf_dir: str | Path | None = None, hf_dtype: torch.dtype | None = None) -> None:
        """``hf_dir``: the model's HF folder; its config and tokenizer travel with every checkpoint and
        its weight dtype (unless ``hf_dtype`` is given) becomes the dtype ``mcore-to-hf`` writes."""
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        self.root, self.arch, self.groups, self.keep = Path(root), arch, groups, keep
        self.hf_dir = Path(hf_dir) if hf_dir else None
        if hf_dtype is None:
            hf_dtype = HFReader(self.hf_dir, arch).dtype() if self.hf_dir else torch.float32
        self.hf_dtype = hf_dtype

    def _state(self, model: list[torch.nn.Module], optimizer: Any, scheduler: Any, is_loading: bool,
               with_rng: bool) -> dict[str, Any]:
        chunks = [unwrap(c) for c in model]
        model_sd = dist_ckpt.model_sharded_state_dict(chunks)
        state: dict[str, Any] = {"model": model_sd}
        if optimizer is not None:  # its state exists: ``_fp32_masters`` made it
            with state_as_views(optimizer):
                state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                  metadata=_OPTIMIZER_META)
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        if with_rng:
            state["rng"] = _rng_sharded(self.groups, _rng_state())
        return state

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def save(self, step: int, model: list[torch.nn.Module], optimizer: Any, scheduler: Any,
             extra: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` on all ranks; returns its final path.

        ``extra`` is the trainer's own state (policy version, dataset position, replay buffer):
        plain Python data and tensors, pickled once by rank 0, so it must be equal on all ranks.
        A failed write raises ``CheckpointWriteError`` saying why (no space left on device, and where).
        """
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        if dist.get_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._barrier()
        try:
            self._write(step, tmp, model, optimizer, scheduler, extra)
        except CheckpointWriteError:
            if dist.get_rank() == 0:  # all ranks failed together (the writer's results are gathered): free the disk
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._barrier()
        if dist.get_rank() == 0:
            g = self.groups
            dist_ckpt.write_meta(tmp, self.arch, self.hf_dir, self.hf_dtype, g.tp, g.pp, g.dp, ep=g.ep, etp=g.etp,
                                 lora=lora_settings(model))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self._barrier()
        log.info("saved checkpoint %s", final)
        return final

    def _write(self, step: int, tmp: Path, model: list[torch.nn.Module], optimizer: Any, scheduler: Any,
               extra: dict[str, Any] | None) -> None:
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint.api import CheckpointException

        with _grad_buffers_released(model):
            with _fp32_masters(optimizer), written_in_place():
                state = self._state(model, optimizer, scheduler, is_loading=False, with_rng=True)
                state["extra"] = extra or {}
                state["step"] = step
                try:
                    dist_checkpointing.save(state, str(tmp), content_metadata=dict(_OPTIMIZER_META))
                except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
                    raise CheckpointWriteError(describe_write_failure(e, tmp, self.latest_size())) from e
                finally:
                    del state
            # the fp32 masters are remainders again (``del state``: it referenced them too): their memory goes
            # back before the gradient buffers return, or the allocator keeps it beside them (+0.5 GiB for SmolLM2-135M)
            release_freed_memory()

    def latest_size(self) -> int | None:
        """Bytes of the newest checkpoint: about what the next save writes."""
        latest = self.latest_finished()
        return sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) if latest else None

    def _same_layout(self, path: Path) -> bool:
        meta = dist_ckpt.read_meta(path)
        saved = (meta.get("saved_tp"), meta.get("saved_pp"), meta.get("saved_dp"))
        return saved == (self.groups.tp, self.groups.pp, self.groups.dp)

    def _prune(self) -> None:
        for _, path in list_checkpoints(self.root)[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def latest_finished(self) -> Path | None:
        return latest_checkpoint(self.root)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the newest whose files are whole (rank 0 decides for all ranks, so they
        load the same one)."""
        choice: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                choice[0] = newest_intact_checkpoint(self.root)
            except dist_ckpt.CheckpointReadError as e:  # every rank raises it, none waits for the others
                choice[0] = e
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], Exception):
            raise choice[0]
        return choice[0]

    def load(self, path: str | Path, model: list[torch.nn.Module], optimizer: Any = None, scheduler: Any = None
             ) -> tuple[int, dict[str, Any]]:
        """Restore everything given from ``path``; returns (step, extra)."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        dist_ckpt.check_same_model(path, self.arch)
        _check_same_adapters(path, lora_settings(model))
        same_layout = self._same_layout(path)
        if not same_layout:
            log.info("%s was saved at another layout; RNG states are not restored", path)
        with _fp32_masters(optimizer):
            request = self._state(model, optimizer, scheduler, is_loading=True, with_rng=same_layout)
            request.pop("scheduler", None)  # common state: comes back whole
            loaded = dist_checkpointing.load(request, str(path))
            dist_ckpt.load_model_state([unwrap(c) for c in model], loaded["model"])
            if optimizer is not None:
                _load_optimizer(optimizer, loaded["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(loaded["scheduler"])
        if same_layout:
            _set_rng_state(loaded["rng"])
        log.info("resumed from %s (step %d)", path, loaded["step"])
        return int(loaded["step"]), loaded.get("extra", {})

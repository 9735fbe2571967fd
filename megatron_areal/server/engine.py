"""The inference engine: a model runner thread stepping the scheduler, plus control operations.

Only this module touches the model and the device. HTTP handlers submit requests through a
thread-safe inbox (so the event loop never waits for a model step) and run control operations
(pause, abort, weight updates) in worker threads that take the engine lock between steps.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection

import torch

from megatron_areal.model.arch import ModelArch, load_arch
from megatron_areal.server.attention import ForwardBatch
from megatron_areal.server.config import EngineOptions
from megatron_areal.server.kv_cache import KVCache
from megatron_areal.server.model import CausalLM, rope_inv_freq
from megatron_areal.server.one_thread import one_thread
from megatron_areal.server.routes import RouteLog
from megatron_areal.server.sampler import SamplingParams, sample
from megatron_areal.server.scheduler import Request, Scheduler
from megatron_areal.server.step_lock import StepLock
from megatron_areal.server.weights import (
    WeightError,
    check_bucket_offsets,
    checksums,
    disk_bytes_bound,
    load_weights,
    named_tensors,
    parse_dtype,
    read_safetensors,
)
from megatron_areal.util.compute_dtype import runnable_dtype
from megatron_areal.weights.shard_receive import Spares, WireError, check_manifest, receive_slices
from megatron_areal.weights.wire import AdapterMerge, WeightUpdateGroup, adapter_target

log = logging.getLogger(__name__)
# While the model cannot step, an idle runner probes it this often, so /health recovers (after a
# weight update, say) without waiting for a request.
REPROBE_S = 2.0


class QueueFull(RuntimeError):
    """More requests than ``max_queue`` would wait (the API answers 503)."""

    pass


class Engine:
    """The embedded server's inference engine: one model, a KV cache of ``max_running`` slots, and
    one runner thread that steps the scheduler (prefill new requests, decode running ones).

    The HTTP layer (``api.Api``) submits requests and gets each answer through a callback on the
    runner thread; weight groups and updates run on their own thread (``weight_queue``), one at a
    time in arrival order, as SGLang does.
    """

    def __init__(self, model_path: str, opts: EngineOptions,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.model_path, self.opts = str(model_path), opts
        self.arch: ModelArch = load_arch(model_path)
        self.device = torch.device(opts.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = runnable_dtype(parse_dtype(opts.dtype), self.device, "dtype") if opts.dtype else (
            torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.max_len = opts.context_length_for(self.arch.max_position_embeddings)
        self.threads = torch.get_num_threads()  # the runner's (CPU), whatever one_thread leaves behind meanwhile
        with one_thread():  # this thread keeps no OpenMP team beside the runner's (see one_thread)
            self.model = CausalLM(self.arch).to(dtype=self.dtype)
            self.model.inv_freq = rope_inv_freq(self.arch)  # rotary frequencies stay fp32 under bf16 weights
            load_weights(self.model, read_safetensors(model_path), complete=True)
            self.model.to(self.device).eval()
            self.cache = KVCache(self.arch, opts.max_running, self.max_len, self.dtype, self.device)
        self.scheduler = Scheduler(max_running=opts.max_running, max_len=self.max_len,
                                   eos_ids=self.arch.eos_token_ids,
                                   max_prefill_tokens=opts.max_prefill_tokens, decode=decode)
        self.weight_version = opts.weight_version
        self.paused = False
        self.groups: dict[str, WeightUpdateGroup] = {}
        self._update_session = False  # between /begin_weight_update and /end_weight_update
        # a model.lora run pushes adapters only: merged here into a kept copy of the base (weights/wire.py)
        self.adapters = AdapterMerge(lambda name: named_tensors(self.model)[name].detach())
        # a shard push receives into the weights the one before replaced (weights/shard_receive.py): a second
        # copy of the weights held between pushes, and up to half as much again in receive buffers
        weight_bytes = sum(t.nbytes for t in named_tensors(self.model).values())
        self.spares = Spares(limit_bytes=weight_bytes + weight_bytes // 2)
        self._seeds = random.Random(opts.seed)
        self._lock = StepLock()  # held by a model step and by control operations (which go first)
        self._work = threading.Event()  # set when the runner may have something to do
        self._inbox: list[Request] = []
        self._inbox_lock = threading.Lock()
        self._queued = 0  # inbox + waiting, checked against max_queue without the engine lock
        self._stopping = False
        self._broken: str | None = None  # why the model cannot step, found after a failed step
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._loop_failures = 0  # consecutive steps that failed outside any one request
        self._thread = threading.Thread(target=self._loop, name="model-runner", daemon=True)
        log.info("engine: %s (%s, %d layers) on %s/%s, %d slots x %d tokens, KV %.1f MiB",
                 model_path, self.arch.model_type, self.arch.num_layers, self.device, self.dtype,
                 opts.max_running, self.max_len, self.cache.bytes / 2**20)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the model-runner thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the runner and answer every request still here ("server shutting down").

        The flag is set without the engine lock, so a runner that keeps retaking the lock (or is
        stuck in a step) cannot hold shutdown up; requests are answered once the lock is ours, so
        none is finished twice.
        """
        self._stopping = True
        self._work.set()
        if self._thread.ident is not None:  # an engine built but never started stops too
            self._thread.join(timeout=timeout_s)
        if not self._lock.acquire(timeout=timeout_s):
            log.error("the model runner is still inside a step after %.0fs: stopping without it", timeout_s)
            return
        try:
            self._finish_all(self.scheduler.take(lambda r: True) + self._drain_inbox(), "server shutting down")
        finally:
            self._lock.release()

    @property
    def alive(self) -> bool:
        """Whether the model-runner thread is running."""
        return self._thread.is_alive()

    def health(self) -> tuple[bool, str]:
        """(True, "ok") while the runner can step; else (False, why), for /health.

        A thread that is alive is not enough: it may be stuck in a step, or the model may fail
        every step (found by a one-token probe after a failed step, see ``_step``).
        """
        if not self._thread.is_alive():
            return False, "the model runner is not running"
        if self._stopping:
            return False, "shutting down"
        if self._broken is not None:
            return False, self._broken
        started = self._step_started
        if started is not None and time.monotonic() - started > self.opts.step_stall_s:
            return False, f"a model step has run for {time.monotonic() - started:.0f}s"
        return True, "ok"

    # ---- requests ------------------------------------------------------------------------
    def submit(self, prompts: list[tuple[str, list[int], SamplingParams]],
               on_finish: Callable[[Request], None], *, record_routes: bool = False) -> list[Request]:
        """Queue requests (all or none); raises QueueFull past ``max_queue`` or when stopping.

        ``record_routes``: keep the experts each position is routed to (``Request.routes``); a
        dense model has none to keep.
        """
        if any(not ids for _, ids, _ in prompts):
            raise ValueError("a prompt has no tokens: there is nothing to continue")
        with self._inbox_lock:
            if self._stopping:
                raise QueueFull("server shutting down")
            if self._queued + len(prompts) > self.opts.max_queue:
                raise QueueFull(f"queue full ({self._queued} waiting, limit {self.opts.max_queue})")
            reqs = []
            for rid, ids, params in prompts:
                seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
                gen = torch.Generator().manual_seed(seed)
                reqs.append(Request(rid=rid, prompt_ids=ids, params=params, generator=gen, on_finish=on_finish,
                                    routes=self._route_log() if record_routes else None))
            runnable = [r for r in reqs if r.params.max_new_tokens > 0]
            self._inbox.extend(runnable)
            self._queued += len(runnable)
        for r in reqs:
            if r.params.max_new_tokens == 0:  # nothing to generate: done without touching the model
                r.finish_reason = {"type": "length", "length": 0}
                on_finish(r)
        self._work.set()  # never takes the engine lock: the event loop must not wait for a step
        return reqs

    def _route_log(self) -> RouteLog | None:
        return RouteLog(self.arch.num_layers, self.arch.num_experts_per_tok) if self.arch.is_moe else None

    def has_room(self, count: int) -> bool:
        """Whether ``count`` more requests fit the queue now (``submit`` checks again, atomically)."""
        return not self._stopping and self._queued + count <= self.opts.max_queue

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), self._queued

    def _drain_inbox(self) -> list[Request]:
        with self._inbox_lock:
            reqs, self._inbox = self._inbox, []
        return reqs

    # ---- the model runner loop -----------------------------------------------------------
    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # kernels and allocations of this thread
        torch.set_num_threads(self.threads)  # this thread's own team, not the process-wide count of the moment
        while not self._stopping:
            self._work.wait(timeout=REPROBE_S if self._broken else None)
            with self._lock.for_step():
                if self._stopping:
                    return
                self.scheduler.waiting.extend(self._drain_inbox())
                if self.paused or not self.scheduler.has_work():
                    if self._broken is not None and not self.scheduler.running:
                        self._broken = self._probe()  # idle: find out whether the model runs again
                    self._work.clear()
                    if self._inbox:  # submitted between the drain and the clear: don't sleep on it
                        self._work.set()
                    continue
                self._guarded_step()

    def _guarded_step(self) -> None:
        """Run one step. Failures of single requests are handled inside it; anything else fails the
        requests the step held (never the queue), so the runner goes on and no slot leaks."""
        self._step_started = time.monotonic()
        try:
            self._step()
            self._loop_failures = 0
        except Exception as e:
            log.exception("model step failed")
            self._loop_failures += 1
            self._fail_all(self.scheduler.take_running(), e)
            if self._loop_failures >= 3:  # it is not one step's requests: the queue cannot run either
                self._broken = f"the model runner fails every step: {e}"
                self._fail_all(self.scheduler.take(lambda r: True), e)
            self._set_queued(len(self.scheduler.waiting))
        finally:
            self._step_started = None

    def _step(self) -> None:
        plan = self.scheduler.plan(self.cache.free_slots)
        if not plan.prefill and not plan.decode:
            self._reclaim_slots()
            return
        for r in plan.prefill:
            r.slot = self.cache.allocate()
        # From here every request of the step is in ``running``: whatever fails, the recovery finds
        # each of them, frees its slot and answers it.
        self.scheduler.running.extend(plan.prefill)
        self._set_queued(len(self.scheduler.waiting))  # admitted: running now, no longer in the queue
        for donor, r, n in plan.shares:
            self.cache.copy_prefix(donor.slot, r.slot, n)
            r.cached = n
            if r.routes is not None and donor.routes is not None and donor.routes.length >= n:
                r.routes.copy_prefix(donor.routes, n)
            elif r.routes is not None:  # the donor kept no routes: compute the prompt again
                r.cached = 0
        touched = plan.decode + plan.prefill  # one forward: decodes and prefills packed together
        failed = self._run(touched)
        finished = [r for r in touched if r.finish_reason is not None]
        self.scheduler.running = [r for r in self.scheduler.running if r.finish_reason is None]
        for r in finished:
            self._release(r)
        # Everything failed: a bad request, or a model that cannot run at all? Known before anyone
        # is answered, so that /health already tells.
        self._broken = self._probe() if len(failed) == len(touched) else None
        for r in finished:
            self._answer(r)

    def _run(self, reqs: list[Request]) -> list[Request]:
        """Forward and sample ``reqs`` together; if that fails, each alone, so that one bad request
        fails by itself. Returns the requests that failed (each finished with an error)."""
        if not reqs:
            return []
        try:
            self._forward_and_sample(reqs)
            return [r for r in reqs if _failed(r)]
        except Exception as e:
            error = e
        if len(reqs) == 1:
            log.error("request %s failed: %s", reqs[0].rid, error, exc_info=error)
            self._fail(reqs[0], error)
            return reqs
        log.warning("a step of %d requests failed (%s): running each alone", len(reqs), error)
        return [r for one in reqs for r in self._run([one])]

    def _forward_and_sample(self, reqs: list[Request]) -> None:
        """One forward over ``reqs``, each feeding the tokens its slot has no KV for yet; on
        failure nothing of theirs has changed (random streams included), so they can run again."""
        rows = [r.all_ids[r.cached:] for r in reqs]
        states = [r.generator.get_state() for r in reqs]
        try:
            tokens = torch.tensor([[t for row in rows for t in row]], dtype=torch.long, device=self.device)
            batch = ForwardBatch([r.slot for r in reqs], [r.cached for r in reqs], [len(row) for row in rows],
                                 self.device)
            routes = [] if any(r.routes is not None for r in reqs) else None
            logits = (self.model(tokens, batch, self.cache) if routes is None
                      else self.model(tokens, batch, self.cache, routes))
            ids, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
            ids, logprobs = ids.tolist(), logprobs.tolist()
            if routes:
                _record_routes(reqs, rows, torch.stack(routes, dim=1).to(device="cpu", dtype=torch.int32))
        except Exception:
            for r, state in zip(reqs, states, strict=True):
                r.generator.set_state(state)
            raise
        for r, tok, lp in zip(reqs, ids, logprobs, strict=True):
            r.cached = len(r.all_ids)
            try:
                self.scheduler.append_token(r, tok, lp, self.weight_version)
            except Exception as e:  # e.g. a stop-string decode: this request only
                log.error("request %s failed: %s", r.rid, e, exc_info=e)
                self._fail(r, e)

    def _probe(self) -> str | None:
        """Run one token through the model on a free slot: None if it runs, else why not."""
        if not self.cache.free_slots:
            return None
        slot = self.cache.allocate()
        try:
            batch = ForwardBatch([slot], [0], [1], self.device)
            logits = self.model(torch.zeros((1, 1), dtype=torch.long, device=self.device), batch, self.cache)
            return None if bool(torch.isfinite(logits).all()) else "the model gives non-finite logits"
        except Exception as e:
            return f"the model cannot run a one-token step: {e}"
        finally:
            self.cache.release(slot)

    def _reclaim_slots(self) -> None:
        """Nothing runs, yet no slot is free: slots were lost. No request holds one, so all are free."""
        log.error("no KV slot is free although no request runs: reclaiming all %d", self.cache.num_slots)
        self.cache.reset()

    def _release(self, r: Request) -> None:
        if r.slot is not None:
            self.cache.release(r.slot)
            r.slot = None
        r.cached = 0

    def _fail(self, r: Request, error: Exception) -> None:
        r.finish_reason = {"type": "abort", "message": f"internal error: {error}", "status_code": 500,
                           "err_type": "InternalServerError"}

    def _fail_all(self, reqs: list[Request], error: Exception) -> None:
        for r in reqs:
            self._fail(r, error)
            self._release(r)
            self._answer(r)

    def _finish_all(self, reqs: list[Request], message: str, status: int = 200) -> None:
        for r in reqs:
            self._release(r)
            r.finish_reason = {"type": "abort", "message": message, "status_code": status, "err_type": None}
            self._answer(r)

    @staticmethod
    def _answer(r: Request) -> None:
        """Hand the finished request to its waiter; a failing callback must not stop the runner."""
        try:
            r.on_finish(r)
        except Exception:
            log.exception("answering request %s failed", r.rid)

    # ---- control (called from worker threads) -------------------------------------------
    def pause(self, mode: str) -> None:
        """Stop stepping. ``abort``: running and waiting requests finish now with what they have;
        ``retract``: running ones go back to waiting, to continue under the next weights; ``in_place``:
        they keep their slots."""
        with self._lock:
            self.paused = True
            self.scheduler.waiting.extend(self._drain_inbox())
            if mode == "abort":
                taken = self.scheduler.take(lambda r: True)
                self._set_queued(0)
                self._finish_all(taken, "paused for a weight update")
            elif mode == "retract":
                self._retract()

    def resume(self) -> None:
        """Step again."""
        with self._lock:
            self.paused = False
        self._work.set()

    def abort(self, rid: str | Collection[str] | None) -> int:
        """Abort the requests with exactly these ids (None: all); returns how many.

        As in SGLang 0.5.23, whose tokenizer drops an abort whose exact id is not in flight, "job"
        reaches neither "job_7" nor the children "job_0", "job_1" of a batch or n > 1 request.
        """
        wanted = None if rid is None else {rid} if isinstance(rid, str) else set(rid)
        with self._lock:
            self.scheduler.waiting.extend(self._drain_inbox())
            taken = self.scheduler.take(lambda r: wanted is None or r.rid in wanted)
            self._set_queued(len(self.scheduler.waiting))
            self._finish_all(taken, "aborted by request")
            return len(taken)

    def flush_cache(self) -> bool:
        """Allowed only when idle (queued requests don't count while paused), as in SGLang.

        Prompt KV is shared only among running requests (copied into each one's slot), so there is
        nothing to free beyond the slots, which belong to running requests.
        """
        with self._lock:
            return not self.scheduler.running and (self.paused or not (self.scheduler.waiting or self._inbox))

    def _retract(self) -> None:
        for r in self.scheduler.retract_all():
            self._release(r)
        self._set_queued(len(self.scheduler.waiting))  # _set_queued adds the inbox itself

    def _set_queued(self, n: int) -> None:
        with self._inbox_lock:
            self._queued = n + len(self._inbox)

    # ---- weights -------------------------------------------------------------------------
    def update_from_disk(self, model_path: str, version: str | None) -> None:
        """Install the whole model from a safetensors folder as ``version``."""
        with one_thread():
            tensors = read_safetensors(model_path, timeout_s=self.opts.weight_load_timeout_s,
                                       max_bytes=disk_bytes_bound(self.model))
        self._install(tensors, version, complete=True)
        self.model_path = str(model_path)

    def checksums(self, dtype: torch.dtype | None, kind: str = "sha256") -> dict[str, dict[str, object]]:
        """Per-tensor checksums of the weights (in ``dtype`` if given, of ``kind``), to compare with the trainer's."""
        with self._lock, one_thread():
            return checksums(self.model, dtype, kind)

    # Weight-group methods run on the API's one weight thread, in arrival order (as SGLang's
    # scheduler runs them), so the session flag and ``groups`` need no lock of their own.
    def begin_weight_update(self) -> None:
        """Open the one weight-update session (SGLang refuses a second)."""
        if self._update_session:
            raise WeightError("a weight-update session is already open; call /end_weight_update first")
        self._update_session = True

    def end_weight_update(self) -> None:
        """Close the weight-update session."""
        if not self._update_session:
            raise WeightError("no weight-update session is open; call /begin_weight_update first")
        self._update_session = False

    def require_update_session(self, endpoint: str) -> None:
        """SGLang 0.5.23 refuses distributed and tensor updates outside begin/end, before any collective."""
        if not self._update_session:
            raise WeightError(f"{endpoint} must run between /begin_weight_update and /end_weight_update")

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float | None = None) -> None:
        """Join as rank ``rank_offset`` (this server has one TP rank); the trainer is rank 0 and hosts the store."""
        if group_name in self.groups:
            raise WeightError(f"weight update group {group_name!r} already exists")
        _check_membership(master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                          group_name=group_name, backend=backend, device=self.device)
        timeout_s = self.opts.weight_group_timeout_s if timeout_s is None else timeout_s
        try:
            self.groups[group_name] = WeightUpdateGroup(
                master_address=master_address, master_port=master_port, rank=rank_offset,
                world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s,
                device=self.device if backend == "nccl" else None)
        except (RuntimeError, ValueError) as e:  # timeouts and refused connections included
            raise WeightError(f"could not join weight update group {group_name!r} at "
                              f"{master_address}:{master_port}: {e}") from None

    def destroy_group(self, group_name: str) -> None:
        """Leave and forget the weight-update group ``group_name``."""
        group = self.groups.pop(group_name, None)
        if group is None:
            raise WeightError(f"no weight update group {group_name!r}")
        group.destroy()

    def update_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str, version: str | None, flattened: bool,
                                lora_scale: float | None = None) -> None:
        """Receive one bucket broadcast from group rank 0, then install it.

        Names and shapes that do not fit the model are received and then refused, so the
        trainer's collective completes; nothing is copied into the model before the check. What
        cannot describe a receive (no open session, bad dtype, negative or unaligned sizes) is
        refused before joining the broadcast, as SGLang does.
        """
        self.require_update_session("update_weights_from_distributed")
        group = self.groups.get(group_name)
        if group is None:
            raise WeightError(f"no weight update group {group_name!r}; call /init_weights_update_group")
        specs = _parse_specs(names, dtypes, shapes)
        sizes = check_bucket_offsets(specs) if flattened else None
        with one_thread():
            tensors = _receive(group, specs, sizes)
        self._install(tensors, version, complete=False, lora_scale=lora_scale)

    def update_from_shards(self, *, manifest: object, senders: int, group_name: str, version: str | None,
                           timeout_s: float | None = None) -> int:
        """Receive the slices the manifest lists from the trainer ranks that hold them (``weights/shard_receive.py``),
        installing tensors as they complete; returns the tensors installed. A manifest that cannot
        describe a receive is refused before any is posted; a sender that fails is named."""
        self.require_update_session("update_weights_from_shards")
        limit = 8 * sum(t.numel() for t in named_tensors(self.model).values())  # fp32, twice over
        try:
            rounds = check_manifest(manifest, senders=senders, max_bytes=limit)
        except ValueError as e:
            raise WeightError(str(e)) from None
        group = self.groups.get(group_name)
        if group is None:
            raise WeightError(f"no weight update group {group_name!r}; call /init_weights_update_group")
        if not 1 <= senders < group.world_size:
            raise WeightError(f"senders: {senders} does not fit a group of {group.world_size} with this server in it")
        timeout_s = self.opts.weight_group_timeout_s if timeout_s is None else timeout_s
        replaced: list[torch.Tensor] = []
        with one_thread():
            try:
                count = receive_slices(group.pg, rounds, timeout_s=timeout_s, device=group.device,
                                       spares=self.spares,
                                       on_complete=lambda tensors: self._install(
                                           tensors, None, complete=False, announce=False, replaced=replaced))
            except WireError as e:
                raise WeightError(str(e)) from None
            finally:
                for t in replaced:  # the next push receives into them
                    self.spares.give(t)
        if version is not None:
            with self._lock:
                self.weight_version = str(version)
        log.info("weights updated (%d tensors), version %s", count, self.weight_version)
        return count

    def _install(self, tensors: dict[str, torch.Tensor], version: str | None, complete: bool,
                 announce: bool = True, lora_scale: float | None = None,
                 replaced: list[torch.Tensor] | None = None) -> None:
        """Check and install ``tensors``. With ``replaced`` the tensors are handed over (received for this
        install, no one else's): those that fit become the parameters' storage, and the tensors they
        replace are appended to ``replaced``."""
        with self._lock, one_thread():
            params = named_tensors(self.model)
            # whole weights replace whatever base an adapter was merged into
            self.adapters.forget([n for n in tensors if adapter_target(n) is None])
            try:
                tensors = self.adapters.merged(tensors, lora_scale, lambda n: params[n].shape if n in params else None)
            except ValueError as e:
                raise WeightError(str(e)) from None
            load_weights(self.model, tensors, complete=complete, replaced=replaced)
            if version is not None:
                self.weight_version = str(version)
            # The KV of running requests was computed with the old weights: drop it; they are
            # prefilled again from prompt + tokens so far, under the new weights.
            self._retract()
            paused = self.paused
        if not paused:  # paused: ``resume`` wakes the runner; waking it for every install only contends for the lock
            self._work.set()
        if announce:  # a shard push announces once, with its version, when every round is in
            log.info("weights updated (%d tensors), version %s", len(tensors), self.weight_version)


def _check_membership(*, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
                      device: torch.device, tp: int = 1) -> None:
    """Refuse a group this server cannot be a proper member of, before anything listens or connects.

    The trainer is rank 0 (it hosts the store and sends): a server at rank 0, or alone in its
    group, would host the store itself and "receive" its own uninitialised buffers.
    """
    if not 1 <= master_port <= 65535:
        raise WeightError(f"master_port: {master_port} is not a TCP port")
    if not group_name:
        raise WeightError("group_name: must not be empty")
    if world_size < 2:
        raise WeightError(f"world_size: {world_size} leaves no room for the trainer (rank 0) and this server")
    if rank_offset < 1:
        raise WeightError(f"rank_offset: {rank_offset} collides with the trainer's rank 0; servers start at 1")
    if rank_offset + tp > world_size:
        raise WeightError(f"rank_offset: ranks {rank_offset}..{rank_offset + tp - 1} are outside a group of "
                          f"world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise WeightError(f"backend: {backend!r} is not gloo or nccl")
    if backend == "nccl" and device.type != "cuda":
        raise WeightError(f"backend: nccl needs a CUDA server; this one runs on {device.type} (use gloo)")


def _parse_specs(names: list[str], dtypes: list[str],
                 shapes: list[list[int]]) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) per tensor; bad metadata is refused before any collective is joined."""
    try:
        specs = [(n, parse_dtype(d), [int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    except (TypeError, ValueError) as e:
        raise WeightError(f"bad tensor metadata: {e}") from None
    for name, _, shape in specs:
        if any(x < 0 for x in shape):
            raise WeightError(f"{name}: negative dimension in shape {shape}")
    return specs


def _record_routes(reqs: list[Request], rows: list[list[int]], routes_NLK: torch.Tensor) -> None:
    """Give each request the routes of the tokens it fed (packed in ``reqs`` order), at their positions."""
    first = 0
    for r, row in zip(reqs, rows, strict=True):
        if r.routes is not None:
            r.routes.write(r.cached, routes_NLK[first:first + len(row)])
        first += len(row)


def _failed(r: Request) -> bool:
    return r.finish_reason is not None and r.finish_reason.get("status_code") == 500


def _receive(group: WeightUpdateGroup, specs: list[tuple[str, torch.dtype, list[int]]],
             sizes: list[int] | None) -> dict[str, torch.Tensor]:
    """One broadcast per tensor, or one for the whole flattened bucket when ``sizes`` are given."""
    if sizes is None:
        out = {}
        for name, dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=group.device)
            group.broadcast(t, src=0)
            out[name] = t
        return out
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
    group.broadcast(buf, src=0)
    out, offset = {}, 0
    for (name, dtype, shape), size in zip(specs, sizes, strict=True):
        out[name] = buf[offset:offset + size].view(dtype).view(shape)
        offset += size
    return out


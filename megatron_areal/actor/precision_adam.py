"""Adam with low-precision state, as the inner optimizer of Megatron's precision-aware distributed optimizer.

With ``use_precision_aware_optimizer`` megatron-core's distributed optimizer keeps no fp32 copies of its
own: it hands the inner Adam the bf16 weight shards (views of the model's weights) and their gradients
in ``.decoupled_grad`` (views of the DDP gradient buffer, fp32 or bf16), and the inner Adam owns the
master weights and the moments, in the dtypes it is given (``exp_avg_dtype``, ``exp_avg_sq_dtype``), and
writes the updated weights back itself. On GPUs Transformer Engine's FusedAdam fills that role; this
class is the same contract (``initialize_state``, ``get_unscaled_state``, ``set_scaled_state``) in plain
torch, so it runs on CPUs too.

Master weights as remainders (FusedAdam's ``store_param_remainders``): an fp32 master differs from its
bf16 weight only in the low 16 bits of its bit pattern, so it is stored as the bf16 weight plus a 16-bit
signed remainder: 2 bytes a parameter instead of 4. With ``rounding="nearest"`` the weight is the
master rounded to nearest; with ``rounding="stochastic"`` it rounds up with probability equal to the
dropped fraction, so its expected value is the master (megatron_areal/patches/bf16_rounding.py says why small steps
need that). The distance from a stochastically rounded weight to its master takes 17 bits, so in
either mode the stored master keeps 22 of fp32's 23 mantissa bits (its last bit rounded to nearest):
a relative spacing of 2^-22, thousands of times finer than a step of Adam at lr 1e-5. bf16 moments are
rounded as the weights are. Stochastic rounding's noise is 16 uniform bits a rounded value, four to one
64-bit draw of torch's generator.

Each update is done in fp32 by torch's fused Adam kernel, a chunk of elements at a time, so the only
temporaries are a few chunks. With fp32 weights, gradients and moments it is torch's ``AdamW(fused=True)``
(or ``Adam``) bit for bit; with bf16 weights and fp32 moments its master follows torch's fp32 ``AdamW`` to
within that last bit.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

Rounding = Literal["nearest", "stochastic"]
_CHUNK = 1 << 16  # elements updated at a time: a chunk's temporaries stay in a CPU core's L2 cache
_HIGH = -0x10000  # 0xFFFF0000 as int32


def join_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master whose bit pattern is the bf16 ``weight``'s followed by zeros, plus 2 x ``remainder``
    (int16) in the low bits."""
    bits = weight.view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
    return bits.add_(remainder.to(torch.int32), alpha=2).view(torch.float32)


def _nearest_even(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns ``bits`` (int32) rounded to an even pattern, to nearest, ties to a multiple of 4."""
    return (bits + bits.bitwise_right_shift(1).bitwise_and_(1)).bitwise_and_(-2)


def _round_high_(bits: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """fp32 bit patterns (int32, overwritten) rounded to their high 16 bits: to nearest (ties up in magnitude)
    or, given ``noise`` (uniform int16), stochastically: up with probability equal to the dropped fraction
    (``noise + 2^15`` is uniform in [0, 2^16))."""
    if noise is not None:
        bits.add_(noise)
    return bits.add_(0x8000).bitwise_and_(_HIGH)


def split_master_(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor,
                  noise: torch.Tensor | None = None) -> None:
    """Write fp32 ``master`` into the bf16 ``weight`` and the int16 ``remainder`` from which ``join_master``
    gives it back, but for its last mantissa bit: the master is first rounded to an even bit pattern, to
    nearest (ties to a multiple of 4). The weight is that rounded to nearest or, given ``noise`` (uniform
    int16), stochastically (``_round_high_``)."""
    even = _nearest_even(master.view(torch.int32))
    high = _round_high_(even.clone(), noise)
    remainder.copy_(even.sub_(high).bitwise_right_shift_(1))  # even - high is even and within (-2^16, 2^16)
    weight.copy_(high.view(torch.float32))  # exact: the low half is zero


def keep_weight_set_master_(weight: torch.Tensor, remainder: torch.Tensor, master: torch.Tensor) -> None:
    """Set ``remainder`` so that ``join_master(weight, remainder)`` is fp32 ``master`` (to its last bit), keeping
    the bf16 ``weight`` where it is one of the master's two bf16 neighbours (as any weight rounded from it is);
    elsewhere the weight becomes the master rounded to nearest. A chunk at a time."""
    for w, r, m in zip(*(t.view(-1).split(_CHUNK) for t in (weight, remainder, master)), strict=True):
        bits = m.view(torch.int32)
        even = _nearest_even(bits)
        low = even.sub_(w.view(torch.int16).to(torch.int32).bitwise_left_shift_(16))
        if bool((low.abs() < 1 << 16).all()):
            r.copy_(low.bitwise_right_shift_(1))
        else:
            split_master_(m, w, r)


def joined_master(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """``join_master`` into a new fp32 tensor a chunk at a time (for whole parameters)."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    for o, w, r in zip(*(t.view(-1).split(_CHUNK) for t in (out, weight, remainder)), strict=True):
        o.copy_(join_master(w, r))
    return out


def _store_(dst: torch.Tensor, src: torch.Tensor, noise: torch.Tensor | None) -> None:
    """Write fp32 ``src`` into ``dst`` (its own dtype); into bf16 with ``noise`` (uniform int16) rounding
    stochastically, else to nearest."""
    if dst.dtype == torch.bfloat16 and noise is not None:
        dst.copy_(_round_high_(src.view(torch.int32).clone(), noise).view(torch.float32))
    elif dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


def _noise(n: int, fields: int, generator: torch.Generator, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``fields`` tensors of ``n`` uniform int16 values each, cut from full-range 64-bit draws (four values a
    draw: a draw costs about what one bounded 16-bit draw does)."""
    draws = torch.empty(-(-n * fields // 4), dtype=torch.int64, device=device)
    values = draws.random_(-(1 << 63), None, generator=generator).view(torch.int16)
    return tuple(values[k * n:(k + 1) * n] for k in range(fields))


class PrecisionAwareAdam(torch.optim.AdamW):
    """Adam(W) over (bf16) weight shards whose master weights and moments it keeps itself.

    The keyword arguments are those megatron-core passes to Transformer Engine's FusedAdam in
    precision-aware mode; ``rounding`` and ``seed`` are ours. Gradients come from ``p.decoupled_grad``
    (``use_decoupled_grad``) or ``p.grad``. A subclass of torch's ``AdamW`` because Megatron's
    distributed optimizer accepts only the Adam family (its checkpoints hold their state layout);
    ``step`` and the state are this class's own.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, adam_w_mode: bool = True, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, master_weights: bool = True,
                 master_weight_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = True,
                 store_param_remainders: bool = True, rounding: Rounding = "nearest", seed: int = 0) -> None:
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be torch.float32 or torch.bfloat16, got {dtype}")
        if not master_weights or master_weight_dtype != torch.float32 or not store_param_remainders:
            raise ValueError("PrecisionAwareAdam keeps fp32 master weights as remainders only "
                             "(master_weights=True, master_weight_dtype=torch.float32, store_param_remainders=True)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.adam_w_mode, self.use_decoupled_grad, self.rounding = adam_w_mode, use_decoupled_grad, rounding
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.generator = torch.Generator().manual_seed(seed)

    def initialize_state(self, param: torch.Tensor) -> None:
        """Zero moments, step 0, and the master: for bf16 weights a zero remainder, an fp32 weight itself."""
        state = self.state[param]
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros(param.shape, dtype=self.exp_avg_dtype, device=param.device)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=self.exp_avg_sq_dtype, device=param.device)
        if param.dtype == torch.bfloat16:
            state["master_param"] = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        elif param.dtype == torch.float32:
            # an fp32 weight is its own master; Megatron's checkpoints read and write it as this state
            state["master_param"] = param.detach()
        else:
            raise TypeError(f"PrecisionAwareAdam takes bf16 or fp32 parameters, got {param.dtype}")

    def get_unscaled_state(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """State ``key`` for Megatron's checkpoints: the master as an fp32 tensor (the form every Megatron
        optimizer saves), the moments as stored (Megatron copies them into its own tensors)."""
        state = self._state(param)
        if key == "master_param" and "master_param" in state and state["master_param"].dtype == torch.int16:
            return joined_master(param.detach(), state["master_param"])
        return state[key]

    @contextmanager
    def fp32_masters(self) -> Iterator[None]:
        """Hold every master as an fp32 tensor in place of its remainder while inside (for a checkpoint save,
        which needs the fp32 masters: the remainders' memory is given up meanwhile, not added to); the
        remainders come back exactly."""
        held = [(p, st) for p, st in self.state.items() if st.get("master_param") is not None
                and st["master_param"].dtype == torch.int16]
        for param, state in held:
            state["master_param"] = joined_master(param.detach(), state["master_param"])
        try:
            yield
        finally:
            for param, state in held:
                master = state.pop("master_param")
                state["master_param"] = torch.empty(master.shape, dtype=torch.int16, device=master.device)
                keep_weight_set_master_(param.detach(), state["master_param"], master)

    def set_scaled_state(self, param: torch.Tensor, key: str, value: torch.Tensor) -> None:
        """Load state ``key`` from a checkpoint (``get_unscaled_state``'s form). The master's remainder is
        taken against the weight as loaded, so a stochastically rounded weight stays as it was saved (inside
        ``fp32_masters`` the fp32 master is set, and the remainder follows on leaving)."""
        state = self._state(param)
        value = value.reshape(param.shape)
        if key != "master_param":
            _store_(state[key], value, None)
        elif state["master_param"].dtype == torch.int16:
            keep_weight_set_master_(param.detach(), state["master_param"], value.float())
        else:  # held in fp32 (``fp32_masters``), or an fp32 weight itself
            _store_(state["master_param"], value, None)

    def _state(self, param: torch.Tensor) -> dict:
        if not self.state[param]:
            self.initialize_state(param)
        return self.state[param]

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``state_dict`` gave it, into the state tensors already there; torch's own would cast every state
        tensor to its parameter's dtype (bf16), the remainders included, and allocate them all anew.
        (Megatron's distributed optimizer loads through here with its current state or placeholders, then
        sets the real values with ``set_scaled_state``.)"""
        kept = dict(self.state)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self.state.update(kept)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            state = self._state(params[index])
            for key, value in saved.items():
                if key == "step":
                    state["step"] = torch.as_tensor(value, dtype=torch.float32).clone()
                else:
                    _store_(state[key], value.reshape(state[key].shape), None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
                if grad is None:
                    continue
                state = self._state(param)
                state["step"] += 1
                self._update(param, grad, state, group, float(state["step"]))
        return loss

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: float) -> None:
        """Adam on the fp32 master, a chunk at a time, in torch's fused kernel (one pass over the chunk: a fifth
        of the time of the same arithmetic as separate tensor operations on one CPU core)."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        adam = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        steps = [torch.tensor(step, dtype=torch.float32, device=param.device)]
        remainder = state["master_param"] if state["master_param"].dtype == torch.int16 else None  # bf16 weights
        flat = {k: t.view(-1) for k, t in (("p", param), ("g", grad), ("m", state["exp_avg"]),
                                           ("v", state["exp_avg_sq"]), ("r", remainder)) if t is not None}
        for start in range(0, param.numel(), _CHUNK):
            c = {k: t[start:start + _CHUNK] for k, t in flat.items()}
            master = join_master(c["p"], c["r"]) if "r" in c else c["p"]
            m, v = c["m"].float(), c["v"].float()  # views when fp32: updated in place, as torch's Adam does
            adam([master], [c["g"].float()], [m], [v], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
            noise = self._noise(m.numel(), c)
            _store_(c["m"], m, noise.get("m"))
            _store_(c["v"], v, noise.get("v"))
            if "r" in c:
                split_master_(master, c["p"], c["r"], noise.get("r"))

    def _noise(self, n: int, chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stochastic rounding's noise for the chunk's bf16 targets only (the remainder is the bf16 weight's);
        none when rounding to nearest."""
        needed = [k for k in ("r", "m", "v") if k in chunk and (k == "r" or chunk[k].dtype == torch.bfloat16)]
        if self.rounding != "stochastic" or not needed:
            return {}
        return dict(zip(needed, _noise(n, len(needed), self.generator, chunk["g"].device), strict=True))

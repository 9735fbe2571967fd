"""The receiving side of the adapter push (``wire.AdapterMerge``) against the real ``peft``: the names it takes are
those PEFT saves, and the weight it installs is PEFT's ``merge_and_unload`` of the same adapters."""
from __future__ import annotations

import pytest
import torch

from megatron_areal.model.lora_sites import hf_weight_name, peft_name
from megatron_areal.weights.wire import AdapterMerge, adapter_name, adapter_target


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(6, 5, bias=False)
        self.up_proj = torch.nn.Linear(6, 7, bias=False)


def peft_model(rank: int = 2, alpha: float = 6.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Tiny(), LoraConfig(r=rank, lora_alpha=alpha, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p))  # B starts at zero in PEFT; give it values
    return model


def test_merged_weights_are_peft_merge_and_unload() -> None:
    from peft import get_peft_model_state_dict

    model = peft_model()
    base = {n: p.detach().clone() for n, p in model.base_model.model.state_dict().items() if "lora_" not in n
            and "base_layer" in n}
    base = {n.replace(".base_layer", ""): t for n, t in base.items()}
    adapters = get_peft_model_state_dict(model)  # the names PEFT saves
    merge = AdapterMerge(lambda name: base[name])
    merged = merge.merged(dict(adapters), 6.0 / 2, lambda n: base[n].shape if n in base else None)
    reference = model.merge_and_unload().state_dict()
    assert sorted(merged) == ["q_proj.weight", "up_proj.weight"]
    for name, t in merged.items():
        torch.testing.assert_close(t, reference[name], rtol=0, atol=1e-6)


def test_halves_in_separate_buckets_and_a_whole_weight_resets_the_base() -> None:
    from peft import get_peft_model_state_dict

    model = peft_model()
    adapters = get_peft_model_state_dict(model)
    served = {"q_proj.weight": torch.randn(5, 6), "up_proj.weight": torch.randn(7, 6)}
    merge = AdapterMerge(lambda name: served[name])
    shape = lambda n: served[n].shape if n in served else None  # noqa: E731
    a = {n: t for n, t in adapters.items() if "q_proj.lora_A" in n}
    b = {n: t for n, t in adapters.items() if "q_proj.lora_B" in n}
    assert merge.merged(a, 3.0, shape) == {}  # B not here yet: nothing to install
    first = merge.merged(b, 3.0, shape)["q_proj.weight"]
    want = served["q_proj.weight"] + 3.0 * next(iter(b.values())) @ next(iter(a.values()))
    torch.testing.assert_close(first, want)
    served["q_proj.weight"] = first  # installed; the next push merges into the kept base, not into this
    again = merge.merged({**a, **b}, 3.0, shape)["q_proj.weight"]
    torch.testing.assert_close(again, want)
    merge.forget(["q_proj.weight"])  # a whole weight arrived: it is the new base
    assert merge.merged(b, 3.0, shape) == {}


def test_bad_adapters_are_refused_naming_the_weight() -> None:
    merge = AdapterMerge(lambda name: torch.zeros(5, 6))
    shape = lambda n: (5, 6) if n == "model.layers.0.self_attn.q_proj.weight" else None  # noqa: E731
    a = adapter_name("model.layers.0.self_attn.q_proj.weight", "A")
    with pytest.raises(ValueError, match="q_proj.weight.*do not fit"):
        merge.merged({a: torch.zeros(2, 7)}, 1.0, shape)
    with pytest.raises(ValueError, match="lora_scale"):
        merge.merged({a: torch.zeros(2, 6)}, None, shape)
    with pytest.raises(ValueError, match="k_proj.weight: the model has no such weight"):
        merge.merged({adapter_name("model.layers.0.self_attn.k_proj.weight", "B"): torch.zeros(5, 2)}, 1.0, shape)
    assert merge.base == {} and merge.pairs == {}  # nothing kept from refused buckets


def test_wire_names_are_the_peft_export_names() -> None:
    for layer, module in ((0, "self_attn.q_proj"), (3, "mlp.down_proj")):
        for matrix in ("A", "B"):
            name = adapter_name(hf_weight_name(layer, module), matrix)
            assert name == peft_name(layer, module, matrix)
            assert adapter_target(name) == (hf_weight_name(layer, module), matrix)
    assert adapter_target("model.layers.0.self_attn.q_proj.weight") is None


def test_a_bf16_merge_keeps_an_update_below_bf16_spacing() -> None:
    """Served in bf16, ``base + scale * B @ A`` must carry the adapters' update on average: an RL step's update is
    mostly far below bf16's spacing, and rounded to nearest it vanished (the served weights kept about 0.29 of
    a trained rank-8 update on SmolLM2). The reference is the exact fp32 merge."""
    torch.manual_seed(0)
    base = (torch.randn(256, 512) * 0.05).to(torch.bfloat16)
    a, b = torch.randn(4, 512) * 5e-3, torch.randn(256, 4) * 5e-3
    scale = 0.5
    exact = base.float() + scale * (b @ a)  # updates near 2.5e-5; bf16 spacing at 0.05 is 2.4e-4
    names = {"A": adapter_name("q_proj.weight", "A"), "B": adapter_name("q_proj.weight", "B")}
    merge = AdapterMerge(lambda name: base)
    served = merge.merged({names["A"]: a, names["B"]: b}, scale, lambda n: base.shape)["q_proj.weight"]
    assert served.dtype == torch.bfloat16
    trained, kept = exact - base.float(), served.float() - base.float()
    along = float((kept * trained).sum() / (trained * trained).sum())  # 1.0: the whole update, on average
    assert along == pytest.approx(1.0, abs=0.05), along
    nearest = exact.to(torch.bfloat16).float() - base.float()
    assert float((nearest * trained).sum() / (trained * trained).sum()) < 0.5  # what rounding to nearest keeps

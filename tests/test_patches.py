"""The megatron-core CPU patch applies to the installed version, lists its sites, and fails loudly."""
from __future__ import annotations

import pytest
import torch

from megatron_areal.patches import cpu_gloo
from megatron_areal.patches.cpu_gloo import SOURCE_EDITS, PatchError, SourceEdit, apply_cpu_patch, remove_cpu_patch


@pytest.fixture
def clean():
    remove_cpu_patch()
    originals = (torch.zeros, torch.Tensor.to)
    yield
    remove_cpu_patch()
    assert (torch.zeros, torch.Tensor.to) == originals


def _cpu_param_with_grad() -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    return p


def test_applies_lists_sites_and_redirects(clean):
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.utils import get_default_causal_mask

    patch = apply_cpu_patch()
    assert apply_cpu_patch() is patch  # once per process
    assert set(patch.edited_sites) == {e.site for e in SOURCE_EDITS}
    assert {"torch.empty", "torch.zeros", "Tensor.to", "Tensor.cuda", "torch.cuda.current_device"} <= set(patch.wrapped)

    mask = get_default_causal_mask(3)  # megatron-core allocates this with device="cuda"
    assert mask.device.type == "cpu" and mask.tolist()[0] == [False, True, True]
    sites = patch.redirected_sites()
    assert any(site.endswith("megatron/core/transformer/utils.py:35") for site in sites), sites

    # the type-name assertion is edited, and the optimizer module's imported copy is the edited one
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    p = _cpu_param_with_grad()
    clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)


def test_remove_restores_megatron_and_torch(clean):
    from megatron.core.optimizer import clip_grads

    original = clip_grads.clip_grad_by_total_norm_fp32
    apply_cpu_patch()
    assert clip_grads.clip_grad_by_total_norm_fp32 is not original
    remove_cpu_patch()
    assert clip_grads.clip_grad_by_total_norm_fp32 is original
    with pytest.raises(AssertionError):  # the unpatched check rejects CPU gradients
        original([_cpu_param_with_grad()], max_norm=1.0, total_norm=4.0)


def test_moved_site_fails_loudly_and_leaves_nothing_patched(clean):
    moved = SourceEdit("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                       "this text is not in the function", "x", "test")
    zeros = torch.zeros
    with pytest.raises(PatchError, match="clip_grad_by_total_norm_fp32: expected 1 x .*the site moved"):
        apply_cpu_patch((*SOURCE_EDITS, moved))
    assert torch.zeros is zeros and cpu_gloo.active_patch() is None


def test_missing_target_fails_loudly(clean):
    gone = SourceEdit("megatron.core.optimizer.clip_grads", "no_such_function", "a", "b", "test")
    with pytest.raises(PatchError, match="no_such_function no longer exists"):
        apply_cpu_patch((gone,))
    gone_module = SourceEdit("megatron.core.no_such_module", "f", "a", "b", "test")
    with pytest.raises(PatchError, match="cannot import megatron.core.no_such_module"):
        apply_cpu_patch((gone_module,))


def test_other_megatron_version_is_refused(clean, monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(PatchError, match="megatron-core 0.17.0 is installed.*0.16.1"):
        apply_cpu_patch()
    assert cpu_gloo.active_patch() is None

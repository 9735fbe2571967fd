"""The embedded server takes a bucket of PEFT-named adapters (``lora_A`` / ``lora_B`` with ``lora_scale``) over a
real weight-update group: it serves ``W_base + lora_scale * B @ A`` (the same sha256 as that tensor computed
here), merges the next push into the kept base (not into the weight it serves), and refuses an adapter that
does not fit its weight with a 400 naming it, the served weights unchanged."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch
from test_server_hostile import call, checksums, message, model, server  # noqa: F401 - pytest fixtures

from megatron_areal.server.weights import read_safetensors, tensor_checksum
from megatron_areal.util.netutil import free_port
from megatron_areal.weights.wire import WeightUpdateGroup, adapter_name


def _push(url: str, group: WeightUpdateGroup, tensors: dict[str, torch.Tensor], scale: float) -> tuple:
    """One bucket of ``tensors`` (one broadcast each), announced with ``lora_scale``; the server's reply."""
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(call, url, "/update_weights_from_distributed", {
            "names": list(tensors), "dtypes": ["float32"] * len(tensors),
            "shapes": [list(t.shape) for t in tensors.values()], "group_name": "lora", "lora_scale": scale,
            "weight_version": "7"}, timeout=60)
        time.sleep(0.5)
        for t in tensors.values():
            group.broadcast(t)
        return pending.result(timeout=60)


def test_adapters_are_merged_into_the_kept_base_and_bad_ones_refused(server, model) -> None:  # noqa: F811
    url, port = server.url, free_port()
    with ThreadPoolExecutor(1) as ex:
        trainer = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                            world_size=2, group_name="lora", backend="gloo", timeout_s=30)
        status, reply = call(url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "lora", "backend": "gloo"})
        group = trainer.result(timeout=60)
    assert status == 200, reply
    name = sorted(n for n in read_safetensors(model) if n.endswith("self_attn.q_proj.weight"))[0]
    base = read_safetensors(model)[name].float()
    torch.manual_seed(0)
    a, b = torch.randn(4, base.shape[1]), torch.randn(base.shape[0], 4)
    try:
        assert call(url, "/begin_weight_update", {"selector": "all"})[0] == 200
        before = checksums(url)
        status, reply = _push(url, group, {adapter_name(name, "A"): a, adapter_name(name, "B"): b[:, :3]}, 2.0)
        assert status == 400 and name in message(reply) and "do not fit" in message(reply), reply
        assert checksums(url) == before
        for scale in (2.0, 0.5):  # the second push merges into the base, not into the first push's weight
            status, reply = _push(url, group, {adapter_name(name, "A"): a, adapter_name(name, "B"): b}, scale)
            assert status == 200, reply
            assert checksums(url)[name] == tensor_checksum(base + scale * (b @ a))
        assert call(url, "/end_weight_update", {})[0] == 200
        assert call(url, "/get_weight_version")[1]["weight_version"] == "7"
    finally:
        call(url, "/destroy_weights_update_group", {"group_name": "lora"})
        group.destroy()

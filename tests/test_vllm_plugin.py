"""The project's vLLM plugin: which weight-transfer engine each kind of server is started with.

The trainer pushes weights over a ``torch.distributed`` group it forms with ``weights/wire.join_group``
(gloo on CPU, NCCL on GPUs), the group SGLang and the embedded server join. vLLM's own ``nccl`` engine
forms its group differently (its own rendezvous, its own field names) and cannot join it, so a GPU
server must be started with the plugin's NCCL engine, not vLLM's. The registrations are read from vLLM's
own engine factory, in the vLLM environment (a subprocess: the trainer's environment has no vLLM).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_areal import vllm_plugin
from megatron_areal.launch.vllm import VLLMLaunch

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("MEGATRON_AREAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def weight_transfer_backend(gpu: bool) -> str:
    cmd = VLLMLaunch(model_path="m", port=1, gpu=gpu).command()
    return json.loads(cmd[cmd.index("--weight-transfer-config") + 1])["backend"]


@pytest.mark.parametrize("gpu, group_backend", [(False, "gloo"), (True, "nccl")])
def test_servers_are_started_with_the_plugins_engine(gpu: bool, group_backend: str) -> None:
    name = weight_transfer_backend(gpu)
    assert vllm_plugin.ENGINES.get(name) == group_backend, (name, vllm_plugin.ENGINES)


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_vllms_factory_builds_the_plugins_engines() -> None:
    probe = (
        "import json\n"
        "from megatron_areal.vllm_plugin import register\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "register(); register()\n"  # vLLM may load plugins twice in one process
        "from megatron_areal.vllm_plugin import ENGINES\n"
        "print(json.dumps({n: F._registry[n]().group_backend for n in ENGINES}))\n")
    out = subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == vllm_plugin.ENGINES


def _asgi_call(middleware, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bool]:
    """(status, whether the app behind it was reached) of one HTTP request through ``middleware``."""
    import asyncio

    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}
    asyncio.run(middleware(app)(scope, receive, send))
    return sent[0]["status"], bool(reached)


@pytest.mark.parametrize("path", ["/pause", "/resume", "/init_weight_transfer_engine", "/update_weights",
                                  "/update_weight_version", "/start_weight_update", "/weight_info", "/v1/models"])
def test_every_route_but_health_needs_the_key(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_areal.vllm_plugin.admin_key import AdminKeyMiddleware

    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    assert _asgi_call(AdminKeyMiddleware, path, []) == (401, False)
    assert _asgi_call(AdminKeyMiddleware, path, [(b"authorization", b"Bearer wrong")]) == (401, False)
    assert _asgi_call(AdminKeyMiddleware, path, [(b"authorization", b"Bearer \xff\xfe")]) == (401, False)
    assert _asgi_call(AdminKeyMiddleware, path, [(b"authorization", b"Bearer s3cret")]) == (200, True)
    assert _asgi_call(AdminKeyMiddleware, "/health", []) == (200, True)


def test_without_a_key_the_middleware_passes_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_areal.vllm_plugin.admin_key import AdminKeyMiddleware

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert _asgi_call(AdminKeyMiddleware, "/pause", []) == (200, True)


def test_servers_are_started_with_the_middleware() -> None:
    cmd = VLLMLaunch(model_path="m", port=1).command()
    assert cmd[cmd.index("--middleware") + 1] == "megatron_areal.vllm_plugin.admin_key.AdminKeyMiddleware"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "auto"])
def test_cpu_servers_compute_in_the_trainers_dtype(dtype: str) -> None:
    """The trainer and the embedded server compute a requested bf16 in fp32 on a CPU without native
    bf16 (``compute_dtype.runnable_dtype``); a vLLM server on the same CPU must too, or it samples from
    another policy's numerics (and runs bf16 through slow reference kernels)."""
    import torch

    from megatron_areal.config import load_config
    from megatron_areal.launch.commands import vllm_spec
    from megatron_areal.run.plan import ServerSlot
    from megatron_areal.util.compute_dtype import runnable_dtype

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/smollm2_arith.yaml",
                      ["server.engine=vllm", f"model.dtype={dtype}"])
    slot = ServerSlot(id="n0-0", node="n0", addr="127.0.0.1", port=31000, gpus=())
    requested = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    trainer = runnable_dtype(requested, torch.device("cpu"), "model.dtype")
    assert vllm_spec(slot, cfg, "/model").dtype == str(trainer).removeprefix("torch.")


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM environment at {VLLM_PYTHON}")
@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_a_bucket_of_non_float_tensors_is_refused(dtype: str) -> None:
    """Copying integers into a float parameter succeeds and truncates the weights: refused, naming the tensor."""
    probe = (
        "from megatron_areal.vllm_plugin.group_engine import GroupUpdateInfo\n"
        "try:\n"
        f"    GroupUpdateInfo(names=['model.norm.weight'], dtypes=[{dtype!r}], shapes=[[4]])\n"
        "    print('accepted')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n")
    out = subprocess.run([VLLM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("refused:") and "model.norm.weight" in last and dtype in last, last

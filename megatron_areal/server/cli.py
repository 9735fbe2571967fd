"""``megatron-areal serve``: run the embedded SGLang-compatible server on one model folder."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_areal.server.config import DEFAULT_CONTEXT_LENGTH, MAX_VERSION_CHARS, EngineOptions, ServerConfig
from megatron_areal.server.connections import ConnectionGuard, ConnectionLimits, raise_file_limit

log = logging.getLogger(__name__)
# After SIGTERM/SIGINT: the orderly stop (answer everyone, close the port) normally takes well under
# a second; past this grace the process exits anyway, whatever thread is stuck.
SHUTDOWN_GRACE_S = 15.0
API_KEY_ENV = "MEGATRON_AREAL_API_KEY"  # how the launcher hands the key to a server (never in argv)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The ``serve`` command line, checked: a model folder with a config.json, positive limits, one source of
    the API key."""
    p = argparse.ArgumentParser(prog="megatron-areal serve", description=__doc__)
    p.add_argument("--model", "--model-path", dest="model", required=True, help="Hugging Face model folder")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.base_port, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' except on /health "
                   f"(visible to every user in the process list: prefer --api-key-file or ${API_KEY_ENV})")
    p.add_argument("--api-key-file", default=None, help=f"read the key from this file (default: ${API_KEY_ENV})")
    # The engine's options: an unset flag leaves the default of server/config.EngineOptions.
    defaults = EngineOptions()
    p.add_argument("--max-running", type=int,
                   help=f"sequences decoded together (KV cache slots; default {defaults.max_running})")
    p.add_argument("--max-queue", type=int,
                   help=f"waiting requests before answering 503 (default {defaults.max_queue})")
    p.add_argument("--context-length", type=int,
                   help="tokens per KV slot (prompt + output); default: the model's max_position_embeddings, "
                        f"at most {DEFAULT_CONTEXT_LENGTH} (the cache is allocated at start)")
    p.add_argument("--max-prefill-tokens", type=int,
                   help=f"padded tokens per prefill batch (default {defaults.max_prefill_tokens})")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="larger request bodies get 413")
    p.add_argument("--weight-version")
    p.add_argument("--weight-group-timeout", type=float, dest="weight_group_timeout_s", metavar="SECONDS",
                   help="seconds a weight-group join or broadcast may wait (a request's timeout_s is capped by it)")
    p.add_argument("--health-timeout", type=float, dest="health_timeout_s", metavar="SECONDS",
                   help="while paused, /health waits this long for generation to resume, then answers 503")
    p.add_argument("--weight-load-timeout", type=float, dest="weight_load_timeout_s", metavar="SECONDS",
                   help="seconds a weight load from disk may take before it fails and the old weights stay "
                        f"(default {defaults.weight_load_timeout_s:.0f})")
    p.add_argument("--max-request-tokens", type=int,
                   help="output tokens one /generate may ask for, prompts x n x max_new_tokens "
                        f"(default {defaults.max_request_tokens})")
    limits = ConnectionLimits()
    p.add_argument("--header-timeout", type=float, default=limits.header_timeout_s, metavar="SECONDS",
                   help="a connection that has not sent a request's headers this long after opening is closed")
    p.add_argument("--idle-timeout", type=float, default=limits.idle_timeout_s, metavar="SECONDS",
                   help="a keep-alive connection idle this long between requests is closed")
    p.add_argument("--body-timeout", type=float, default=limits.body_timeout_s, metavar="SECONDS",
                   help="a request whose body has not arrived this long after its headers gets 408")
    p.add_argument("--max-connections", type=int, default=limits.max_connections,
                   help="open connections at most (and at most half the open-file limit, which is raised to "
                        "the hard limit at start); past it the connection waiting longest without a request "
                        "is closed")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", help="float32 (CPU default) | bfloat16 (CUDA default; on a CPU without native "
                   "bf16 matmuls, AVX512-BF16 or AMX, it runs in float32) | float16")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="serve input_ids only")
    p.add_argument("--register-dir", default=None, help="write DIR/<server-id> (url, pid, model) once healthy")
    p.add_argument("--server-id", default=None, help="name of the registration file (default: host-port)")
    args = p.parse_args(argv)
    args.api_key = _api_key(p, args)
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (is it a Hugging Face model folder?)")
    for flag in ("max_running", "max_queue", "max_prefill_tokens", "max_request_tokens", "max_connections"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("weight_group_timeout", "health_timeout", "weight_load_timeout"):
        value = getattr(args, f"{flag}_s")
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")
    for flag in ("header_timeout", "idle_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")
    if args.weight_version is not None and len(args.weight_version) > MAX_VERSION_CHARS:
        p.error(f"--weight-version: at most {MAX_VERSION_CHARS} characters (it is copied into every reply)")
    return args


def _api_key(p: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file, else $MEGATRON_AREAL_API_KEY: the launcher uses the environment,
    because a command line is readable by every user of the machine."""
    if args.api_key and args.api_key_file:
        p.error("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            p.error(f"--api-key-file: {e}")
        if not key:
            p.error(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def write_registration(directory: str, server_id: str, info: dict[str, Any]) -> Path:
    """Atomic: a reader sees the whole file or none of it."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / server_id
    tmp = folder / f".{server_id}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
    return path


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The HTTP connection limits from the flags."""
    return ConnectionLimits(header_timeout_s=args.header_timeout, idle_timeout_s=args.idle_timeout,
                            body_timeout_s=args.body_timeout, max_connections=args.max_connections)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's options from the flags given; the others keep ``EngineOptions``' defaults."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EngineOptions)}
    return EngineOptions(**{name: value for name, value in given.items() if value is not None})


async def serve(args: argparse.Namespace) -> None:
    """Load the model, bind the port, print ``READY <url>``, register if asked, and serve until SIGTERM or
    SIGINT; then answer everyone and close."""
    # Imported here so that argument errors are reported before torch loads.
    from aiohttp import web

    from megatron_areal.server.api import Api
    from megatron_areal.server.engine import Engine
    from megatron_areal.server.tokenizer import load_tokenizer

    opts = engine_options(args)
    tokenizer = None if args.skip_tokenizer_init else await asyncio.to_thread(load_tokenizer, args.model)
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    engine = await asyncio.to_thread(Engine, args.model, opts, decode)
    raise_file_limit()
    guard = ConnectionGuard(connection_limits(args))
    api = Api(engine, api_key=args.api_key, tokenizer=tokenizer, served_model_name=args.model, connections=guard)
    runner = web.AppRunner(api.app(int(args.max_body_mb * 2**20)), access_log=None, handler_cancellation=False,
                           shutdown_timeout=5.0)
    await runner.setup()
    assert runner.server is not None
    # The listening socket is ours (not a TCPSite) so that each connection's protocol reports to the guard;
    # the runner still owns the app and closes the connections at cleanup.
    listener = await asyncio.get_running_loop().create_server(guard.factory(runner.server), args.host, args.port,
                                                              reuse_address=True)
    port = int(listener.sockets[0].getsockname()[1])
    engine.start()
    # A wildcard bind is reachable through this host's name, which is what a trainer needs.
    advertised = socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{advertised}:{port}"
    log.info("serving %s at %s", args.model, url)
    print(f"READY {url}", flush=True)  # the port actually bound, for --port 0
    registration = None
    if args.register_dir:
        server_id = args.server_id or f"{socket.gethostname()}-{port}"
        registration = write_registration(args.register_dir, server_id,
                                          {"url": url, "pid": os.getpid(), "model": args.model})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # a second signal ends the process at once
        _exit_after(SHUTDOWN_GRACE_S)
        if registration is not None:
            registration.unlink(missing_ok=True)
        log.info("shutting down")
        await _in_own_thread(lambda: engine.stop(timeout_s=5.0))
        listener.close()
        guard.close()
        api.parsers.close()
        await runner.cleanup()


async def _in_own_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a fresh thread: the shared executor's threads may all be busy (or stuck)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def target() -> None:
        try:
            fn()
        except Exception:
            log.exception("stopping the engine failed")
        finally:
            loop.call_soon_threadsafe(done.set_result, None)

    threading.Thread(target=target, name="shutdown", daemon=True).start()
    await done


def _exit_after(seconds: float) -> None:
    """Make sure the process ends: a thread blocked in a join or a collective would hold up exit."""
    def hard_exit() -> None:
        log.error("shutdown did not finish within %.0fs: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True
    timer.start()


def main(argv: list[str]) -> int:
    """``megatron-areal serve``; returns the exit code."""
    args = parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

"""``megatron-areal`` entry point. Each command lives in its own module, imported on use."""
from __future__ import annotations

import importlib
import logging
import sys

COMMANDS = {
    "train": ("megatron_areal.launch.cli", "the main job: asynchronous RL (train CONFIG.yaml [key=value ...])"),
    "serve": ("megatron_areal.server.cli", "the embedded SGLang-compatible rollout server"),
    "convert": ("megatron_areal.convert.cli", "HF <-> Megatron checkpoint conversion"),
    "score": ("megatron_areal.convert.score", "per-token logprobs of token sequences under the Megatron model"),
    "eval": ("megatron_areal.evaluation.cli", "held-out accuracy of a model on a task"),
    "prepare": ("megatron_areal.model.assets", "one-time preparation of built-in models (SmolLM2-135M from GGUF)"),
    "simulate": ("megatron_areal.sim.cli", "discrete-event model of a cluster run; planning"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: megatron-areal COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`megatron-areal COMMAND --help` shows a command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""How the rollout API key travels from the launcher to servers and trainer ranks: by environment.

Any user of a machine can read any process's command line (``/proc/PID/cmdline``, ``ps``), and the
launcher writes each child's command line at the top of its log. So the key never goes into a child's
argv: the launcher resolves it once (``MEGATRON_AREAL_API_KEY`` when set, else ``server.api_key`` from
the config file or a ``server.api_key=...`` override), drops any key override from the overrides it
hands on, and gives children the key in ``MEGATRON_AREAL_API_KEY`` (``/proc/PID/environ`` is readable
by the owner only; ``srun`` passes the environment to every node). Children read it back with
``apply_env_api_key``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_areal.config import Config
from megatron_areal.configbase import ConfigError, parse_override
from megatron_areal.server.cli import API_KEY_ENV

__all__ = ["API_KEY_ENV", "apply_env_api_key", "env_with_api_key", "public_overrides"]


def is_api_key_override(text: str) -> bool:
    try:
        return parse_override(text)[0] == ["server", "api_key"]
    except ConfigError:
        return False


def public_overrides(overrides: list[str]) -> list[str]:
    """The overrides a child may see on its command line: all but the key."""
    return [o for o in overrides if not is_api_key_override(o)]


def apply_env_api_key(cfg: Config, env: Mapping[str, str] | None = None) -> Config:
    """Set ``cfg.server.api_key`` from ``MEGATRON_AREAL_API_KEY`` when that is set (it wins over the
    config file, so that launcher and children agree on one key); returns ``cfg``."""
    key = (os.environ if env is None else env).get(API_KEY_ENV)
    if key:
        cfg.server.api_key = key
    return cfg


def env_with_api_key(env: Mapping[str, str], key: str | None) -> dict[str, str]:
    """A child's environment carrying ``key`` (and no stale key when there is none)."""
    out = dict(env)
    out.pop(API_KEY_ENV, None)
    if key:
        out[API_KEY_ENV] = key
    return out


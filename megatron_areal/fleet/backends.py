"""Which client speaks to which rollout engine (``server.engine``): the one registry of backends.

SGLang and the embedded server share one HTTP protocol (``client.RolloutClient``); vLLM has its own
routes (``vllm_client.VLLMClient``) behind the same methods. Everything above a client (the fleet,
the rollout requests, the weight push) is the same for all of them.
"""
from __future__ import annotations

from megatron_areal.fleet.client import RolloutClient
from megatron_areal.fleet.vllm_client import VLLMClient

CLIENTS: dict[str, type[RolloutClient]] = {"embedded": RolloutClient, "sglang": RolloutClient, "vllm": VLLMClient}


def client_class(engine: str) -> type[RolloutClient]:
    """The client class of ``engine``; ``ValueError`` names the known engines otherwise."""
    try:
        return CLIENTS[engine]
    except KeyError:
        raise ValueError(f"server.engine {engine!r} is not one of {sorted(CLIENTS)}") from None

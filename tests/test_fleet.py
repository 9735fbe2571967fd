"""One ``Fleet`` on trainer rank 0: the rollout controller routes over it, the weight path drops
and re-admits its members, evaluation answers on it, all on its one event loop."""
from __future__ import annotations

from types import SimpleNamespace

from rollout_fakes import FakeFleet, FakeServer, ListPrompts, ParityScorer, decode, encode

from megatron_areal.data.prompt import Prompt
from megatron_areal.evaluation.held_out import evaluate
from megatron_areal.fleet.fleet import Fleet
from megatron_areal.rollout.config import RolloutConfig, StalenessConfig
from megatron_areal.rollout.controller import RolloutController


class Tokenizer:
    eos_token_id = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1, 2, len(text)]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class Rewards:
    def score_sync(self, task: str, text: str, answer: object) -> SimpleNamespace:
        return SimpleNamespace(reward=1.0)


def _evaluate(fleet: Fleet) -> None:
    prompts = [Prompt(index=i, text="x" * i, task="math") for i in range(6)]
    result = evaluate(fleet, prompts, Tokenizer(), Rewards(), max_new_tokens=4, chat_template=False)
    assert result.n == 6 and result.accuracy == 1.0


def test_a_member_the_weight_path_drops_leaves_rollouts_and_evaluation_until_it_joins_again():
    servers = FakeFleet([FakeServer(seed=i, token_delay=(0.001, 0.002)) for i in range(2)])
    kept, dropped = servers.servers
    fleet = Fleet(servers.urls, request_timeout_s=60)
    cfg = RolloutConfig(batch_size=4, group_size=2, max_new_tokens=16, max_concurrent=8, health_interval_s=0.2)
    try:
        assert fleet.urls == servers.urls
        with RolloutController(cfg, StalenessConfig(eta=1), fleet, ListPrompts(10_000), encode, decode,
                               ParityScorer()) as ctl:
            ctl.get_batch(timeout=60)
            ctl.pause_generation(pause_servers=False)
            servers.update_behind_controllers_back(1)
            fleet.drop(dropped.url, "did not take weights v1")  # what WeightSync does on rank 0
            ctl.resume_generation(1, resume_servers=False)
            seen = len(dropped.requests)
            ctl.get_batch(timeout=60)
            assert ctl.metrics()["rollout/servers_dropped"] == 1.0
        assert len(dropped.requests) == seen  # nothing routed to it after the drop
        assert fleet.urls == [kept.url]  # the controller stopped; the shared fleet stays open
        before = len(dropped.requests)
        _evaluate(fleet)
        assert len(dropped.requests) == before and kept.requests
        fleet.join(dropped.url)  # re-admitted with the current weights
        assert fleet.urls == [kept.url, dropped.url]
        _evaluate(fleet)
        assert len(dropped.requests) > before
    finally:
        fleet.close()
        servers.close()


def test_the_weight_path_calls_reach_members_and_strangers_alike():
    servers = FakeFleet([FakeServer(seed=0)])
    fleet = Fleet()  # a pipeline stage's head: clients only, nobody routes
    try:
        assert fleet.urls == []
        assert fleet.alive(["http://127.0.0.1:9"]) == {"http://127.0.0.1:9": False}
        assert fleet.each(servers.urls, lambda c: c.pause()) == {}
        assert servers.servers[0].paused
        errors = fleet.each(["http://127.0.0.1:9"], lambda c: c.resume(), timeout_s=5)
        assert list(errors) == ["http://127.0.0.1:9"]
    finally:
        fleet.close()
        servers.close()

"""Configurations that cannot train are refused before anything starts, with an error naming the key.

The values are what a user can mistype on the command line (``optimizer.lr=.inf``, ``adam_beta1=5``,
a temperature of 1000); the sane ranges are the ones PyTorch's Adam and the samplers document
(betas in [0, 1), eps > 0, top_k -1 or >= 1). Valid edge values must still load, so a check that
refused everything would fail here too.
"""
from __future__ import annotations

import pytest

from megatron_areal.config import ConfigError, load_config

REFUSED = [
    ("optimizer.lr=.inf", "optimizer.lr"),
    ("optimizer.lr=.nan", "optimizer.lr"),
    ("optimizer.lr=-.inf", "optimizer.lr"),
    ("optimizer.lr=5", "optimizer.lr"),
    ("optimizer.min_lr=.nan", "optimizer.min_lr"),
    ("optimizer.adam_beta1=5", "optimizer.adam_beta1"),
    ("optimizer.adam_beta1=1", "optimizer.adam_beta1"),
    ("optimizer.adam_beta1=-0.1", "optimizer.adam_beta1"),
    ("optimizer.adam_beta2=-1", "optimizer.adam_beta2"),
    ("optimizer.adam_beta2=1.5", "optimizer.adam_beta2"),
    ("optimizer.adam_eps=-1", "optimizer.adam_eps"),
    ("optimizer.adam_eps=0", "optimizer.adam_eps"),
    ("optimizer.weight_decay=-3", "optimizer.weight_decay"),
    ("optimizer.weight_decay=.inf", "optimizer.weight_decay"),
    ("optimizer.clip_grad=.nan", "optimizer.clip_grad"),
    ("rollout.temperature=1000", "rollout.temperature"),
    ("rollout.temperature=.inf", "rollout.temperature"),
    ("rollout.temperature=.nan", "rollout.temperature"),
    ("rollout.temperature=-1", "rollout.temperature"),
    ("rollout.top_k=-7", "rollout.top_k"),
    ("rollout.top_k=0", "rollout.top_k"),
    ("rollout.top_p=.nan", "rollout.top_p"),
    ("rollout.request_timeout_s=.nan", "rollout.request_timeout_s"),
    ("ppo.eps_clip=.nan", "ppo.eps_clip"),
    ("ppo.eps_clip_high=.inf", "ppo.eps_clip_high"),
    ("ppo.kl_coef=.inf", "ppo.kl_coef"),
    ("ppo.behav_imp_weight_cap=.nan", "ppo.behav_imp_weight_cap"),
    ("reward.timeout_s=.inf", "reward.timeout_s"),
    ("weights.timeout_s=.nan", "weights.timeout_s"),
    ("model.router_aux_loss_coef=.nan", "model.router_aux_loss_coef"),
    ("server.startup_timeout_s=-1", "server.startup_timeout_s"),
]

ACCEPTED = ["optimizer.lr=1e-5", "optimizer.lr=1", "optimizer.adam_beta1=0", "optimizer.adam_beta2=0.95",
            "optimizer.adam_eps=1e-12", "optimizer.weight_decay=0.1", "rollout.temperature=0",
            "rollout.temperature=1.5", "rollout.top_k=-1", "rollout.top_k=1", "rollout.top_k=50",
            "ppo.behav_imp_weight_cap=null", "ppo.eps_clip_high=0.28"]


@pytest.mark.parametrize("override,key", REFUSED)
def test_out_of_range_value_is_refused_naming_its_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"{key}: "), str(e.value)


@pytest.mark.parametrize("override", ACCEPTED)
def test_sane_edge_values_still_load(override):
    key, value = override.split("=")
    section, name = key.split(".")
    loaded = getattr(getattr(load_config(None, [override]), section), name)
    assert loaded is None if value == "null" else loaded == float(value)


@pytest.mark.parametrize("overrides", [["model.max_seq_len=256", "rollout.max_new_tokens=256"],
                                       ["server.context_length=128", "rollout.max_new_tokens=200"]])
def test_max_new_tokens_that_leave_no_room_for_a_prompt_are_refused(overrides):
    with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens: "):
        load_config(None, overrides)
    assert load_config(None, [*overrides, "rollout.max_new_tokens=100"]).rollout.max_new_tokens == 100


def test_yaml_file_error_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  adam_beta2: -1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: optimizer\.adam_beta2: "):
        load_config(path)

"""The weight push's section is ``weights:``; a config written for the release before, with ``realloc:``,
still loads for one more release, with a deprecation message naming the new name, in a YAML file, in a
``realloc.x=v`` override and for the launcher's address rule. Both names at once is an error."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_areal.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_old_section_name_in_a_file_loads_with_a_deprecation_message(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("realloc:\n  timeout_s: 33\n  bucket_mb: 8\n")
    with pytest.warns(FutureWarning, match=r"'realloc:' is now 'weights:'") as caught:
        cfg = load_config(path)
    assert str(path) in str(caught[0].message)
    assert (cfg.weights.timeout_s, cfg.weights.bucket_mb) == (33, 8)


def test_old_section_name_in_an_override_loads_with_a_deprecation_message() -> None:
    with pytest.warns(FutureWarning, match=r"realloc\.pause_mode.*'weights:'"):
        cfg = load_config(None, ["realloc.pause_mode=retract"])
    assert cfg.weights.pause_mode == "retract"


def test_old_section_still_validates_under_the_new_name() -> None:
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="weights.timeout_s"):
        load_config(None, ["realloc.timeout_s=0"])


def test_both_names_at_once_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("realloc:\n  timeout_s: 33\nweights:\n  timeout_s: 44\n")
    with pytest.raises(ConfigError, match=r"both 'realloc:' and 'weights:'"):
        load_config(path)


def test_new_name_loads_without_a_message(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    path = tmp_path / "new.yaml"
    path.write_text("weights:\n  timeout_s: 33\n")
    assert load_config(path).weights.timeout_s == 33
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_launcher_respects_a_master_address_under_the_old_name(tmp_path: Path) -> None:
    """The launcher adds each trainer node's address unless the user set one, under either name."""
    from megatron_areal.launch.commands import weight_group_address
    from megatron_areal.launch.local import local_plan

    cfg = load_config(ROOT / "configs/train_tiny.yaml", ["server.host=127.0.0.1"])
    plan = local_plan(cfg)
    old = tmp_path / "old.yaml"
    old.write_text((ROOT / "configs/train_tiny.yaml").read_text() + "realloc:\n  master_address: 10.1.2.3\n")
    tiny = str(ROOT / "configs/train_tiny.yaml")
    assert weight_group_address(plan, 0, str(old), []) == []
    assert weight_group_address(plan, 0, tiny, ["realloc.master_address=1.2.3.4"]) == []
    assert weight_group_address(plan, 0, tiny, []) == ["weights.master_address=127.0.0.1"]

"""A rollout server that dies mid-run is restarted and re-admitted; the run loses nothing.

End to end: a tiny local run with two embedded servers is held after step 2 (``control/hold``),
one server is killed with SIGKILL, the launcher starts it again on the same port, the hold is
released, and the run must finish every step with every prompt trained exactly once, name the
restart in the launcher's log and the metrics (``rollout/server_restarts``), and the restarted
server must end holding the final weight version. Unit level: ``WeightSync`` re-admits a dropped
server that answers again (``readmit``), giving it the current weights.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from megatron_areal.util.netutil import free_port

STEPS = 5
HOLD_AT = 2
TRAIN_SIZE = 64  # the run stays inside the first epoch, so any repeat is a double use
RUN_TIMEOUT_S = 600  # generous: CI's two cores are shared with other tests


def write_config(root: Path) -> Path:
    cfg = {
        "train": {"run_dir": str(root / "run"), "steps": STEPS, "eval_every": 0, "seed": 3},
        "model": {"path": "tiny-llama", "max_seq_len": 256},
        "optimizer": {"distributed": False},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 16, "max_concurrent": 8,
                    "temperature": 1.0, "filter_equal_rewards": False},
        "staleness": {"eta": 1},
        "server": {"count": 2, "max_running": 16, "base_port": free_port(), "max_restarts": 2,
                   "restart_backoff_s": 0.5, "startup_timeout_s": 180},
        "cluster": {"master_port": free_port(), "stop_grace_s": 5},
        "data": {"train": "arithmetic", "train_size": TRAIN_SIZE, "eval": "", "seed": 0},
        "reward": {"workers": 1},
        "checkpoint": {"every": 0},
        "logging": {"progress": False},
    }
    path = root / "restart.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_logs(root: Path) -> str:
    files = [root / "launcher.out", *sorted((root / "run/logs").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in files if p.is_file())


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_until(cond, what: str, root: Path, launcher: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert launcher.poll() is None, f"the run ended while waiting for {what}:\n{run_logs(root)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s:\n{run_logs(root)}"
        time.sleep(0.1)


def model_info(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
            return json.loads(r.read())
    except OSError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_killed_server_is_restarted_and_readmitted(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    run_dir = tmp_path / "run"
    hold = run_dir / "control" / "hold"
    hold.parent.mkdir(parents=True)
    hold.write_text(str(HOLD_AT))
    with open(tmp_path / "launcher.out", "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "megatron_areal.cli", "train", str(config)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        held = run_dir / "control" / "held"
        wait_until(lambda: (read_json(held) or {}).get("step") == HOLD_AT, f"a hold at step {HOLD_AT}",
                   tmp_path, launcher, RUN_TIMEOUT_S)
        reg = run_dir / "servers"
        victim = sorted(p.name for p in reg.iterdir() if not p.name.startswith("."))[0]
        first = read_json(reg / victim)
        url, old_pid = first["url"], int(first["pid"])
        os.kill(old_pid, signal.SIGKILL)
        # the launcher starts it again on the same port; it registers with its new pid
        wait_until(lambda: (read_json(reg / victim) or {}).get("pid") not in (None, old_pid)
                   and model_info(url) is not None, f"server {victim} back at {url}", tmp_path, launcher, 180)
        assert read_json(reg / victim)["url"] == url, "the restarted server moved"
        hold.unlink()
        rc = launcher.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
            launcher.wait(timeout=60)
    logs = run_logs(tmp_path)
    assert rc == 0, logs

    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == list(range(1, STEPS + 1)), "a step is missing or repeated"
    trained = [p for e in ledger for p in e["prompts"]]
    assert len(trained) == len(set(trained)) == 2 * STEPS, f"a prompt was trained twice or lost: {trained}"

    launcher_log = (tmp_path / "launcher.out").read_text()
    assert "restarting it" in launcher_log, launcher_log[-4000:]
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["rollout/server_restarts"] >= 1, final
    assert final["rollout/healthy_servers"] == 2, final
    trainer_log = (run_dir / "logs/trainer.log").read_text()
    assert "re-admitted" in trainer_log, trainer_log[-4000:]

    # the restarted process (the last start in its log) ended on the final weights
    server_log = (run_dir / "logs" / f"server-{victim.rsplit('-', 1)[-1]}.log").read_text()
    restarted = server_log.rsplit("==== ", 1)[-1]
    assert server_log.count("==== ") == 2, "the server was not started exactly twice"
    assert f"version {STEPS}\n" in restarted, restarted[-3000:]


# ---- unit level: WeightSync re-admits a dropped server that answers again ---------------------
_STATE: dict = {}


def _w_setup(model_dir: str, urls: list[str]) -> None:
    from megatron_areal.actor.model import build_model
    from megatron_areal.actor.parallel import init_parallel
    from megatron_areal.fleet.fleet import Fleet
    from megatron_areal.model.arch import load_arch
    from megatron_areal.model.weights import load_hf_weights
    from megatron_areal.weights.config import WeightsConfig
    from megatron_areal.weights.push import WeightSync

    groups = init_parallel(tp=1, pp=1, backend="gloo")
    arch = load_arch(model_dir)
    chunks = build_model(arch, groups)
    load_hf_weights(chunks, model_dir, arch, 0, 1)
    # the trainer's arrangement: rank 0's weight push drops and re-admits servers in the fleet its rollouts route over
    fleet = Fleet(urls, control_timeout_s=10.0)
    sync = WeightSync(chunks, arch, groups, urls, config=WeightsConfig(timeout_s=10.0, master_address="127.0.0.1"),
                      fleet=fleet)
    _STATE.update(sync=sync, fleet=fleet)


def _w_sync(version: str) -> dict:
    """One sync, and what the rollouts see after it: the fleet's members and its removals and (re-)admissions
    during the sync."""
    routing = _STATE["fleet"].routing
    removed, added = routing.removed, routing.added
    r = _STATE["sync"].sync(version)
    return {"servers": r.servers, "dropped": list(r.dropped), "routed": _STATE["fleet"].urls,
            "removed": routing.removed - removed, "added": routing.added - added}


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    _STATE.pop("sync").close()
    _STATE.pop("fleet").close()
    teardown_parallel()


def _version(url: str) -> str:
    return str(model_info(url)["weight_version"])


@pytest.mark.timeout(300)
def test_weight_sync_readmits_a_restarted_server(tmp_path: Path) -> None:
    from megatron_areal.convert.spawn import WorkerPool
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", seed=3)
    servers = [start_embedded(model), start_embedded(model)]
    keep, victim = servers
    port = int(victim.url.rsplit(":", 1)[1])
    pool = WorkerPool(1, timeout_s=240)
    try:
        pool.run(_w_setup, str(model), [s.url for s in servers])
        r = pool.run(_w_sync, "1")[0]
        assert r["servers"] == r["routed"] == [keep.url, victim.url] and not r["dropped"], r
        assert r["removed"] == r["added"] == 0, r

        # restarted between syncs: it answers with its launch label, is dropped and re-admitted at once
        victim.proc.kill()
        victim.proc.wait(timeout=30)
        servers[1] = victim = start_embedded(model, port=port)
        assert _version(victim.url) == "default"
        r = pool.run(_w_sync, "2")[0]
        assert r["dropped"] == [victim.url] and r["removed"] == r["added"] == 1, r
        assert r["servers"] == r["routed"] == [keep.url, victim.url], r
        assert _version(victim.url) == _version(keep.url) == "2"

        # dead at a sync: dropped, and out of the routing until it is back; back before the next sync: re-admitted
        # there with that sync's weights
        victim.proc.kill()
        victim.proc.wait(timeout=30)
        r = pool.run(_w_sync, "3")[0]
        assert r["dropped"] == [victim.url] and r["removed"] == 1 and r["added"] == 0, r
        assert r["servers"] == r["routed"] == [keep.url], r
        servers[1] = victim = start_embedded(model, port=port)
        r = pool.run(_w_sync, "4")[0]
        assert not r["dropped"] and r["removed"] == 0 and r["added"] == 1, r
        assert r["servers"] == r["routed"] == [keep.url, victim.url], r
        assert _version(victim.url) == _version(keep.url) == "4"
        pool.run(_w_close)
    finally:
        pool.close()
        for s in servers:
            s.stop()


def test_keeper_restarts_with_backoff_then_gives_up(tmp_path: Path) -> None:
    """What the local launcher and the Slurm node agent run: a child that keeps dying is restarted
    ``max_restarts`` times with doubling backoff, on the same command, then given up."""
    from megatron_areal.launch.procs import ProcessSet, ServerKeeper

    procs = ProcessSet(tmp_path / "logs", grace_s=1.0)
    try:
        dies = procs.start("server-0", [sys.executable, "-c", "print('up', flush=True)"])
        lives = procs.start("server-1", [sys.executable, "-c", "import time; time.sleep(60)"])
        keeper = ServerKeeper(procs, {"server-0": dies, "server-1": lives}, {"server-0": "vm-0", "server-1": "vm-1"},
                              max_restarts=2, backoff_s=0.2)
        starts = []
        deadline = time.monotonic() + 30
        while "server-0" not in keeper.given_up:
            assert time.monotonic() < deadline, keeper.summary()
            before = keeper.servers["server-0"]
            keeper.poll()
            if keeper.servers["server-0"] is not before:
                starts.append(time.monotonic())
            time.sleep(0.02)
        assert keeper.restarts["server-0"] == 2 and keeper.total_restarts == 2 and keeper.alive() == 1
        assert len(starts) == 2 and starts[1] - starts[0] >= 0.4  # 0.2 s, then 0.4 s
        assert (tmp_path / "logs/server-0.log").read_text().count("up\n") == 3  # one log, three runs
        assert [c.name for c in procs.children].count("server-0") == 1  # the new process replaced the old
        assert "vm-0 (exited with code 0 after 2 restarts)" in keeper.summary()
        assert keeper.servers["server-1"] is lives and lives.returncode() is None
    finally:
        procs.stop_all()


def test_stopped_embedded_server_leaves_no_folder_but_a_dead_one_keeps_its_log(tmp_path: Path) -> None:
    from megatron_areal.launch.embedded import start_embedded
    from megatron_areal.model.assets import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama", seed=3)
    with start_embedded(model) as server:
        assert server.temp_dir is not None and server.log_path.is_file()
    assert not server.temp_dir.exists()

    dead = start_embedded(model)
    try:
        dead.proc.kill()
        dead.proc.wait(timeout=30)
    finally:
        dead.stop()
    assert dead.log_path.is_file()  # kept: it says why the server died
    dead.log_path.unlink()
    dead.temp_dir.rmdir()

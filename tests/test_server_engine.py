"""The engine in-process: every model family against transformers, sampling, continuous batching."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from engine_jobs import run_jobs

from megatron_areal.server.config import EngineOptions
from megatron_areal.server.engine import Engine, QueueFull
from megatron_areal.server.sampler import SamplingParams, sample
from megatron_areal.server.scheduler import Request, Scheduler

PROMPTS = [[1, 5, 7, 9, 11], [3, 4, 5], [10, 20, 30, 40, 50, 60, 70]]


run = run_jobs


@pytest.fixture
def engine_for(request):
    engines = []

    def make(path, **kw) -> Engine:
        e = Engine(path, EngineOptions(**{"max_running": 4, "context_length": 256, **kw}))
        e.start()
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_family_matches_transformers(family: str, engine_for, request) -> None:
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{family}")
    engine = engine_for(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    greedy = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)
    hot = SamplingParams(max_new_tokens=12, temperature=0.6, ignore_eos=True, seed=7)
    done = run(engine, [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
               + [(f"s{i}", p, hot) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert done[f"g{i}"].output_ids == hf_greedy(hf, prompt, 20)
        assert_logprobs_match(hf, done[f"g{i}"], 1.0)
        assert_logprobs_match(hf, done[f"s{i}"], 0.6)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()


def assert_logprobs_match(hf, r: Request, temp: float) -> None:
    """The request's logprobs are transformers' log_softmax(logits / temp) at its tokens (fp32)."""
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([r.all_ids])).logits[0].float() / temp, -1)
    ref = [lp[len(r.prompt_ids) - 1 + k, t].item() for k, t in enumerate(r.output_ids)]
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref, strict=True)) <= 1e-4


class CountingModel:
    """Wraps the engine's model and records the rows (slot, start, length, first) of each forward;
    ``delay_s`` slows every forward, so that a test can act between steps however fast the machine."""

    def __init__(self, model, delay_s: float = 0.0) -> None:
        self.model, self.forwards, self.delay_s = model, [], delay_s

    def __call__(self, tokens, batch, cache):
        self.forwards.append(batch.rows)
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        return self.model(tokens, batch, cache)


def test_samples_of_one_prompt_prefill_it_once(tiny_llama, engine_for) -> None:
    """Four samples of one prompt, arriving together: one prefills the prompt, the others copy its KV
    and compute only the prompt's last token, and every output is still transformers'."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(tiny_llama)
    counting = engine.model = CountingModel(engine.model)
    prompt = PROMPTS[2]
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    jobs = [("g", prompt, greedy)] + [(f"s{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.8,
                                                                       ignore_eos=True, seed=i)) for i in range(3)]
    done = run(engine, jobs)
    first, second = counting.forwards[:2]
    assert [(start, n) for _, start, n, _ in first] == [(0, len(prompt))]
    assert sorted((start, n) for _, start, n, _ in second) == [(len(prompt) - 1, 1)] * 3 + [(len(prompt), 1)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    assert done["g"].output_ids == hf_greedy(hf, prompt, 12)
    assert_logprobs_match(hf, done["g"], 1.0)
    for i in range(3):
        assert_logprobs_match(hf, done[f"s{i}"], 0.8)
    assert len({tuple(done[f"s{i}"].output_ids) for i in range(3)}) > 1  # they did not share their samples


def test_plan_prefills_a_prompt_once_and_keeps_slots_for_its_group() -> None:
    """Samples that wait for their prompt's first prefill hold slots, so a later prompt cannot take
    them; once the first runs they copy its prompt KV (all but the last prompt token)."""
    sched = Scheduler(max_running=8, max_len=64, eos_ids=(0,))

    def req(rid: str, prompt: list[int]) -> Request:
        return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(), generator=torch.Generator(),
                       on_finish=lambda r: None)

    a = [req(f"a{i}", [1, 2, 3]) for i in range(3)]
    b = [req(f"b{i}", [4, 5]) for i in range(3)]
    sched.waiting.extend(a + b)
    plan = sched.plan(free_slots=4)
    assert plan.prefill == [a[0], b[0]] and plan.shares == []
    assert list(sched.waiting) == a[1:] + b[1:]
    for r in plan.prefill:
        r.cached = len(r.all_ids)
    sched.running += plan.prefill
    plan = sched.plan(free_slots=2)
    assert plan.prefill == a[1:] and plan.shares == [(a[0], a[1], 2), (a[0], a[2], 2)]
    assert list(sched.waiting) == b[1:]


def test_plan_shares_the_longest_common_prefix_a_running_request_holds() -> None:
    """Different prompts that open with the same tokens (a chat template's header) copy them from the
    running request that holds the longest match, and compute only their own tail."""
    sched = Scheduler(max_running=8, max_len=64, eos_ids=(0,))

    def req(rid: str, prompt: list[int]) -> Request:
        return Request(rid=rid, prompt_ids=prompt, params=SamplingParams(), generator=torch.Generator(),
                       on_finish=lambda r: None)

    short, long = req("short", [1, 2, 3, 4]), req("long", [1, 2, 3, 5, 6, 7])
    for r in (short, long):
        r.cached = len(r.all_ids)
    sched.running += [short, long]
    a, b, c = req("a", [1, 2, 3, 5, 6, 9]), req("b", [1, 2, 8]), req("c", [7, 7])
    sched.waiting.extend([a, b, c])
    plan = sched.plan(free_slots=3)
    assert plan.prefill == [a, b, c]
    assert {(d.rid, r.rid, n) for d, r, n in plan.shares} == {("long", "a", 5), ("short", "b", 2)}


def test_prompts_with_a_common_header_prefill_it_once(tiny_llama, engine_for) -> None:
    """Three prompts with a common 6-token header, nothing running: the first prefills alone, the others
    wait one step and copy the header's KV, and every output and logprob is still transformers'."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(tiny_llama)
    counting = engine.model = CountingModel(engine.model)
    header = [2, 9, 14, 3, 8, 21]
    prompts = [header + tail for tail in ([5, 6, 7], [30, 31], [40, 41, 42, 43])]
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    done = run(engine, [(f"p{i}", p, greedy) for i, p in enumerate(prompts)])
    first, second = counting.forwards[:2]
    assert [(start, n) for _, start, n, _ in first] == [(0, len(prompts[0]))]
    assert sorted((start, n) for _, start, n, _ in second) == [(len(header), 2), (len(header), 4), (len(prompts[0]), 1)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert done[f"p{i}"].output_ids == hf_greedy(hf, prompt, 10)
        assert_logprobs_match(hf, done[f"p{i}"], 1.0)


def test_retracted_samples_share_the_prompt_again(tiny_llama, engine_for) -> None:
    """After a retract (as for a weight update) the samples of a prompt are prefilled again: one from
    position 0 (prompt and the tokens so far), and the others, whose greedy tokens so far are the same
    (one step behind: they joined a step later), copy all of theirs but their last token."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(tiny_llama)
    # 5 ms a step: the retract below lands while the samples are mid-sequence, not after they finished
    counting = engine.model = CountingModel(engine.model, delay_s=0.005)
    greedy = SamplingParams(max_new_tokens=150, temperature=0, ignore_eos=True)
    done: dict[str, Request] = {}
    finished = threading.Event()

    def on_finish(r: Request) -> None:
        done[r.rid] = r
        if len(done) == 3:
            finished.set()

    engine.submit([(f"r{i}", PROMPTS[0], greedy) for i in range(3)], on_finish)
    while len(engine.scheduler.running) < 3 or min(len(r.output_ids) for r in engine.scheduler.running) < 4:
        threading.Event().wait(0.002)
    engine.pause("retract")
    engine.resume()
    assert finished.wait(120)
    again = [i for i, rows in enumerate(counting.forwards) if any(start == 0 and n > len(PROMPTS[0])
                                                                  for _, start, n, _ in rows)]
    assert again, f"no prefill after the retract: {len(counting.forwards)} forwards"
    after = counting.forwards[again[0] + 1]  # the first one's decode, and the others' one token each
    assert len(after) == 3 and all(k == 1 and start > len(PROMPTS[0]) for _, start, k, _ in after), after
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ref = hf_greedy(hf, PROMPTS[0], 150)
    for r in done.values():
        assert r.output_ids == ref
        assert_logprobs_match(hf, r, 1.0)


def test_seeded_sampling_independent_of_batch(tiny_llama, engine_for) -> None:
    engine = engine_for(tiny_llama)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=42)
    alone = run(engine, [("a", PROMPTS[0], sp)])["a"].output_ids
    other = SamplingParams(max_new_tokens=30, temperature=1.0, ignore_eos=True)
    crowd = run(engine, [("b", PROMPTS[1], other), ("a", PROMPTS[0], sp), ("c", PROMPTS[2], other)])
    assert crowd["a"].output_ids == alone
    unseeded = run(engine, [("x", PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True)),
                            ("y", PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True))])
    assert unseeded["x"].output_ids != unseeded["y"].output_ids


def test_top_k_top_p_stay_in_support() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.3), SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(temperature=0)]
    top3 = logits.topk(3, dim=-1).indices
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    nucleus = order[1][: int((sorted_p[1].cumsum(0) - sorted_p[1] < 0.3).sum())]
    for seed in range(200):
        gens = [torch.Generator().manual_seed(seed * 4 + i) for i in range(4)]
        tokens, logprobs = sample(logits, params, gens)
        assert tokens[0] in top3[0] and tokens[1] in nucleus
        assert tokens[2] == logits[2].argmax() and tokens[3] == logits[3].argmax()
        # Logprobs come from the temperature-scaled, untruncated distribution (T=1 when greedy).
        assert torch.isclose(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]])
        assert torch.isclose(logprobs[2], torch.log_softmax(logits[2] / 2.0, -1)[tokens[2]])
        assert torch.isclose(logprobs[3], torch.log_softmax(logits[3], -1)[tokens[3]])


def test_short_request_overtakes_long_one(tiny_llama, engine_for) -> None:
    """Continuous batching: a request that joins mid-flight finishes while the long one still runs."""
    engine = engine_for(tiny_llama, max_running=2)
    order: list[str] = []
    finished = threading.Event()

    def on_finish(r: Request) -> None:
        order.append(r.rid)
        if len(order) == 2:
            finished.set()

    engine.submit([("long", PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True))], on_finish)
    while not engine.scheduler.running:
        threading.Event().wait(0.005)
    engine.submit([("short", PROMPTS[1], SamplingParams(max_new_tokens=3, ignore_eos=True))], on_finish)
    assert finished.wait(60)
    assert order == ["short", "long"]
    assert engine.cache.free_slots == 2


def test_slots_bound_running_and_queue_bound_waiting(tiny_llama, engine_for) -> None:
    engine = engine_for(tiny_llama, max_running=2, max_queue=6)
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    done = run(engine, [(str(i), PROMPTS[i % 3], sp) for i in range(6)])
    assert all(len(r.output_ids) == 5 for r in done.values())
    engine.pause("in_place")
    engine.submit([(f"q{i}", [1], sp) for i in range(6)], lambda r: None)
    with pytest.raises(QueueFull):
        engine.submit([("one-too-many", [1], sp)], lambda r: None)
    assert engine.abort(None) == 6


def test_an_admitted_request_leaves_the_queue_before_its_first_forward(tiny_llama, engine_for) -> None:
    """A request the step admits counts as running, not also as waiting, while its prefill runs: else a
    queue of one answers "queue full" to the next request while nothing waits (seen under load)."""
    engine = engine_for(tiny_llama, max_running=1, max_queue=1)
    engine.model = CountingModel(engine.model, delay_s=1.0)  # a slow prefill, however fast the machine
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.submit([("first", PROMPTS[0], sp)], lambda r: None)
    while not engine.scheduler.running:
        threading.Event().wait(0.005)
    assert engine.load() == (1, 0)
    assert engine.has_room(1)
    engine.submit([("second", PROMPTS[1], sp)], lambda r: None)  # waits for the slot, no QueueFull


def test_a_weight_install_counts_each_queued_request_once(tiny_llama) -> None:
    """Requests not yet taken in by the runner count once after an install (which retracts the running
    ones to the queue): a count of two for one request would refuse the next with "queue full"."""
    engine = Engine(tiny_llama, EngineOptions(max_running=1, max_queue=2, context_length=256))  # not started
    try:
        engine.submit([("waiting", PROMPTS[0], SamplingParams(max_new_tokens=2))], lambda r: None)
        engine.update_from_disk(str(tiny_llama), "v1")
        assert engine.load() == (0, 1)
        assert engine.has_room(1)
    finally:
        engine.stop(timeout_s=1)


def test_stop_rules_and_context_limit(tiny_llama, engine_for) -> None:
    engine = engine_for(tiny_llama, context_length=16)
    greedy = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    res = run(engine, [("c", [1, 2, 3, 4], SamplingParams(**greedy))])["c"]
    assert res.finish_reason == {"type": "length", "length": 12} and len(res.all_ids) == 16
    target = res.output_ids[2]
    k = res.output_ids.index(target)
    stopped = run(engine, [("s", [1, 2, 3, 4], SamplingParams(**greedy, stop_token_ids=(target,)))])["s"]
    assert stopped.output_ids == res.output_ids[: k + 1] and stopped.finish_reason == {"type": "stop",
                                                                                     "matched": target}
    # min_new_tokens masks the stop until enough tokens exist; EOS counts as a stop unless ignore_eos.
    late = run(engine, [("m", [1, 2, 3, 4], SamplingParams(**greedy, stop_token_ids=(target,),
                                                           min_new_tokens=k + 2))])["m"]
    assert len(late.output_ids) > k + 1
    assert run(engine, [("z", [1, 2], SamplingParams(max_new_tokens=0))])["z"].output_ids == []
    eos_run = run(engine, [("e", [1, 2, 3, 4], SamplingParams(max_new_tokens=12, temperature=0))])["e"]
    expected = next((i for i, t in enumerate(res.output_ids) if t in engine.scheduler.eos_ids), None)
    assert eos_run.output_ids == res.output_ids[: (expected + 1) if expected is not None else 12]


@pytest.mark.slow
def test_smollm2_text_prompt_matches_transformers(smollm2, engine_for) -> None:
    """A real model and tokenizer: greedy tokens and logprobs equal transformers' (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_areal.server.tokenizer import load_tokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = load_tokenizer(smollm2).encode(text)
    assert ids == tok.encode(text)
    engine = engine_for(smollm2, max_running=2, context_length=128)
    res = run(engine, [("q", ids, SamplingParams(max_new_tokens=12, temperature=0))])["q"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert res.output_ids == ref
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([res.all_ids])).logits[0].float(), -1)
    ref_lp = [lp[len(ids) - 1 + k, t].item() for k, t in enumerate(res.output_ids)]
    assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref_lp, strict=True)) <= 1e-4


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch.rms_norm, fp32 weight
def test_rms_norm_rounds_once_as_sglang_and_the_trainer_do() -> None:
    """In bf16 the server's RMSNorm is SGLang's default form (scale by the weight in fp32, round
    once): bitwise what ``torch.rms_norm`` gives (bf16 input, bf16 or fp32 weight), as the trainer's
    local-spec norm does, and closer to the exact value than transformers' round-twice form."""
    from megatron_areal.server.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 48, generator=g) * 0.3).bfloat16()
    w = (1.0 + 0.1 * torch.randn(48, generator=g)).bfloat16()
    norm = RMSNorm(48, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(w)
        out = norm(x)
    assert out.dtype == torch.bfloat16
    x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    transformers_form = w * x32.bfloat16()
    # bitwise on the machine this was written on; another CPU's kernel may sum the squares in
    # another order and round a rare output the other way, so at most 1% may differ (the
    # transformers form differs in about a quarter of them)
    for weight in (w, w.float()):  # bf16 as the trainer's local-spec norm holds it (patches/rms_norm.py)
        ref = torch.rms_norm(x, (48,), weight, 1e-6)
        assert (out != ref).float().mean() <= 0.01
        assert (transformers_form != ref).float().mean() > 0.1
    x64 = x.double()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert (out.double() - exact).norm() < (transformers_form.double() - exact).norm()
    norm32 = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm32.weight.copy_(w.float())
        assert torch.equal(norm32(x.float()), w.float() * x32)  # fp32: the two forms are the same


def test_building_the_engine_leaves_no_openmp_team_beside_the_runners(tiny_llama) -> None:
    """The engine is built on one thread (the server's loader) and stepped on another (the runner).
    A loader that computed with several threads kept an OpenMP team of its own, and with more OpenMP
    threads than CPUs libgomp sleeps at every barrier: a 2-thread server decoded no faster than a
    1-thread one (server/one_thread.py). Building with 2 threads must start no thread."""
    counts: dict[str, int] = {}

    def build() -> None:
        torch.set_num_threads(2)
        counts["before"] = len(os.listdir("/proc/self/task"))
        engine = Engine(tiny_llama, EngineOptions(max_running=32, context_length=512))
        counts["after"] = len(os.listdir("/proc/self/task"))
        counts["threads"] = torch.get_num_threads()
        del engine

    before = torch.get_num_threads()
    loader = threading.Thread(target=build)
    loader.start()
    loader.join()
    torch.set_num_threads(before)
    assert counts["after"] == counts["before"], counts
    assert counts["threads"] == 2  # the thread count is given back afterwards


def test_the_runner_computes_with_the_threads_the_engine_was_built_with(tiny_llama) -> None:
    """``one_thread`` sets torch's process-wide count to 1 while it runs and puts back what its own thread
    had; two weight operations overlapping on two threads can leave 1 behind. A runner whose first
    tensor operation came after that would compute on one thread for the rest of its life."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    engine = Engine(tiny_llama, EngineOptions(max_running=4, context_length=64))
    try:
        torch.set_num_threads(1)  # what overlapping one_thread sections can leave behind
        engine.start()
        done = threading.Event()
        engine.submit([("a", PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))],
                      lambda r: (seen.append(torch.get_num_threads()), done.set()))  # on the runner thread
        assert done.wait(60)
    finally:
        engine.stop()
        torch.set_num_threads(before)
    assert seen == [2]


@pytest.mark.parametrize("adopt", [False, True], ids=["copied", "adopted"])
def test_installed_weights_are_what_the_next_forward_computes_with(tiny_llama, engine_for, adopt: bool) -> None:
    """After a weight install (copied into the parameters, or adopted as their storage as a shard push does),
    the engine's outputs are transformers' on the new weights: no layer keeps computing with a copy of the
    old ones (the fp32 linear layers run from packed copies of their weights)."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(tiny_llama)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    run(engine, [("warm", PROMPTS[0], greedy)])  # the packed copies are made from the old weights
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new = {n: t.detach().clone() for n, t in hf.state_dict().items() if n in engine.model.state_dict()}
    engine._install(new, "v1", complete=False, replaced=[] if adopt else None)
    done = run(engine, [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert done[f"g{i}"].output_ids == hf_greedy(hf, prompt, 12)
        assert_logprobs_match(hf, done[f"g{i}"], 1.0)


def test_pushes_into_the_memory_of_replaced_weights_compute_with_the_new_ones(tiny_llama, engine_for) -> None:
    """A shard push receives into the tensors the push before it replaced (``engine.spares``): the weights
    of two versions ago. After each such install the engine's outputs are transformers' on the newest
    weights (no packed fp32 copy is mistaken for current because its memory came back), and from the
    third push on the parameters live in memory they held before."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(tiny_llama)
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    run(engine, [("warm", PROMPTS[0], greedy)])
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    names = [n for n in hf.state_dict() if n in dict(engine.model.named_parameters())]
    addresses: list[set[int]] = []
    for version in range(1, 5):
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        received = {}
        for n in names:  # what the receive does: write each tensor into a spare when there is one
            t = hf.state_dict()[n]
            received[n] = engine.spares.take(t.shape, t.dtype, t.device).copy_(t)
        replaced: list[torch.Tensor] = []
        engine._install(received, str(version), complete=False, replaced=replaced)
        del received
        assert replaced and all(engine.spares.give(t) for t in replaced)
        del replaced
        params = dict(engine.model.named_parameters())
        addresses.append({params[n].data_ptr() for n in names})
        done = run(engine, [(f"v{version}-{i}", p, greedy) for i, p in enumerate(PROMPTS)])
        for i, prompt in enumerate(PROMPTS):
            assert done[f"v{version}-{i}"].output_ids == hf_greedy(hf, prompt, 12), f"push {version}"
            assert_logprobs_match(hf, done[f"v{version}-{i}"], 1.0)
    assert addresses[2] == addresses[0] and addresses[3] == addresses[1] and addresses[0] != addresses[1]

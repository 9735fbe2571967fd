"""``score``: Megatron logprobs at TP/PP layouts equal transformers' logprobs (fp32, <= 1e-4).

Tiny Llama / Qwen2 (GQA, qkv bias, tied) / Qwen3 (q/k norm, untied) run at TP1, TP2, PP2 and
TP2 PP2 in one four-rank pool (TP1 and the single-axis layouts use the spare ranks as DP).
SmolLM2-135M has 9 query and 3 KV heads, so its tensor-parallel size is 3: it is converted at
TP3 PP2 (checked bitwise on the way back) and scored at TP1, TP3, PP2 and TP3 PP2 in a six-rank
pool. References are computed in this process with transformers, which never sees the CPU patch
the worker processes apply to megatron-core.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from megatron_areal.actor.shared_prefix import prefix_units
from megatron_areal.convert.convert import hf_to_mcore, mcore_to_hf
from megatron_areal.convert.score import InputFileError, main, read_sequences, score
from megatron_areal.convert.spawn import WorkerPool

TOLERANCE = 1e-4


def hf_logprobs(hf_dir, sequences: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return model_logprobs(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), sequences)


def model_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's token logprobs under an HF-style ``model`` (a transformers or PEFT model), fp32."""
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


def max_diff(got: list[list[float]], ref: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(r) for r in ref]
    return max((torch.tensor(g) - r).abs().max().item() for g, r in zip(got, ref, strict=True))


def random_sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def groups_sharing_prompts(prompts: list[list[int]], answers: list[list[list[int]]]) -> list[list[int]]:
    """Each prompt followed by each of its answers, as a GRPO group's samples are; checks that the
    actor's grouping (actor/shared_prefix.py) lays every group's prompt out once."""
    sequences = [p + a for p, group in zip(prompts, answers, strict=True) for a in group]
    units = prefix_units(sequences, range(len(sequences)))
    assert sorted(len(u.members) for u in units) == sorted(len(g) for g in answers), units
    return sequences


class TestTinyModels:
    @pytest.fixture(scope="class")
    def pool(self):
        with WorkerPool(4, timeout_s=600) as p:
            yield p

    @pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
    def test_logprobs_match_transformers_at_every_layout(self, fixture, request, pool):
        hf_dir = request.getfixturevalue(fixture)
        sequences = random_sequences(128, [2, 23, 9, 31, 16])
        ref = hf_logprobs(hf_dir, sequences)
        for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
            got = score("hf", hf_dir, sequences, tp=tp, pp=pp, pool=pool)
            assert max_diff(got, ref) <= TOLERANCE, (fixture, tp, pp)

    @pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
    def test_groups_sharing_a_prompt_match_transformers_at_every_layout(self, fixture, request, pool):
        # the prompt is computed once per group in the actor, every sample separately in transformers
        hf_dir = request.getfixturevalue(fixture)
        prompts = random_sequences(128, [14, 21], seed=2)
        answers = [random_sequences(128, [1, 6, 11], seed=3), random_sequences(128, [9, 3], seed=4)]
        sequences = groups_sharing_prompts(prompts, answers) + random_sequences(128, [17], seed=5)
        ref = hf_logprobs(hf_dir, sequences)
        for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
            got = score("hf", hf_dir, sequences, tp=tp, pp=pp, pool=pool)
            assert max_diff(got, ref) <= TOLERANCE, (fixture, tp, pp)

    def test_temperature_scales_logits(self, tiny_qwen3, pool):
        sequences = random_sequences(128, [12, 7], seed=1)
        got = score("hf", tiny_qwen3, sequences, tp=2, pp=2, temperature=0.5, pool=pool)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
        ref = []
        with torch.no_grad():
            for seq in sequences:
                ids = torch.tensor([seq])
                logp = torch.log_softmax(model(ids).logits[0, :-1] / 0.5, dim=-1)
                ref.append(logp.gather(-1, ids[0, 1:, None])[:, 0])
        assert max_diff(got, ref) <= TOLERANCE


def test_smollm2_groups_sharing_a_chat_prompt_match_transformers(smollm2):
    # real weights, the main job's chat template and arithmetic prompts, samples that answer differently
    from transformers import AutoTokenizer

    from megatron_areal.data.arithmetic import arithmetic_train
    from megatron_areal.data.template import encode_prompt

    tok = AutoTokenizer.from_pretrained(smollm2)
    problems = arithmetic_train(seed=0, size=2)
    prompts = [encode_prompt(tok, p, use_chat_template=True) for p in problems]
    answers = [[tok(t, add_special_tokens=False).input_ids for t in texts]
               for texts in (["The answer is 12.", "12", "Let me think: 5 + 7 = 12. So 12."],
                             ["-3", "The result is 4<|im_end|>"])]
    sequences = groups_sharing_prompts(prompts, answers)
    assert max_diff(score("hf", smollm2, sequences), hf_logprobs(smollm2, sequences)) <= TOLERANCE


class TestSmolLM2:
    @pytest.fixture(scope="class")
    def pool(self):
        with WorkerPool(6, timeout_s=900) as p:
            yield p

    @pytest.mark.slow
    def test_convert_round_trip_and_logprobs_at_every_layout(self, smollm2, pool, tmp_path):
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        ckpt = hf_to_mcore(smollm2, tmp_path / "ckpt", tp=3, pp=2, pool=pool)
        back = mcore_to_hf(ckpt, tmp_path / "hf")
        a, b = load_file(str(smollm2 / "model.safetensors")), load_file(str(back / "model.safetensors"))
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)

        tok = AutoTokenizer.from_pretrained(smollm2)
        texts = ["What is 12 + 7? The answer is 19.", "def add(a, b):\n    return a + b", "Paris is the capital of"]
        sequences = [tok(t).input_ids for t in texts]
        ref = hf_logprobs(smollm2, sequences)
        for tp, pp in [(1, 1), (3, 1), (1, 2), (3, 2)]:
            got = score("ckpt", ckpt, sequences, tp=tp, pp=pp, pool=pool)
            assert max_diff(got, ref) <= TOLERANCE, (tp, pp)


def test_cli_writes_one_line_per_sequence(tiny_qwen2, tmp_path, capsys):
    sequences = random_sequences(128, [5, 14, 3], seed=2)
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in sequences))
    out = tmp_path / "out.jsonl"
    assert main(["--hf", str(tiny_qwen2), "--input", str(seqs), "--output", str(out), "--tp", "2"]) == 0
    rows = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    assert max_diff(rows, hf_logprobs(tiny_qwen2, sequences)) <= TOLERANCE
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["sequences"] == 3


@pytest.mark.parametrize(("line", "message"), [
    ('{"ids": [1, 2]}', r"seqs\.jsonl:2: expected"),
    ('{"input_ids": [1]}', r"seqs\.jsonl:2: input_ids must be a list of at least 2"),
    ('{"input_ids": [1, 999]}', r"seqs\.jsonl:2: token id 999 outside the vocabulary \[0, 128\)"),
    ("not json", r"seqs\.jsonl:2: expected"),
])
def test_bad_input_line_names_file_and_line(line, message, tmp_path):
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text('{"input_ids": [1, 2, 3]}\n' + line + "\n")
    with pytest.raises(InputFileError, match=message):
        read_sequences(seqs, 128)


def test_cli_bad_input_leaves_no_output(tiny_llama, tmp_path, capsys):
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text('{"input_ids": [1, 500]}\n')
    out = tmp_path / "out.jsonl"
    assert main(["--hf", str(tiny_llama), "--input", str(seqs), "--output", str(out)]) == 1
    assert "seqs.jsonl:1: token id 500" in capsys.readouterr().err
    assert not out.exists()

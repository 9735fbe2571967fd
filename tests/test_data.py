"""Data: JSONL datasets, built-in tasks from installed packages, templates, the prompt stream."""
from __future__ import annotations

import json
import operator
import re
from pathlib import Path

import pytest

from megatron_areal.data import DataError, Prompt, PromptStream, encode_prompt, load_datasets, load_jsonl, load_task
from megatron_areal.data.arithmetic import HELD_OUT_POOL
from megatron_areal.data.config import DataConfig
from megatron_areal.reward.arithmetic import verify_number


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- JSONL -------------------------------------------------------------------------------------

def test_jsonl_records(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        json.dumps({"prompt": "What is 2+2?", "answer": "4"}),
        "",
        json.dumps({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
                    "answer": 2, "task": "arithmetic"}),
        json.dumps({"prompt": "Write f.", "task": "code", "tests": "assert f() == 1", "entry_point": "f"}),
    ])
    a, b, c = load_jsonl(path)
    assert (a.index, a.text, a.answer, a.task) == (0, "What is 2+2?", "4", "math")
    assert b.index == 1 and b.messages[1] == {"role": "user", "content": "1+1?"} and b.answer == 2
    assert b.as_messages()[0]["role"] == "system"
    assert c.reward_answer() == {"tests": "assert f() == 1", "entry_point": "f", "prefix": ""}


@pytest.mark.parametrize("bad_line,message", [
    ('{"prompt": "x", "answer": ', "invalid JSON"),
    ('["prompt", "answer"]', "expected a JSON object"),
    ('{"answer": "1"}', "missing key 'prompt'"),
    ('{"prompt": "x"}', "missing key 'answer'"),
    ('{"prompt": 7, "answer": "1"}', "'prompt' must be a string or a list"),
    ('{"prompt": "x", "answer": {"a": 1}}', "'answer' must be a string or a number"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', "prompt[0] must be an object"),
    ('{"prompt": "x", "task": "code"}', "needs a non-empty 'tests'"),
    ('{"prompt": "x", "answer": "1", "task": 3}', "'task' must be a string"),
    ('{"prompt": "x", "answer": "1", "anwser": "1"}', "unknown key"),
])
def test_malformed_record_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    good = json.dumps({"prompt": "ok", "answer": "1"})
    path = _write(tmp_path, [good, good, bad_line, good])
    with pytest.raises(DataError) as info:
        load_jsonl(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_load_task_by_path_and_unknown_name(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": f"p{i}", "answer": i}) for i in range(5)])
    assert [p.text for p in load_task(str(path), size=3)] == ["p0", "p1", "p2"]
    with pytest.raises(DataError, match="neither a built-in task .*math500"):
        load_task("math-500")
    with pytest.raises(DataError, match="no such dataset file"):
        load_task(str(tmp_path / "missing.jsonl"))


def test_load_datasets_from_config(tmp_path: Path) -> None:
    train, held_out = load_datasets(DataConfig(train="arithmetic", train_size=50, eval="aime2024", eval_size=0))
    assert len(train) == 50 and len(held_out) == 30
    assert load_datasets(DataConfig(train="math500", eval=""))[1] == []
    with pytest.raises(DataError, match=r"^data\.train: .*neither a built-in task"):
        load_datasets(DataConfig(train=str(tmp_path / "nope")))


# ---- built-in tasks ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,count,task", [("math500", 311, "math"), ("aime2024", 30, "math"),
                                             ("aime2025", 15, "math"), ("humaneval", 164, "code")])
def test_packaged_tasks_load_offline(name: str, count: int, task: str) -> None:
    prompts = load_task(name)
    assert len(prompts) == count
    assert [p.index for p in prompts] == list(range(count))
    assert all(p.task == task and p.text and p.answer not in (None, "") for p in prompts)
    assert len(load_task(name, size=5)) == 5


def test_aime2024_known_answer_and_humaneval_fields() -> None:
    aime = load_task("aime2024")
    assert aime[0].text.startswith("Every morning Aya goes for a $9$-kilometer-long walk")
    assert aime[0].answer == "204"
    problem = load_task("humaneval")[0]
    assert problem.entry_point == "has_close_elements" and "def check(candidate)" in problem.tests
    assert problem.code_prefix in problem.text


@pytest.mark.parametrize("name", ["gsm_symbolic", "basic_arithmetic"])
def test_reasoning_gym_tasks_are_seeded(name: str) -> None:
    first = load_task(name, seed=3, size=8)
    assert [p.text for p in first] == [p.text for p in load_task(name, seed=3, size=8)]
    assert [p.text for p in first] != [p.text for p in load_task(name, seed=4, size=8)]
    assert all(p.task == "arithmetic" and re.fullmatch(r"-?\d+(\.\d+)?", p.answer) for p in first)


_ARITH = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Put the final answer in \\boxed\{\}\.")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def test_arithmetic_generator() -> None:
    train = load_task("arithmetic", seed=7, size=3000)
    assert [p.text for p in train] == [p.text for p in load_task("arithmetic", seed=7, size=3000)]
    assert [p.text for p in train[:50]] != [p.text for p in load_task("arithmetic", seed=8, size=50)]
    ops = set()
    for p in train:
        a, op, b = _ARITH.fullmatch(p.text).groups()
        a, b = int(a), int(b)
        assert 0 <= a < 100 and 0 <= b < (13 if op == "*" else 100)
        assert int(p.answer) == _OPS[op](a, b)
        assert verify_number(f"{p.text} = {p.answer}", p.answer).reward == 1.0
        ops.add(op)
    assert ops == {"+", "-", "*"}


def test_arithmetic_eval_is_fixed_and_held_out() -> None:
    held_out = load_task("arithmetic-eval", seed=0, size=HELD_OUT_POOL)
    assert [p.text for p in load_task("arithmetic-eval", seed=99, size=200)] == [p.text for p in held_out[:200]]
    assert len({p.text for p in held_out}) == HELD_OUT_POOL
    train = {p.text for seed in (0, 1) for p in load_task("arithmetic", seed=seed, size=20000)}
    assert not train & {p.text for p in held_out}


# ---- chat template -----------------------------------------------------------------------------

def test_encode_prompt_with_and_without_chat_template() -> None:
    from megatron_areal.model.assets import tiny_tokenizer
    tok = tiny_tokenizer()
    prompt = Prompt(index=0, text="2+2?", answer="4")
    ids = encode_prompt(tok, prompt, use_chat_template=True)
    assert tok.decode(ids) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert encode_prompt(tok, prompt, use_chat_template=False) == tok("2+2?")["input_ids"]
    convo = Prompt(index=1, messages=({"role": "system", "content": "S"}, {"role": "user", "content": "U"}),
                   answer="1")
    assert tok.decode(encode_prompt(tok, convo, True)).startswith("<|im_start|>system\nS<|im_end|>\n")
    with pytest.raises(DataError, match="needs data.chat_template=true"):
        encode_prompt(tok, convo, use_chat_template=False)
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_prompt(tok, prompt, use_chat_template=True)


# ---- the prompt stream -------------------------------------------------------------------------

def _prompts(n: int) -> list[Prompt]:
    return [Prompt(index=i, text=f"q{i}", answer=str(i)) for i in range(n)]


def test_stream_epochs_are_seeded_permutations() -> None:
    stream = PromptStream(_prompts(7), seed=5)
    first, second = [p.index for p in stream.take(7)], [p.index for p in stream.take(7)]
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    assert [p.index for p in PromptStream(_prompts(7), seed=5).take(14)] == first + second
    assert [p.index for p in PromptStream(_prompts(7), seed=6).take(7)] != first


def test_stream_resume_continues_the_uninterrupted_sequence() -> None:
    reference = [p.index for p in PromptStream(_prompts(7), seed=1).take(30)]
    stream = PromptStream(_prompts(7), seed=1)
    consumed = [p.index for p in stream.take(10)]  # crosses an epoch boundary
    state = json.loads(json.dumps(stream.state_dict()))  # what a checkpoint stores
    restored = PromptStream(_prompts(7), seed=1)
    restored.load_state_dict(state)
    assert consumed + [p.index for p in restored.take(20)] == reference


def test_stream_requeued_in_flight_prompts_are_neither_lost_nor_repeated() -> None:
    stream = PromptStream(_prompts(9), seed=2)
    handed_out = [p.index for p in stream.take(12)]
    finished, in_flight = handed_out[:8], handed_out[8:]  # 4 were on the servers at the checkpoint
    state = stream.state_dict()
    restored = PromptStream(_prompts(9), seed=2)
    restored.load_state_dict(state)
    restored.push_back(in_flight)
    after = [p.index for p in restored.take(2 * 9 - 8)]
    assert after[:4] == in_flight
    used = finished + after
    assert sorted(used) == sorted(list(range(9)) * 2)  # two full epochs: each prompt exactly twice


def test_stream_refuses_a_different_dataset() -> None:
    state = PromptStream(_prompts(7), seed=1).state_dict()
    with pytest.raises(DataError, match="size"):
        PromptStream(_prompts(8), seed=1).load_state_dict(state)
    other = [Prompt(index=i, text=f"other{i}", answer="0") for i in range(7)]
    with pytest.raises(DataError, match="fingerprint"):
        PromptStream(other, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="outside the dataset"):
        PromptStream(_prompts(7)).push_back([7])

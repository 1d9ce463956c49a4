"""Demonstrations for the warm-up (`warmup.data`): every bad row gets one line naming the file,
the line, the field and what to do; good rows are tokenized as a rollout tokenizes an episode
(the character tokenizer's project format, an HF tokenizer's own chat template), with the loss
on the assistant turns only; the start check reads the file and the warm-up runs on a
model.hf_path checkpoint when it is given."""
from __future__ import annotations

import json
import random

import pytest

from laminar_hpc.config.env import EnvCfg
from laminar_hpc.config.load import config_from_dict
from laminar_hpc.model.tokenizer import CharTokenizer
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.sources.demo_tokens import DemoRows, demo_rows
from laminar_hpc.tasks.sources.demos import DemoError, load_demos
from laminar_hpc.tasks.tools.episode import HermesFormat
from laminar_hpc.tasks.preflight import StartCheckError, check_start, check_warmup, warmup_runs
from laminar_hpc.tasks.sources.toolcalc import ToolCalcTasks, demonstration
from laminar_hpc.trainer.warmup_episodes import demo_sequence

TOK = CharTokenizer()
ENV = EnvCfg(tools={"calc": "calculator"}, max_turns=3)
CALL = '<tool_call>{"name": "calc", "arguments": {"x": "6*7"}}</tool_call>'


def conv(*turns) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = conv(("user", "mul:6*7="), ("assistant", CALL), ("tool", "42"), ("assistant", "42"))


def write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_a_good_file_loads_as_prompt_and_episode(tmp_path):
    demos = load_demos(write(tmp_path / "d.jsonl", [GOOD, conv(("system", "be brief"), ("user", "hi"),
                                                               ("assistant", "hello"))]), ENV)
    assert [d.line for d in demos] == [1, 2]
    assert [m["role"] for m in demos[0].prompt] == ["user"] and demos[0].tool_calls == 1
    assert [m["role"] for m in demos[1].prompt] == ["system", "user"] and demos[1].tool_calls == 0


BAD = [  # (row, the field its line names, words of what to do)
    ('{"messages": [', "(the line)", "JSON"),
    ({"msgs": []}, "messages", '{"messages"'),
    (conv(("user", "q"), ("robot", "a")), "messages[1].role", "use system, user, assistant or tool"),
    (conv(("user", "q"), ("system", "s"), ("assistant", "a")), "messages[1].role", "put the system message first"),
    (conv(("user", "q"), ("assistant", CALL), ("tool", "42"), ("user", "more?"), ("assistant", "42")),
     "messages[3].role", "keep system and user messages before"),
    (conv(("user", "q"), ("assistant", "42"), ("tool", "42")), "messages[2].role", "make the assistant turn"),
    (conv(("user", "q"), ("assistant", CALL.replace("calc", "calk")), ("tool", "42"), ("assistant", "42")),
     "messages[1].content", "add it to env.tools"),
    (conv(("user", "q"), ("assistant", CALL + " then"), ("tool", "42"), ("assistant", "42")),
     "messages[1].content", "end the assistant message with the call"),
    (conv(("user", "q"), ("assistant", CALL + CALL), ("tool", "42"), ("tool", "42"), ("assistant", "42")),
     "messages[1].content", "env.stop_at_call: false"),
    (conv(("user", "q"), ("assistant", "<tool_call>{not json}</tool_call>"), ("tool", "?"), ("assistant", "0")),
     "messages[1].content", "<tool_call>"),
    (conv(("user", "q"), ("assistant", CALL), ("assistant", "42")), "messages[2].role", "one tool message per call"),
    (conv(("user", "q"), ("assistant", CALL)), "messages[1]", "add the tool's result"),
    (conv(("user", "q")), "messages", "end the conversation with the answer"),
    (conv(("assistant", "42")), "messages", "user message"),
    ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "7"}]}, "messages[0].content",
     "as text"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                                                       "tool_calls": [{"name": "calc"}]}]},
     "messages[1].tool_calls", "write the call in the content"),
    (conv(("user", "q"), *[("assistant", CALL), ("tool", "42")] * 3, ("assistant", "42")), "messages",
     "raise env.max_turns"),
]


@pytest.mark.parametrize("row,field,fix", BAD, ids=[f"{b[1]}:{b[2][:20]}" for b in BAD])
def test_a_bad_row_gets_one_line_naming_file_line_field_and_fix(tmp_path, row, field, fix):
    path = write(tmp_path / "demos.jsonl", [GOOD, row])
    with pytest.raises(DemoError) as err:
        load_demos(path, ENV)
    assert err.value.total == 1 and len(err.value.lines) == 1
    line = err.value.lines[0]
    assert "\n" not in line and line.startswith(f"warmup.data: {path} line 2: {field} "), line
    assert fix in line, line


def test_every_bad_row_is_listed_one_a_line(tmp_path):
    rows = [GOOD, conv(("user", "q")), GOOD, conv(("user", "q"), ("robot", "a")), {"x": 1}]
    with pytest.raises(DemoError) as err:
        load_demos(write(tmp_path / "d.jsonl", rows), ENV)
    assert err.value.total == 3 and [ln.split(" line ")[1].split(":")[0] for ln in err.value.lines] == ["2", "4", "5"]
    assert str(err.value).endswith("(and 2 more bad rows)")


def test_without_tools_a_demo_is_a_plain_answer(tmp_path):
    assert len(load_demos(write(tmp_path / "d.jsonl", [conv(("user", "2+2="), ("assistant", "4"))]), EnvCfg())) == 1
    with pytest.raises(DemoError, match=r"line 1: messages\[1\].content makes a tool call, but the run has no tools"):
        load_demos(write(tmp_path / "d.jsonl", [GOOD]), EnvCfg())


def test_a_missing_or_empty_file_is_one_line(tmp_path):
    with pytest.raises(DemoError, match="none.jsonl: no such file.*; set warmup.data to a JSONL file"):
        load_demos(tmp_path / "none.jsonl", ENV)
    with pytest.raises(DemoError, match="holds no demonstrations"):
        load_demos(write(tmp_path / "empty.jsonl", []), ENV)


def test_char_tokenizer_demos_are_the_episodes_the_tool_task_teaches(tmp_path):
    """A demonstration written as a conversation tokenizes exactly as the built-in tool task's
    own demonstration of the same problem (trainer/warmup_episodes.py), loss mask included."""
    task = ToolCalcTasks(0)
    rows = []
    for i in range(5):
        p = task.problem(i)
        (_, call), (_, obs), (_, answer) = demonstration(p)
        rows.append(conv(("user", p.prompt), ("assistant", call),
                         ("tool", obs.removeprefix("<tool_response>").removesuffix("</tool_response>")),
                         ("assistant", answer)))
    demos = demo_rows(write(tmp_path / "d.jsonl", rows), task, TOK, ENV, max_len=200, seed=0)
    for i in range(5):
        want = demo_sequence(task, TOK, task.problem(i), noise=0.0, rng=random.Random(0), max_len=200)
        assert demos.sequence(i) == want
    seq, mask, p0 = demos.sequence(0)
    p = task.problem(0)
    assert TOK.decode([t for t, m in zip(seq, mask) if m]) == demonstration(p)[0][1] + p.answer


def test_text_prompts_take_one_user_message_in_the_tasks_template(tmp_path):
    class Text:  # a dataset task whose prompts are text: "{prompt}\nAnswer: "
        template = "{prompt}\nAnswer: "

        def problem(self, i):
            return Problem(i, "x", "1")

    path = write(tmp_path / "d.jsonl", [conv(("user", "2+2"), ("assistant", "4"))])
    seq, mask, p0 = demo_rows(path, Text(), TOK, EnvCfg(), max_len=64, seed=0).sequence(0)
    assert seq == [TOK.bos_id] + TOK.encode("2+2\nAnswer: 4") + [TOK.eos_id] and sum(mask) == 2
    path = write(tmp_path / "d.jsonl", [conv(("system", "s"), ("user", "2+2"), ("assistant", "4"))])
    with pytest.raises(DemoError, match="line 1: messages hold system [+] user before the first assistant turn, and "
                                        "the task's prompts are text"):
        demo_rows(path, Text(), TOK, EnvCfg(), max_len=64, seed=0)


def test_hf_chat_template_renders_the_whole_conversation(tmp_path):
    """With a chat template the demonstration's tokens are the template's rendering of the whole
    conversation (tool turns as the template writes role 'tool'), and the learned tokens are the
    assistant contents, each with its end-of-turn token."""
    pytest.importorskip("transformers", reason="an HF tokenizer needs transformers (extra hf)")
    from recipes import chat_tokenizer

    from laminar_hpc.model.hf import HFTokenizer
    tok = HFTokenizer.from_path(chat_tokenizer(tmp_path / "tok"))

    class Chat:
        def problem(self, i):
            return Problem(i, "q", "1", chat=True)

    path = write(tmp_path / "d.jsonl", [GOOD])
    rows = demo_rows(path, Chat(), tok, ENV, max_len=512, seed=0)
    seq, mask, p0 = rows.sequence(0)
    whole = tok.hf.apply_chat_template(GOOD["messages"], tokenize=False)
    assert tok.hf.decode(seq) == whole.removesuffix("\n")  # the episode ends at the last turn's end-of-turn token
    assert seq[:p0] == encode_prompt(tok, Problem(0, "", "", chat=True, messages=tuple(GOOD["messages"][:1])))
    learned = tok.hf.decode([t for t, m in zip(seq, mask) if m])
    assert learned == CALL + "<|im_end|>42<|im_end|>"


def test_batches_draw_every_demo_once_an_epoch_in_a_new_order(tmp_path):
    rows = [conv(("user", f"q{i}"), ("assistant", str(i))) for i in range(6)]
    demos = DemoRows(load_demos(write(tmp_path / "d.jsonl", rows), EnvCfg()), TOK, HermesFormat(), chat=False,
                     max_len=32, seed=0)
    firsts = [TOK.decode(s[1:3]) for step in (1, 2, 3) for s in demos.batch(step, 2)[0]]
    assert sorted(firsts) == [f"q{i}" for i in range(6)]
    second = [TOK.decode(s[1:3]) for step in (4, 5, 6) for s in demos.batch(step, 2)[0]]
    assert sorted(second) == sorted(firsts) and second != firsts


def _cfg(tmp_path, demos_path, **extra) -> object:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"question": f"mul:{i}*7=", "answer": str(7 * i)}) + "\n"
                                                  for i in range(2, 9)))
    raw = {"task": {"type": "dataset", "path": str(tmp_path / "train.jsonl"), "answer_format": "plain",
                    "prompt_template": "{prompt}", "reward": "exact"},
           "env": {"tools": {"calc": "calculator"}}, "warmup": {"data": demos_path}, **extra}
    return config_from_dict(raw)


def test_the_start_check_reads_the_demonstrations(tmp_path, capsys):
    good = write(tmp_path / "good.jsonl", [GOOD])
    assert check_start(_cfg(tmp_path, good), tokenizer=CharTokenizer) == []
    one = write(tmp_path / "one.jsonl", [GOOD, conv(("user", "q"), ("assistant", CALL.replace("calc", "calk")),
                                                    ("tool", "1"), ("assistant", "1"))])
    with pytest.raises(StartCheckError, match=r"^warmup.data: .*one.jsonl line 2: messages\[1\].content calls 'calk'"):
        check_start(_cfg(tmp_path, one), tokenizer=CharTokenizer)
    many = write(tmp_path / "many.jsonl", [conv(("user", "q"))] * 3)
    with pytest.raises(StartCheckError, match="many.jsonl has 3 bad rows, each listed above"):
        check_start(_cfg(tmp_path, many), tokenizer=CharTokenizer)
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(" line ")[1].split(":")[0] for ln in err] == ["1", "2", "3"]


def test_demonstrations_warm_up_a_checkpoint_and_a_dataset_without_answers(tmp_path):
    good = write(tmp_path / "good.jsonl", [GOOD])
    assert warmup_runs(_cfg(tmp_path, good, model={"tokenizer": "hf", "hf_path": "some/model"}))
    assert not warmup_runs(_cfg(tmp_path, None, model={"tokenizer": "hf", "hf_path": "some/model"}))
    cfg = _cfg(tmp_path, good)
    cfg.task.answer_field = None  # as task.layout: trl leaves it: the demonstrations are the labels
    check_warmup(cfg)
    cfg.warmup.data = None
    with pytest.raises(StartCheckError, match="task.answer_field is unset .* set warmup.data to demonstrations"):
        check_warmup(cfg)


def test_a_chat_demo_without_a_system_message_gets_the_tasks(tmp_path):
    pytest.importorskip("transformers", reason="an HF tokenizer needs transformers (extra hf)")
    from recipes import chat_tokenizer

    from laminar_hpc.model.hf import HFTokenizer
    tok = HFTokenizer.from_path(chat_tokenizer(tmp_path / "tok"))

    class Chat:  # as a dataset with chat_template: true and a system_prompt
        system_prompt = "Use the tools."

        def problem(self, i):
            return Problem(i, "mul:6*7=", "42", chat=True, system=self.system_prompt)

    seq, _, p0 = demo_rows(write(tmp_path / "d.jsonl", [GOOD]), Chat(), tok, ENV, max_len=512, seed=0).sequence(0)
    assert seq[:p0] == encode_prompt(tok, Chat().problem(0))  # the prompt RL's episodes start from
    own = conv(("system", "Mine."), *[(m["role"], m["content"]) for m in GOOD["messages"]])
    seq, _, p0 = demo_rows(write(tmp_path / "d.jsonl", [own]), Chat(), tok, ENV, max_len=512, seed=0).sequence(0)
    assert tok.hf.decode(seq[:p0]).startswith("<|im_start|>system\nMine.<|im_end|>")

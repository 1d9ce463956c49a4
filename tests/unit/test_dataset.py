"""The dataset loader (tasks/sources/dataset.py): JSONL and Parquet rows with mapped field names, chat rows,
bad rows, validation splits and their overlap, and the order of problems by seed and epoch (the
prompt cursor that checkpoints and the write-ahead log restore)."""
from __future__ import annotations

import datetime
import json
import logging
import random
import re
from collections import Counter

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.task import DatasetTaskCfg
from laminar_hpc.tasks.sources.dataset import DatasetError, DatasetTasks

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, rows, schema=None) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def numbered(n: int) -> list[dict]:
    return [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(n)]


MAPPED = [{"problem": "1+1?", "solution": "2", "level": 3, "tags": ["easy", "sum"]},
          {"problem": "2+3?", "solution": "5", "level": 1, "tags": []}]
MAPPING = dict(prompt_field="problem", answer_field="solution", answer_format="plain", shuffle=False)


# -- rows and fields ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_mapped_fields_and_extra_fields_reach_the_problem(tmp_path, fmt):
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", MAPPED)
    src = DatasetTasks(path, prompt_template="Q: {prompt}\nA:", **MAPPING)
    assert len(src) == 2 and src.name == f"dataset:d.{fmt}" and src.skipped == 0
    p, q = src.problem(0), src.problem(1)
    assert (p.prompt, p.answer, p.chat, p.system, p.messages) == ("Q: 1+1?\nA:", "2", False, None, None)
    assert (q.prompt, q.answer) == ("Q: 2+3?\nA:", "5")
    assert p.fields == {"level": 3, "tags": ["easy", "sum"]} and type(p.fields) is dict  # mapped fields left out
    assert q.fields == {"level": 1, "tags": []}
    assert src.where(1) == f"{path} {'line' if fmt == 'jsonl' else 'row'} 2"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("answers,gold", [([7, -2], ["7", "-2"]), ([0.5, 2.0], ["0.5", "2.0"])])
def test_a_number_answer_becomes_its_text(tmp_path, fmt, answers, gold):
    rows = [{"problem": f"p{i}", "solution": a} for i, a in enumerate(answers)]
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", rows)
    assert [DatasetTasks(path, **MAPPING).problem(i).answer for i in range(2)] == gold


def test_parquet_values_become_plain_python(tmp_path):
    rows = [{"question": "q?", "answer": "#### 1", "meta": {"src": "x", "n": 2},
             "when": datetime.date(2024, 5, 1), "raw": b"text"}]
    src = DatasetTasks(write_parquet(tmp_path / "d.parquet", rows))
    assert src.problem(0).fields == {"meta": {"src": "x", "n": 2}, "when": "2024-05-01", "raw": "text"}
    json.dumps(src.problem(0).fields)  # JSON-like: a remote verifier can send it


def test_fields_are_a_copy_per_problem(tmp_path):
    src = DatasetTasks(write_jsonl(tmp_path / "d.jsonl", MAPPED), **MAPPING)
    src.problem(0).fields["level"] = 99
    assert src.problem(0).fields["level"] == 3


def test_jsonl_and_parquet_of_the_same_rows_give_the_same_problems(tmp_path):
    rows = numbered(30)
    a = DatasetTasks(write_jsonl(tmp_path / "d.jsonl", rows), seed=4)
    b = DatasetTasks(write_parquet(tmp_path / "d.parquet", rows), seed=4)
    assert [a.problem(i) for i in range(70)] == [b.problem(i) for i in range(70)]


def test_format_from_the_suffix_or_set(tmp_path):
    odd = tmp_path / "rows.txt"
    write_jsonl(odd, numbered(2))
    with pytest.raises(DatasetError, match=r"rows\.txt.*task\.format"):
        DatasetTasks(str(odd))
    assert len(DatasetTasks(str(odd), format="jsonl")) == 2
    pq_odd = write_parquet(tmp_path / "rows.bin", numbered(3))
    assert len(DatasetTasks(pq_odd, format="parquet")) == 3
    assert len(DatasetTasks(write_jsonl(tmp_path / "d.json", numbered(2)))) == 2  # .json: JSON lines
    assert len(DatasetTasks(write_parquet(tmp_path / "d.pq", numbered(2)))) == 2


def test_a_byte_order_mark_is_not_a_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(numbered(1)[0]).encode() + b"\n")
    assert DatasetTasks(str(path)).problem(0).answer == "0"


# -- prompts and chats -------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]
CHAT_SYS = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "7*6?"}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_rows_and_the_system_prompt(tmp_path, fmt):
    rows = [{"messages": CHAT, "answer": "#### 5", "id": 1}, {"messages": CHAT_SYS, "answer": "#### 42", "id": 2}]
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"c.{fmt}", rows)
    src = DatasetTasks(path, chat_template=True, shuffle=False)
    p = src.problem(0)
    assert (p.prompt, p.answer, p.chat, p.system, p.fields) == ("", "5", True, None, {"id": 1})
    assert p.messages == tuple(CHAT)
    with_sys = DatasetTasks(path, chat_template=True, shuffle=False, system_prompt="Be brief.")
    assert with_sys.problem(0).messages == ({"role": "system", "content": "Be brief."}, *CHAT)
    assert with_sys.problem(0).system is None  # already in the messages
    assert with_sys.problem(1).messages == tuple(CHAT_SYS)  # the row's own system message stays alone


def test_plain_and_chat_rows_mixed_in_parquet(tmp_path):
    rows = [{"question": "plain?", "messages": None, "answer": "#### 1"},
            {"question": None, "messages": CHAT, "answer": "#### 5"}]
    src = DatasetTasks(write_parquet(tmp_path / "m.parquet", rows), chat_template=True, shuffle=False)
    assert src.problem(0).prompt == "plain?\nAnswer: " and src.problem(0).messages is None
    assert src.problem(1).messages == tuple(CHAT) and src.problem(1).prompt == ""


def test_parquet_message_structs_drop_their_absent_keys(tmp_path):
    msgs = [{"role": "user", "content": "a?", "name": None}]
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                                          ("name", pa.string())]))), ("answer", pa.string())])
    src = DatasetTasks(write_parquet(tmp_path / "s.parquet", [{"messages": msgs, "answer": "x"}], schema),
                       chat_template=True, answer_format="plain")
    assert src.problem(0).messages == ({"role": "user", "content": "a?"},)


def test_plain_prompt_with_the_chat_template_or_a_hand_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(1))
    chat = DatasetTasks(path, chat_template=True, system_prompt="Be brief.", prompt_template="{prompt} Think.")
    p = chat.problem(0)
    assert (p.prompt, p.chat, p.system, p.messages) == ("q0? Think.", True, "Be brief.", None)
    hand = DatasetTasks(path, system_prompt="Be brief.", prompt_template="<s>[INST] {prompt} [/INST]")
    q = hand.problem(0)
    assert (q.prompt, q.chat, q.system) == ("<s>[INST] q0? [/INST]", False, None)  # no chat: no system prompt


@pytest.mark.parametrize("template", ["{question}", "{prompt", "{0}"])
def test_an_unusable_template_is_refused(tmp_path, template):
    with pytest.raises(DatasetError, match="task.prompt_template"):
        DatasetTasks(write_jsonl(tmp_path / "d.jsonl", numbered(1)), prompt_template=template)


# -- bad input ---------------------------------------------------------------------------------

BAD = {  # row -> (what the message names, on_bad_row's other settings)
    "not_json": ("{oops", "not JSON", {}),
    "not_object": ([1, 2], "expected an object", {}),
    "no_prompt": ({"answer": "#### 1"}, "'question'", {}),
    "prompt_not_text": ({"question": 3, "answer": "#### 1"}, "'question'", {}),
    "no_answer": ({"question": "q"}, "'answer'", {}),
    "answer_a_list": ({"question": "q", "answer": [1]}, "'answer'", {}),
    "no_hashes": ({"question": "q", "answer": "it is 4"}, "answer_format: plain", {}),
    "empty_gold": ({"question": "q", "answer": "####  "}, "empty", {}),
    "chat_without_template": ({"messages": CHAT, "answer": "#### 5"}, "set task.chat_template: true", {}),
    "messages_not_a_list": ({"messages": "hi", "answer": "#### 5"}, "'messages'", {"chat_template": True}),
    "messages_empty": ({"messages": [], "answer": "#### 5"}, "empty list", {"chat_template": True}),
    "message_no_content": ({"messages": [{"role": "user"}], "answer": "#### 5"}, r"messages\[0\]",
                           {"chat_template": True}),
    "message_bad_role": ({"messages": [{"role": "bot", "content": "x"}], "answer": "#### 5"}, "'bot'",
                         {"chat_template": True}),
    "message_content_not_text": ({"messages": [{"role": "user", "content": 5}], "answer": "#### 5"}, "not text",
                                 {"chat_template": True}),
    "message_extra_key": ({"messages": [{"role": "user", "content": "x", "tool_calls": []}], "answer": "#### 5"},
                          "tool_calls", {"chat_template": True}),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_row_fail_names_file_line_and_field(tmp_path, kind):
    row, named, kw = BAD[kind]
    good = numbered(3)
    path = write_jsonl(tmp_path / "d.jsonl", [good[0], good[1], "", row, good[2]])
    with pytest.raises(DatasetError) as err:
        DatasetTasks(path, **kw)
    msg = str(err.value)
    assert msg.startswith(f"{path} line 4: ") and re.search(named, msg), msg
    assert "task.on_bad_row: skip" in msg and "\n" not in msg


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_row_skip_counts_and_warns_once(tmp_path, kind, caplog):
    row, _, kw = BAD[kind]
    good = numbered(2)
    path = write_jsonl(tmp_path / "d.jsonl", [row, good[0], row, good[1], row])
    with caplog.at_level(logging.WARNING, logger="laminar_hpc.tasks.sources.dataset"):
        src = DatasetTasks(path, on_bad_row="skip", shuffle=False, **kw)
    assert src.skipped == 3 and len(src) == 2
    assert [src.problem(i).answer for i in range(2)] == ["0", "1"]
    assert [src.where(i) for i in range(2)] == [f"{path} line 2", f"{path} line 4"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 3 of 5 rows" in warnings[0] and "line 1" in warnings[0], warnings


def test_bad_parquet_rows_are_named_by_row(tmp_path):
    rows = [{"question": "a", "answer": "#### 1"}, {"question": None, "answer": "#### 2"},
            {"question": "c", "answer": "no final answer"}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DatasetError, match=re.escape(f"{path} row 2: missing field 'question'")):
        DatasetTasks(path)
    src = DatasetTasks(path, on_bad_row="skip")
    assert src.skipped == 2 and len(src) == 1 and src.where(0) == f"{path} row 1"


def test_a_file_that_is_not_parquet(tmp_path):
    path = write_jsonl(tmp_path / "d.parquet", numbered(2))
    with pytest.raises(DatasetError) as err:
        DatasetTasks(path)
    assert str(err.value).startswith(f"{path}: not a Parquet file (") and "task.format: jsonl" in str(err.value)
    assert "\n" not in str(err.value)


def test_files_without_usable_rows(tmp_path):
    for name, rows in (("empty.jsonl", []), ("bad.jsonl", [[1], {"question": "q"}])):
        path = write_jsonl(tmp_path / name, rows)
        for on_bad_row in ("fail", "skip"):
            with pytest.raises(DatasetError, match=re.escape(path)):
                DatasetTasks(path, on_bad_row=on_bad_row)
    empty = write_parquet(tmp_path / "empty.parquet", [], pa.schema([("question", pa.string())]))
    with pytest.raises(DatasetError, match="no usable rows"):
        DatasetTasks(empty)


def test_a_json_array_file_is_told_to_be_json_lines(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text("[\n" + json.dumps(numbered(1)[0]) + "\n]\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="one object per line"):
        DatasetTasks(str(path))


def test_missing_files_and_bad_text(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        DatasetTasks(str(tmp_path / "none.parquet"))
    with pytest.raises(DatasetError, match=re.escape(str(tmp_path / "v.jsonl")) + ".*not found"):
        DatasetTasks(write_jsonl(tmp_path / "d.jsonl", numbered(2)), validation_path=str(tmp_path / "v.jsonl"))
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DatasetError, match="not UTF-8"):
        DatasetTasks(str(latin))


# -- validation splits -------------------------------------------------------------------------

def test_validation_from_its_own_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", numbered(10))
    vrows = [{"problem": "v0?", "solution": "7"}, {"problem": "v1?", "solution": "8"}]
    valid = write_parquet(tmp_path / "valid.parquet", vrows)
    with pytest.raises(DatasetError, match=re.escape(f"{valid} row 1: missing field 'question'")):
        DatasetTasks(train, validation_path=valid)  # the same mapping and rules for both files
    src = DatasetTasks(write_jsonl(tmp_path / "t2.jsonl", MAPPED), validation_path=valid, **MAPPING)
    v = src.validation()
    assert [(p.index, p.prompt, p.answer) for p in v] == [(0, "v0?\nAnswer: ", "7"), (1, "v1?\nAnswer: ", "8")]
    assert src.validation_where(1) == f"{valid} row 2" and len(src) == 2 and src.overlap == 0
    assert DatasetTasks(train).validation() == []


def test_overlap_with_the_validation_file_is_counted_and_warned(tmp_path, caplog):
    rows = numbered(10)
    train = write_jsonl(tmp_path / "train.jsonl", rows + [rows[3], {"messages": CHAT, "answer": "#### 5"}])
    valid = write_jsonl(tmp_path / "test.jsonl", [rows[3], rows[7], {"question": "new", "answer": "#### 1"},
                                                  {"messages": CHAT, "answer": "#### 6"}])
    with caplog.at_level(logging.WARNING, logger="laminar_hpc.tasks.sources.dataset"):
        src = DatasetTasks(train, validation_path=valid, chat_template=True)
    assert src.overlap == 4  # rows 3 (twice) and 7, and the chat: same prompt, whatever the answer
    assert len(src) == 12  # counted, not removed
    assert any("4 of 12 training rows" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_validation_fraction_holds_out_rows_by_seed(tmp_path, fmt):
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", numbered(40))

    def split(seed, fraction=0.25):
        src = DatasetTasks(path, seed=seed, validation_fraction=fraction)
        held = [p.prompt for p in src.validation()]
        train = [src.problem(i).prompt for i in range(len(src))]
        return src, held, train

    src, held, train = split(0)
    assert len(held) == 10 and len(src) == 30
    assert not set(held) & set(train) and len(set(held) | set(train)) == 40  # disjoint, together every row
    assert held == sorted(held, key=lambda q: int(q[1:q.index("?")]))  # in file order
    assert [p.index for p in src.validation()] == list(range(10))
    assert split(0)[1] == held  # the same seed, the same split
    assert set(split(1)[1]) != set(held)
    assert len(split(0, 0.001)[1]) == 1  # at least one row
    with pytest.raises(DatasetError, match="validation_fraction"):
        DatasetTasks(write_jsonl(tmp_path / "one.jsonl", numbered(1)), validation_fraction=0.5)
    with pytest.raises(DatasetError, match="set one of them"):
        DatasetTasks(path, validation_fraction=0.1, validation_path=path)


# -- order, epochs and the cursor --------------------------------------------------------------

def rows_of(src, start, stop):
    return [src.problem(i).prompt for i in range(start, stop)]


def test_every_row_once_per_epoch_in_a_new_order(tmp_path):
    n = 50
    src = DatasetTasks(write_jsonl(tmp_path / "d.jsonl", numbered(n)), seed=7)
    every = sorted(f"q{i}?\nAnswer: " for i in range(n))
    epochs = [rows_of(src, e * n, (e + 1) * n) for e in range(3)]
    for order in epochs:
        assert sorted(order) == every  # each row exactly once
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != sorted(epochs[0], key=lambda q: int(q[1:q.index("?")]))  # shuffled, not file order
    assert [src.epoch(i) for i in (0, n - 1, n, 3 * n - 1, 10 * n)] == [0, 0, 1, 2, 10]
    assert [src.problem(i).index for i in (0, 77, 10**6)] == [0, 77, 10**6]
    with pytest.raises(IndexError):
        src.problem(-1)


def test_the_order_is_the_seeds_in_every_instance(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(40))
    a, b = DatasetTasks(path, seed=3), DatasetTasks(path, seed=3)
    assert [a.problem(i) for i in range(120)] == [b.problem(i) for i in range(120)]
    assert rows_of(DatasetTasks(path, seed=4), 0, 40) != rows_of(a, 0, 40)
    assert rows_of(DatasetTasks(path, shuffle=False), 0, 80) == [f"q{i % 40}?\nAnswer: " for i in range(80)]


def test_a_resumed_cursor_continues_mid_epoch(tmp_path):
    """The controller's cursor is one integer in its checkpoint and write-ahead log: a fresh process
    given it draws exactly the problems the first would have drawn, from mid-epoch on."""
    path = write_jsonl(tmp_path / "d.jsonl", numbered(40))
    first = DatasetTasks(path, seed=11)
    uninterrupted = [first.problem(i) for i in range(100)]
    cursor = 57  # epoch 1, position 17
    resumed = DatasetTasks(path, seed=11)  # a new process: nothing drawn before
    assert resumed.epoch(cursor) == 1
    assert [resumed.problem(i) for i in range(cursor, 100)] == uninterrupted[cursor:]
    assert [resumed.where(i) for i in range(cursor, 100)] == [first.where(i) for i in range(cursor, 100)]
    backwards = DatasetTasks(path, seed=11)  # the order of calls does not matter either
    assert [backwards.problem(i) for i in reversed(range(100))][::-1] == uninterrupted


def test_an_epochs_order_is_computed_once(tmp_path, monkeypatch):
    n = 100_000
    path = tmp_path / "big.jsonl"
    path.write_text("".join(f'{{"question": "q{i}", "answer": "#### {i}"}}\n' for i in range(n)), encoding="utf-8")
    src = DatasetTasks(str(path), seed=0)
    shuffles = Counter()
    real = random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: (shuffles.update([len(x)]), real(self, x))[1])
    for i in range(0, 2 * n, 97):
        src.problem(i)
    for i in (n - 1, n, n - 2, n + 1):  # back and forth across an epoch's end
        src.problem(i)
    assert shuffles == {n: 2}  # one per epoch
    for i in range(2 * n, 3 * n, 97):
        src.where(i)
    assert shuffles == {n: 3}


def test_from_config(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", MAPPED)
    cfg = config_from_dict({"seed": 5, "task": {
        "type": "dataset", "path": path, "prompt_field": "problem", "answer_field": "solution",
        "answer_format": "plain", "max_prompt_tokens": 256, "shuffle": False, "prompt_template": "{prompt}"}})
    src = DatasetTasks.from_config(cfg.task, cfg.seed)
    assert src.max_prompt_tokens == 256 and src.seed == 5
    assert src.problem(1).prompt == "2+3?" and src.problem(1).answer == "5" and not src.problem(1).chat
    jsonl = config_from_dict({"task": {"type": "jsonl", "path": path, "validation_fraction": 0.5,
                                       "answer_format": "plain", "prompt_field": "problem",
                                       "answer_field": "solution"}})
    held = DatasetTasks.from_config(jsonl.task, 0)
    assert len(held) == 1 and len(held.validation()) == 1
    chat = DatasetTasks.from_config(DatasetTaskCfg(path=path, prompt_field="problem", answer_field="solution",
                                                   answer_format="plain", chat_template=True,
                                                   system_prompt="Be brief."), 0)
    assert all(chat.problem(i).chat and chat.problem(i).system == "Be brief." for i in range(2))

"""Rows as other trainers write them (task.layout, tasks/sources/row_layouts.py): verl's Parquet with the
prompt as chat messages and the gold answer nested in reward_model, TRL's prompt-only rows whose
columns all reach the reward, dotted field paths in every layout, and the layouts' defaults in
the config. Each test here failed before layouts existed: the prompt list was refused as "not
text", and a dotted field was a missing column."""
from __future__ import annotations

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.tasks.sources.build import build_task
from laminar_hpc.tasks.prompts import encode_prompt
from laminar_hpc.tasks.sources.dataset import DatasetError, DatasetTasks
from laminar_hpc.tasks.sources.row_layouts import PathError, get_path

from recipes import DATA_SOURCE, trl_rows, verl_rows, write_jsonl, write_verl_parquet

pytest.importorskip("pyarrow")


def test_dotted_paths_read_nested_fields():
    row = {"reward_model": {"ground_truth": "72", "style": "rule"}, "a.b": 1, "n": None, "s": "text"}
    assert get_path(row, "reward_model.ground_truth") == "72"
    assert get_path(row, "a.b") == 1  # a column whose own name holds the dot comes first
    assert get_path(row, "reward_model.absent") is None and get_path(row, "n.x", "dflt") == "dflt"
    with pytest.raises(PathError, match=r"field 's' is str, not an object, so 's.x' cannot be read"):
        get_path(row, "s.x")


def test_the_verl_layout_reads_verls_parquet_as_it_is(tmp_path):
    path = write_verl_parquet(tmp_path / "train.parquet", 6)
    cfg = config_from_dict({"task": {"type": "dataset", "path": str(path), "layout": "verl"}}).task
    assert (cfg.prompt_field, cfg.answer_field, cfg.answer_format) == ("prompt", "reward_model.ground_truth", "plain")
    src = build_task(cfg, 0)
    rows = {r["extra_info"]["index"]: r for r in verl_rows(6)}
    for i in range(6):
        p = src.problem(i)
        row = rows[p.fields["extra_info"]["index"]]
        assert p.chat and p.messages == tuple(row["prompt"]) and p.prompt == ""
        assert p.answer == p.gold == row["reward_model"]["ground_truth"]
        # every column but the prompt reaches the reward, as verl hands them to compute_score
        assert set(p.fields) == {"data_source", "ability", "reward_model", "extra_info"}
        assert p.fields["data_source"] == DATA_SOURCE
    assert src.first_chat() == f"{path} row 1"


def test_a_verl_row_without_data_source_names_the_field_and_the_layout(tmp_path):
    rows = verl_rows(3)
    del rows[1]["data_source"]
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    with pytest.raises(DatasetError, match=r"v.jsonl line 2: missing field 'data_source' \(task.layout: verl"):
        DatasetTasks(path, layout="verl", prompt_field="prompt", messages_field=None,
                     answer_field="reward_model.ground_truth", answer_format="plain", chat_template=None)


def test_a_prompt_field_holding_messages_is_a_chat_in_the_laminar_layout_too(tmp_path):
    """verl's rows with only the field names set: the prompt list is read as a chat (it was refused
    as "field 'prompt' is list, not text"), the nested answer is found."""
    path = write_verl_parquet(tmp_path / "train.parquet", 4)
    src = DatasetTasks(path, prompt_field="prompt", answer_field="reward_model.ground_truth", answer_format="plain",
                       chat_template=None, shuffle=False)
    p = src.problem(0)
    assert p.chat and p.messages == ({"role": "user", "content": verl_rows(4)[0]["prompt"][0]["content"]},)
    assert p.answer == verl_rows(4)[0]["reward_model"]["ground_truth"]
    assert "reward_model" in p.fields and "prompt" not in p.fields  # the dotted path's column stays
    refused = DatasetTasks.__new__(DatasetTasks)  # chat_template: false says how to render them
    with pytest.raises(DatasetError, match=r"row 1: holds chat messages \(field 'prompt'\); set task.chat_template: "
                                           "true"):
        refused.__init__(path, prompt_field="prompt", answer_field="reward_model.ground_truth",
                         answer_format="plain", chat_template=False)


def test_a_missing_nested_field_names_its_path(tmp_path):
    rows = verl_rows(2)
    rows[1]["reward_model"] = {"style": "rule"}
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    with pytest.raises(DatasetError, match=r"line 2: missing field 'reward_model.ground_truth' \(task.answer_field\)"):
        DatasetTasks(path, prompt_field="prompt", answer_field="reward_model.ground_truth", answer_format="plain",
                     chat_template=None)


def test_a_non_text_ground_truth_reaches_the_reward_as_it_is(tmp_path):
    rows = verl_rows(1)
    rows[0]["reward_model"]["ground_truth"] = ["54", "54.0"]
    src = DatasetTasks(write_jsonl(tmp_path / "v.jsonl", rows), prompt_field="prompt",
                       answer_field="reward_model.ground_truth", answer_format="plain", chat_template=None)
    assert src.problem(0).gold == ["54", "54.0"] and src.problem(0).answer == '["54", "54.0"]'


def test_the_trl_layout_hands_every_column_but_the_prompt_to_the_reward(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", trl_rows(5))
    cfg = config_from_dict({"task": {"type": "dataset", "path": str(path), "layout": "trl"}}).task
    assert (cfg.prompt_field, cfg.answer_field, cfg.prompt_template) == ("prompt", None, "{prompt}")
    src = build_task(cfg, 0)
    by_prompt = {r["prompt"]: r for r in trl_rows(5)}
    p = src.problem(0)
    row = by_prompt[p.prompt]  # the prompt as written: no template around it
    assert not p.chat and p.answer == "" and p.gold is None
    assert p.fields == {"solution": row["solution"], "difficulty": row["difficulty"], "poison": False}
    # with an answer field, the column still reaches the reward (TRL passes every column)
    named = build_task(cfg.model_copy(update={"answer_field": "solution"}), 0).problem(0)
    assert named.answer == named.fields["solution"] == by_prompt[named.prompt]["solution"]


def test_trl_conversational_prompts_are_chats(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "rev:12="}],
             "solution": "21"}]
    src = DatasetTasks(write_jsonl(tmp_path / "c.jsonl", rows), layout="trl", prompt_field="prompt",
                       messages_field=None, answer_field=None, answer_format="plain", prompt_template="{prompt}",
                       chat_template=None)
    p = src.problem(0)
    assert p.chat and [m["role"] for m in p.messages] == ["system", "user"] and p.fields == {"solution": "21"}


def test_a_prompt_that_is_neither_text_nor_messages_says_both(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(DatasetError, match=r"field 'prompt' is int, not text or a list of chat messages"):
        DatasetTasks(path, prompt_field="prompt", answer_format="plain")


def test_layout_defaults_yield_to_what_the_config_sets():
    cfg = config_from_dict({"task": {"type": "dataset", "path": "x.jsonl", "layout": "verl",
                                     "answer_field": "extra_info.answer"}}).task
    assert (cfg.prompt_field, cfg.answer_field) == ("prompt", "extra_info.answer")
    laminar = config_from_dict({"task": {"type": "dataset", "path": "x.jsonl"}}).task
    assert (laminar.layout, laminar.prompt_field, laminar.answer_field, laminar.answer_format) == \
        ("laminar", "question", "answer", "gsm8k")
    # written out in config.yaml, a run directory's config loads back to the same section
    again = config_from_dict({"task": cfg.model_dump()}).task
    assert again == cfg


def test_a_text_prompt_with_a_chat_template_is_the_user_message(tmp_path):
    class Tok:
        bos_id = None

        def chat_prompt(self, messages):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

        def encode(self, text):
            return [ord(c) for c in text]
    src = DatasetTasks(write_jsonl(tmp_path / "t.jsonl", trl_rows(1)), layout="trl", prompt_field="prompt",
                       messages_field=None, answer_field=None, answer_format="plain", prompt_template="{prompt}",
                       chat_template=True)
    assert "".join(map(chr, encode_prompt(Tok(), src.problem(0)))) == "user:" + trl_rows(1)[0]["prompt"]

"""The start check (tasks/preflight.py): every input the issue lists gets one line before anything
starts. A reward is called on a sample row in the reward pool under its timeout, so one that
hangs stops the start after `timeout_s` (it froze `laminar run` for ever); one that raises, or
scores a correct answer outside the range, or weighs a component it does not return, stops it
naming the function, the row and the reason. Tools, environments and chat templates are checked
too. `laminar run` through processes: tests/integration/test_recipes.py."""
from __future__ import annotations

import time

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.model.tokenizer import CharTokenizer
from laminar_hpc.tasks.problem import Problem
from laminar_hpc.tasks.preflight import StartCheckError, check_reward, check_start

from recipes import trl_rows, write_jsonl, write_verl_parquet

ROW = Problem(0, "rev:45=", "54", fields={"word": "54"})

REWARDS = '''
import time

def hang(problem, response):
    time.sleep(3600)

def boom(problem, response):
    return float(problem.fields["missing"])

def caesar(problem, response):
    return {"format": 1.0, "correct": 1.0 if response.text == problem.answer else 0.0}

def verl(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

def fine(problem, response):
    return 1.0
'''


@pytest.fixture
def rewards(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    return str(tmp_path / "rw.py")


def reward_cfg(fn, **kw):
    return config_from_dict({"task": {"type": "builtin", "reward": {"fn": fn, **kw}}}).task.reward


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_hanging_reward_stops_the_start_after_its_timeout(rewards, pool):
    t0 = time.monotonic()
    with pytest.raises(StartCheckError) as err:
        check_reward(reward_cfg(f"{rewards}:hang", timeout_s=0.5, pool=pool), ROW, "data.jsonl line 7")
    assert time.monotonic() - t0 < 15  # the timeout and a worker's start, never the hour it sleeps
    text = str(err.value)
    assert text.startswith(f"task.reward: {rewards}:hang did not return within 0.5 s")
    assert "data.jsonl line 7" in text and "reason: timeout" in text and "\n" not in text


def test_a_hanging_component_of_a_map_is_named(rewards):
    with pytest.raises(StartCheckError, match=r"rw.py:hang did not return within 0.5 s \(component 'slow'\)"):
        check_reward(reward_cfg({"ok": f"{rewards}:fine", "slow": f"{rewards}:hang"}, timeout_s=0.5), ROW, "row 1")


def test_a_raising_reward_stops_the_start_naming_function_row_and_reason(rewards):
    with pytest.raises(StartCheckError) as err:
        check_reward(reward_cfg(f"{rewards}:boom"), ROW, "train.parquet row 3")
    assert f"{rewards}:boom raised KeyError: 'missing'" in str(err.value)
    assert "train.parquet row 3 with its gold answer '54'" in str(err.value) and "reason: exception" in str(err.value)


def test_a_weight_that_names_no_component_stops_the_start(rewards):
    with pytest.raises(StartCheckError, match=r"returned no 'corect', which task.reward.weights names"):
        check_reward(reward_cfg(f"{rewards}:caesar", weights={"format": 0.2, "corect": 0.8}), ROW, "row 1")


def test_a_correct_answer_outside_the_range_stops_the_start(rewards):
    with pytest.raises(StartCheckError, match=r"scored 1.2 in all .*outside task.reward.range \[0, 1\]"):
        check_reward(reward_cfg(f"{rewards}:caesar", weights={"format": 0.2, "correct": 1.0}), ROW, "row 1")


def test_keys_that_are_only_logged_are_noted(rewards):
    notes = check_reward(reward_cfg(f"{rewards}:verl"), Problem(0, "", "54", fields={"data_source": "x"}), "row 1")
    assert len(notes) == 1 and "returns acc besides the reward: logged per step as reward.acc, never added" in notes[0]
    assert check_reward(reward_cfg(f"{rewards}:fine"), ROW, "row 1") == []


def config(tmp_path, task: dict, **sections):
    return config_from_dict({"task": {"type": "dataset", **task}, **sections})


def test_a_bad_tool_path_stops_the_start_naming_the_tool(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", trl_rows(4))
    cfg = config(tmp_path, {"path": str(data), "layout": "trl", "answer_field": "solution", "reward": "exact"},
                 env={"tools": {"calc": "nowhere/tools.py:calc"}})
    with pytest.raises(StartCheckError, match=r"^env.tools.calc 'nowhere/tools.py:calc': file .*nowhere/tools.py "
                                              "not found"):
        check_start(cfg, tokenizer=CharTokenizer)


def test_a_task_without_answers_cannot_warm_up(tmp_path):
    data = write_jsonl(tmp_path / "t.jsonl", trl_rows(4))
    cfg = config(tmp_path, {"path": str(data), "layout": "trl", "reward": "exact"})
    with pytest.raises(StartCheckError, match=r"warmup: .*task.answer_field is unset \(task.layout: trl\); set "
                                              r"task.answer_field .* or warmup.enabled: false"):
        check_start(cfg, tokenizer=CharTokenizer)
    check_start(config(tmp_path, {"path": str(data), "layout": "trl", "reward": "exact"}, warmup={"enabled": False}),
                tokenizer=CharTokenizer)


def test_chats_without_a_chat_template_say_which_key_to_set(tmp_path):
    data = write_verl_parquet(tmp_path / "train.parquet", 4)
    cfg = config(tmp_path, {"path": str(data), "layout": "verl", "reward": "exact"})
    with pytest.raises(StartCheckError) as err:
        check_start(cfg, tokenizer=CharTokenizer)
    assert str(err.value) == (f"task: {data} row 1 holds chat messages, which need the model's chat template, and the "
                              "tokenizer (CharTokenizer) has no chat template; set model.tokenizer: hf and "
                              "model.hf_tokenizer (or model.hf_path) to a tokenizer that has one")


def long_and_short(tmp_path, n_long: int, n: int = 40):
    """n rows, n_long of them with 30-character prompts (CharTokenizer: a token per character, +BOS)."""
    rows = [{"prompt": ("rev:" + "1" * 26 + "=") if i < n_long else "rev:12=", "solution": "21"} for i in range(n)]
    return write_jsonl(tmp_path / "t.jsonl", rows)


def test_prompts_the_limits_drop_are_counted_at_the_start_and_too_many_stop_it(tmp_path):
    # issue 46: max_prompt_tokens under most prompts' length trained 3 steps on one prompt, said only
    # in the controller's log; the start check counts them and stops the start past the share allowed
    task = {"layout": "trl", "answer_field": "solution", "reward": "exact", "max_prompt_tokens": 16}
    cfg = config(tmp_path, {"path": str(long_and_short(tmp_path, 30)), **task}, warmup={"enabled": False})
    with pytest.raises(StartCheckError) as err:
        check_start(cfg, tokenizer=CharTokenizer)
    text = str(err.value)
    assert text.startswith("75.0% of the 40 training rows would be dropped: 30 over task.max_prompt_tokens=16; the "
                           "longest prompt has ") and "more than task.max_dropped_fraction=0.05" in text
    assert "raise task.max_prompt_tokens to " in text and "set task.max_dropped_fraction above 0.75" in text
    # on purpose: said in one note, the start goes on
    on_purpose = config(tmp_path, {"path": str(long_and_short(tmp_path, 30)), **task, "max_dropped_fraction": 0.8},
                        warmup={"enabled": False})
    notes = check_start(on_purpose, tokenizer=CharTokenizer)
    assert any(n.startswith("note: 75.0% of the 40 training rows would be dropped") for n in notes), notes
    # a small share: a note, no error; none: no note
    few = config(tmp_path, {"path": str(long_and_short(tmp_path, 1)), **task}, warmup={"enabled": False})
    assert any("2.5% of the 40 training rows" in n for n in check_start(few, tokenizer=CharTokenizer))
    none = config(tmp_path, {"path": str(long_and_short(tmp_path, 0)), **task}, warmup={"enabled": False})
    assert not any("would be dropped" in n for n in check_start(none, tokenizer=CharTokenizer))


def test_prompts_with_no_room_in_the_context_and_bad_rows_count_too(tmp_path):
    path = long_and_short(tmp_path, 4)
    with open(path, "a") as f:
        f.write('{"prompt": 5}\n{"nothing": 1}\n')  # two rows without a usable prompt
    cfg = config(tmp_path, {"path": str(path), "layout": "trl", "answer_field": "solution", "reward": "exact",
                            "on_bad_row": "skip"}, warmup={"enabled": False}, model={"max_seq_len": 24},
                 rollout={"max_new_tokens": 8})
    with pytest.raises(StartCheckError) as err:
        check_start(cfg, tokenizer=CharTokenizer)
    text = str(err.value)
    assert text.startswith("14.3% of the 42 training rows would be dropped: 4 leave no room to generate in the "
                           "engine's context of 24; 2 bad rows skipped (task.on_bad_row: skip)"), text
    assert "raise model.max_seq_len above " in text

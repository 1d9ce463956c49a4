"""Rewards from a model (laminar_hpc/judge/, config/judge.py): the judge's prompt and the reading
of its verdict, its config's refusals, the model's batched scoring (a batch scores each request
as it would alone), and the Scorer handing the verdict to the functions that take it."""
from __future__ import annotations

import pytest

from laminar_hpc.config import config_from_dict
from laminar_hpc.config.judge import JudgeCfg
from laminar_hpc.config.load import ConfigError
from laminar_hpc.config.schema import RewardCfg
from laminar_hpc.judge.verdicts import label_score, read_verdict, render
from laminar_hpc.tasks.problem import Problem, Response
from laminar_hpc.tasks.rewards.scorer import RewardError, Scorer

from helpers import REPO as REPO_ROOT  # the reward file below is named relative to the repository

P = Problem(3, "12+7=", "19")


# -- the prompt and the verdict --------------------------------------------------------------------

def test_the_template_shows_the_problem_the_response_and_the_answer():
    assert render("Q {problem} A {response} ref {answer}", problem="1+1", response="2", answer="2") == "Q 1+1 A 2 ref 2"


@pytest.mark.parametrize("parse,text,score", [
    ("number", " 0.75 because", 0.75), ("number", "score: 1", 1.0), ("number", "I give it .5", 0.5),
    ("label", "  Yes, it is right", 1.0), ("label", "no.", 0.0),
    ("json", 'verdict: {"score": 0.25, "why": "close"}', 0.25), ("json", '{"x": 1} then {"score": 1}', 1.0),
])
def test_a_verdict_is_read_as_its_parser_says(parse, text, score):
    cfg = JudgeCfg(kind="generative", parse=parse, labels={"yes": 1.0, "no": 0.0})
    assert read_verdict(text, cfg) == (score, None)


@pytest.mark.parametrize("parse,text,why", [
    ("number", "looks right to me", "holds no number"), ("number", "7 out of 10", "outside [0, 1]"),
    ("label", "maybe", "starts with none of the labels ['no', 'yes']"),
    ("json", '{"score": "high"}', "no JSON object with a number under 'score'"), ("json", "{score: 1}", "no JSON"),
])
def test_a_verdict_that_cannot_be_read_scores_0_with_the_reason(parse, text, why):
    cfg = JudgeCfg(kind="generative", parse=parse, labels={"yes": 1.0, "no": 0.0})
    score, reason = read_verdict(text, cfg)
    assert score == 0.0 and why in reason and text[:20] in reason


def test_a_label_score_weighs_each_label_by_its_normalised_probability():
    assert label_score({"yes": 0.3, "no": 0.1}, {"yes": 1.0, "no": 0.0}) == pytest.approx(0.75)
    assert label_score({"a": 0.2, "b": 0.2, "c": 0.0}, {"a": 1.0, "b": 0.5, "c": 0.0}) == pytest.approx(0.75)
    assert label_score({"yes": 0.0, "no": 0.0}, {"yes": 1.0, "no": 0.0}) == 0.0


# -- the config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("over,message", [
    ({"judge": {"template": "Q: {question} A: {response}"}}, "it names {question}, which a judge cannot fill"),
    ({"judge": {"template": "Q: {problem}"}}, "it never shows the judge the response: add {response}"),
    ({"judge": {"template": "Q: {problem A: {response}"}}, "not a format string"),
    ({"judge": {"labels": {"": 1.0, "no": 0.0}}}, "an empty label has no token"),
    ({"judge": {"init_checkpoint": "j.pt", "model": {"hf_path": "x"}}}, "keep one"),
    ({"judge": None}, "fn 'judge' scores with the campaign's judge, but there is none"),
    ({"judge": {}, "url": "http://127.0.0.1:1/score"}, "judge and url"),
])
def test_a_bad_judge_section_is_one_line_naming_the_key(over, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"task": {"reward": {"fn": "judge", **over}}})
    assert "task.reward" in str(err.value) and message in str(err.value)


def test_judges_are_roles_before_the_rollouts():
    from laminar_hpc.launch.plan import role_specs
    cfg = config_from_dict({"task": {"reward": {"fn": "judge", "judge": {"replicas": 2}}}, "rollout": {"count": 2}})
    names = [s.name for s in role_specs(cfg)]
    assert names.index("judge-0") < names.index("judge-1") < names.index("rollout-0")
    assert [s.module for s in role_specs(cfg) if s.name.startswith("judge")] == ["judge", "judge"]
    assert not any(n.startswith("judge") for n in (s.name for s in role_specs(config_from_dict({}))))


# -- the model -------------------------------------------------------------------------------------

def _model(**over):
    from laminar_hpc.judge.judge_model import JudgeModel
    base = {"template": "{problem}{response}?", "labels": {"Y": 1.0, "N": 0.0}, "model": {"max_seq_len": 48}}
    return JudgeModel.build(JudgeCfg(**{**base, **over}))


REQUESTS = [("12+7=", "19", "19"), ("3*3=", "9", "9"), ("100-1=", "98 or so", "99"), ("1=", "", "1")]


def test_a_label_judge_scores_a_batch_as_it_scores_each_alone():
    model = _model(kind="label")
    together = model.score(REQUESTS)
    alone = [model.score([r])[0] for r in REQUESTS]
    assert [s.score for s in together] == pytest.approx([s.score for s in alone], abs=1e-5)
    assert all(0.0 < s.score < 1.0 and s.error is None for s in together)  # a fresh model: P(Y) strictly inside
    assert len({round(s.score, 6) for s in together}) > 1  # the prompt matters
    assert together[0].verdict.startswith("Y:")


def test_a_generative_judge_decodes_a_batch_as_it_decodes_each_alone():
    model = _model(kind="generative", parse="number", max_new_tokens=6)
    together = model.score(REQUESTS)
    alone = [model.score([r])[0] for r in REQUESTS]
    assert [s.verdict for s in together] == [s.verdict for s in alone]
    assert all(s.verdict for s in together)  # a fresh model writes something (it rarely stops at once)
    for s in together:  # read as its parser says: a score in [0, 1], or 0 with the reason naming the text
        assert (s.error is None and 0.0 <= s.score <= 1.0) or (s.score == 0.0 and repr(s.verdict[:10])[:-1] in s.error)


def test_a_prompt_too_long_for_the_judge_scores_0_alone():
    model = _model(kind="label")
    out = model.score([("1" * 60, "2", "2"), ("1+1=", "2", "2")])
    assert out[0].score == 0.0 and "over its model.max_seq_len (48)" in out[0].error
    assert out[1].error is None


def test_labels_a_label_judge_cannot_tell_apart_fail_at_start():
    from laminar_hpc.judge.judge_model import JudgeModelError
    with pytest.raises(JudgeModelError, match="begin with the same token"):
        _model(kind="label", labels={"yes": 1.0, "yeah": 0.5})


# -- the Scorer and the verdict --------------------------------------------------------------------

JUDGED = RewardCfg(fn={"format": "tests/unit/test_judge.py:has_digits", "judge": "judge"},
                   weights={"format": 0.2, "judge": 0.8}, judge=JudgeCfg())


def has_digits(problem, response, judge):  # a component that reads the verdict as well as the text
    return 1.0 if any(c.isdigit() for c in response.text) and judge >= 0.0 else 0.0


def test_functions_that_take_the_judge_get_its_verdict_once_per_response():
    asked = []

    def judge(problem, response):
        asked.append(response.text)
        return 0.5, None
    scorer = Scorer(JUDGED, base_dir=REPO_ROOT, judge=judge)
    out = scorer.score(P, Response("19"))
    assert out.error is None and out.reward == pytest.approx(0.2 * 1.0 + 0.8 * 0.5)
    assert out.components == {"format": 1.0, "judge": 0.5} and asked == ["19"]


def test_an_unreadable_verdict_or_no_judge_scores_0_as_judge():
    from laminar_hpc.transport.judge_client import JudgeError
    unreadable = Scorer(JUDGED, base_dir=REPO_ROOT, judge=lambda p, r: (0.0, "the verdict 'hm' holds no number"))
    assert unreadable.score(P, Response("19")).error == "judge"

    def silent(problem, response):
        raise JudgeError("no judge answered within task.reward.judge.timeout_s=30s (asked judge-0, judge-0)")
    out = Scorer(JUDGED, base_dir=REPO_ROOT, judge=silent).score(P, Response("19"))
    assert out.error == "judge" and "no judge answered" in out.detail and out.reward == 0.0
    assert Scorer(JUDGED, base_dir=REPO_ROOT).score(P, Response("19")).error == "judge"  # not connected


def verl_with_judge(data_source, solution_str, ground_truth, extra_info=None, judge=None):
    # verl's compute_score with the verdict as one more keyword: a rule on the text plus the judge
    return {"score": 0.5 * (solution_str.strip() == ground_truth) + 0.5 * judge, "judged": judge}


def trl_with_judge(prompts, completions, judge, **kwargs):
    # TRL's batched form: the verdicts come as a list, one per completion, as the completions do
    return [j if c.strip() else 0.0 for c, j in zip(completions, judge)]


def verl_plain(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


@pytest.mark.parametrize("fn,reward", [("verl_with_judge", 0.5 * 1 + 0.5 * 0.25), ("trl_with_judge", 0.25)])
def test_verl_and_trl_functions_that_name_judge_get_the_verdict_in_their_own_form(fn, reward):
    asked = []

    def judge(problem, response):
        asked.append(response.text)
        return 0.25, None
    cfg = RewardCfg(fn=f"tests/unit/test_judge.py:{fn}", judge=JudgeCfg())
    out = Scorer(cfg, base_dir=REPO_ROOT, judge=judge).score(P, Response("19"))
    assert out.error is None and out.reward == pytest.approx(reward) and asked == ["19"]
    # without a judge in the campaign, a function that names one is refused when it is loaded
    with pytest.raises(RewardError, match="takes the judge's verdict"):
        Scorer(RewardCfg(fn=f"tests/unit/test_judge.py:{fn}"), base_dir=REPO_ROOT)


def test_a_verl_function_without_judge_is_called_as_before_in_a_judged_campaign():
    def judge(problem, response):
        raise AssertionError("nothing asks the judge when no function takes its verdict")
    cfg = RewardCfg(fn="tests/unit/test_judge.py:verl_plain", judge=JudgeCfg())
    out = Scorer(cfg, base_dir=REPO_ROOT, judge=judge).score(P, Response("19"))
    assert out.error is None and out.reward == 1.0


def test_a_function_that_takes_the_judge_needs_one():
    with pytest.raises(RewardError, match="takes the judge's verdict .* add task.reward.judge"):
        Scorer(RewardCfg(fn="tests/unit/test_judge.py:has_digits"), base_dir=REPO_ROOT)


# -- a discriminative reward model -------------------------------------------------------------------

def _hf_checkpoint(tmp_path, cls_name: str, **over):
    """A small Llama-shaped checkpoint of transformers' own classes, made for the test (random
    weights; the char tokenizer's vocabulary), saved as a Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    from laminar_hpc.model.tokenizer import CharTokenizer
    conf = transformers.LlamaConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                    max_position_embeddings=64, pad_token_id=0, **over)
    import torch
    torch.manual_seed(0)
    getattr(transformers, cls_name)(conf).save_pretrained(tmp_path / cls_name)
    return str(tmp_path / cls_name)


def test_a_sequence_classifier_scores_a_batch_as_it_scores_each_alone(tmp_path):
    path = _hf_checkpoint(tmp_path, "LlamaForSequenceClassification", num_labels=1)
    model = _model(kind="classifier", model={"hf_path": path, "max_seq_len": 64})
    together = model.score(REQUESTS)
    alone = [model.score([r])[0] for r in REQUESTS]
    assert [s.score for s in together] == pytest.approx([s.score for s in alone], abs=1e-5)
    assert all(s.error is None for s in together) and len({round(s.score, 6) for s in together}) > 1
    two = _model(kind="classifier", model={"hf_path": _hf_checkpoint(tmp_path / "b", "LlamaForSequenceClassification",
                                                                      num_labels=2), "max_seq_len": 64})
    assert all(0.0 < s.score < 1.0 for s in two.score(REQUESTS))  # the second label's probability


def test_a_checkpoint_that_is_not_a_reward_model_fails_at_start(tmp_path):
    from laminar_hpc.judge.judge_model import JudgeModelError
    causal = _hf_checkpoint(tmp_path, "LlamaForCausalLM")
    with pytest.raises(JudgeModelError, match=r"\['LlamaForCausalLM'\], not a sequence classifier"):
        _model(kind="classifier", model={"hf_path": causal, "max_seq_len": 64})
    three = _hf_checkpoint(tmp_path / "c", "LlamaForSequenceClassification", num_labels=3)
    with pytest.raises(JudgeModelError, match="has 3 labels"):
        _model(kind="classifier", model={"hf_path": three, "max_seq_len": 64})
    with pytest.raises(ConfigError, match="kind: classifier reads a Hugging Face"):
        config_from_dict({"task": {"reward": {"fn": "judge", "judge": {"kind": "classifier"}}}})


def test_the_controller_admits_the_campaigns_judges_and_no_other():
    from laminar_hpc.controller.membership import Membership
    members = Membership.of(config_from_dict({"task": {"reward": {"fn": "judge", "judge": {"replicas": 2}}}}))
    assert members.admits("judge-0") and members.admits("judge-1.hb")
    assert not members.admits("judge-2")  # a judge key's made-up rank is counted, not heard
    assert not Membership.of(config_from_dict({})).admits("judge-0")


# -- the start check ---------------------------------------------------------------------------------

def _check(judge: dict, tmp_path=None):
    from laminar_hpc.model.factory import build_tokenizer
    from laminar_hpc.tasks.preflight import check_judge
    cfg = JudgeCfg(**judge)
    check_judge(cfg, P, "problem 0 of the task", lambda: build_tokenizer(cfg.model))


def test_the_start_check_names_what_a_judge_could_not_do():
    from laminar_hpc.tasks.preflight import StartCheckError
    _check({"labels": {"Y": 1.0, "N": 0.0}, "template": "{problem}{response}?"})  # fits, labels apart: no error
    with pytest.raises(StartCheckError, match=r"task.reward.judge.labels: \['yes', 'yeah'\] begin with the same token"):
        _check({"labels": {"yes": 1.0, "yeah": 0.5}})
    with pytest.raises(StartCheckError, match=r"prompt for problem 0 of the task is \d+ tokens, over its "
                                              r"model.max_seq_len \(16\)"):
        _check({"labels": {"Y": 1.0, "N": 0.0}, "model": {"max_seq_len": 16}})


def test_the_start_check_refuses_a_checkpoint_that_is_not_a_classifier(tmp_path):
    from laminar_hpc.tasks.preflight import StartCheckError
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(StartCheckError, match=r"holds \['LlamaForCausalLM'\], not a sequence classifier"):
        _check({"kind": "classifier", "model": {"hf_path": str(tmp_path)}})
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    _check({"kind": "classifier", "model": {"hf_path": str(tmp_path)}})


def test_laminar_status_shows_each_judge_state_and_what_it_scored(tmp_path):
    import json
    from laminar_hpc.launch.status_report import judges_line
    from laminar_hpc.metrics.status import RoleEntry, Status
    from laminar_hpc.rundir import RunDir
    rd = RunDir(tmp_path)
    rd.judge_stats("judge-0").parent.mkdir()
    rd.judge_stats("judge-0").write_text(json.dumps({"scored": 1204, "batches": 400, "failed": 2, "busy_s": 4.8,
                                                     "batch_size": 8}))
    st = Status(roles={"judge-0": RoleEntry(pid=1, joined_t=1.0, last_seen=2.0, ready_t=1.5),
                       "judge-1": RoleEntry(pid=2, joined_t=1.0, last_seen=2.0, down=True)})
    assert judges_line(rd, st, 3) == ("judge-0 ready 1,204 scored (3.0 per batch of at most 8, 12 ms each, "
                                      "2 unreadable), judge-1 down, judge-2 not joined")


def test_trace_summary_counts_each_judges_batches():
    from laminar_hpc.analysis.judge_summary import judge_figures, render_judges
    events = [{"ev": "judge_batch", "role": "judge-0", "size": 3, "seconds": 0.010, "failed": 0},
              {"ev": "judge_batch", "role": "judge-0", "size": 1, "seconds": 0.030, "failed": 1},
              {"ev": "judge_batch", "role": "judge-1", "size": 8, "seconds": 0.020, "failed": 0},
              {"ev": "traj_finished", "role": "rollout-0"},
              *({"ev": "traj_scored", "role": "rollout-0", "wait_s": w} for w in (0.5, 0.1, 0.2, 0.3))]
    d = judge_figures(events)
    assert (d["requests"], d["batches"], d["size_max"], d["unreadable"]) == (12, 3, 8, 1)
    assert d["size_mean"] == pytest.approx(4.0) and d["seconds"] == {"p50": 0.020, "p90": 0.030, "max": 0.030}
    assert d["by_judge"]["judge-1"]["requests"] == 8 and d["by_judge"]["judge-0"]["unreadable"] == 1
    assert render_judges(d)[1].startswith("judges: 12 requests scored in 3 batches")
    assert d["score_wait_s"] == {"p50": 0.2, "p90": 0.5, "max": 0.5, "total": pytest.approx(1.1)}
    assert "waited for their rewards: p50 0.200 s, p90 0.500 s" in render_judges(d)[-1]
    assert judge_figures(events[3:]) is None and render_judges(None) == []

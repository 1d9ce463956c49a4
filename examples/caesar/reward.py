"""This example's reward, as user code: `task.reward: {fn: reward.py:score}` in config.yaml beside it.

laminar-hpc calls `score(problem, response)` for every finished response, in a pool beside the
rollout's decode loop (under task.reward.timeout_s). `problem` has `.prompt`, `.answer` (the
row's `answer`), `.messages` (chat rows) and `.fields` (the row's other fields: here `word` and
`shift`); `response` has `.text` (decoded, without the end-of-sequence token), `.token_ids` and
`.finish` ("eos" or "length"). Returning a dict makes each entry a component that is logged per
step (`reward.format`, `reward.correct` in metrics.jsonl); the reward is the sum of the ones
`task.reward.weights` names, each times its weight (both, here).
"""
from __future__ import annotations


def score(problem, response) -> dict[str, float]:
    text = response.text.strip()
    word = problem.fields["word"]
    # format: as many lowercase letters as the word, and the answer ended on its own
    well_formed = len(text) == len(word) and text.isalpha() and text.islower() and response.finish == "eos"
    return {"format": 1.0 if well_formed else 0.0, "correct": 1.0 if text == problem.answer else 0.0}

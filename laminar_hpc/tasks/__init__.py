"""Tasks: what a campaign trains on, in one sub-package per kind of thing it holds.

- `sources/`: where problems come from, one file per task type (`build.py` builds the one a
  config names), the dataset's rows and layouts, and the warm-up's demonstrations;
- `rewards/`: the reward functions and the Scorer that calls them (`scorer.py`), their
  signatures, values and pool, and the remote verifier;
- `tools/`: tool-use episodes: the environment interface and call format (`episode.py`), the
  tools a config names (`loader.py`), the calculator;
- `sandbox/`: the python tool's sandbox (`python_tool.py`) and its walls: bubblewrap, Landlock,
  the call's limits.

Beside them, what all of them share: a problem and a response (`problem.py`), a problem as the
model reads it (`prompts.py`) and the start check of a task (`preflight.py`)."""

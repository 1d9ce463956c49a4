"""Tasks: deterministic problem sources (`sources.py`, one file per task type), how a problem
becomes the model's prompt (`prompts.py`), their verifiable rewards (`rewards.py`, run in a
`reward_pool.py`) and the tool episodes with their sandbox (`episode.py`, `sandbox.py`)."""

"""Trainer role: GRPO/AIPO training, warm-up, checkpoints, weight publishing."""

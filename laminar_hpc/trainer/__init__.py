"""Trainer role: GRPO with a choice of off-policy corrections, warm-up, checkpoints, weight publishing."""

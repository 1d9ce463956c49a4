"""Rollout role: generation engines and the rollout process loop."""

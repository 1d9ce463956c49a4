"""Rewards from a model: judge replicas as roles of the campaign (`task.reward.judge`,
config/judge.py). verdicts.py renders a judge's prompt and reads its verdict; judge_model.py
scores a batch with the frozen model; server.py is the role (`python -m laminar_hpc.judge`);
transport/judge_client.py is how a rollout's reward call asks one."""

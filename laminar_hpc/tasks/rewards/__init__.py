"""Rewards: the reward functions and the Scorer that calls and checks them (`scorer.py`), the
signatures they may have (`reward_signatures.py`), what their values are worth
(`reward_values.py`), the pool that runs them off the decode loop (`reward_pool.py`) and the
remote verifier (`remote_verifier.py`). Their registries are config/reward_specs.py's."""

"""Megatron-core trainer backend (`trainer.backend: megatron`, extra `megatron`).

Imported only when that backend is chosen. `model` builds the GPTModel, `convert` maps weights
between our HF names and Megatron's shards, `engine` is one training rank (the policy-loss step, distributed
optimizer, export, dist_checkpointing), `runner` runs the ranks, `backend` is rank 0's side: the
trainer role's TrainBackend (trainer/backend_interface.py), whose every call is a command to all ranks.

    trainer:
      backend: megatron
      megatron: {tensor_parallel: 2, pipeline_parallel: 1, data_parallel: 2, dist_backend: nccl}
"""

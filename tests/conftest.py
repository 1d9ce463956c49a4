"""Shared test set-up: CPU-only, one torch thread per process (the CI machine has 2 cores)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_GSM8K = os.path.join(REPO, "..", "shared", "data", "gsm8k")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    import torch
    torch.set_num_threads(1)

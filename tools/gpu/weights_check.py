"""GPU check `weights`: the weight path's GB/s where it touches the GPU, for SmolLM2-135M's shape.

- pack: what Publisher.publish does after a train step (trainer/publisher.py): WeightStore.begin,
  WeightLayout.pack of the trainer's CUDA parameters into the /dev/shm hand-off slot, commit.
- pull: what a rollout does (rollout/node.py NodeWeights.pull): the newest version of a relay
  store copied into a TorchEngine's CUDA parameters, with and without the checksum.
- floors: one contiguous copy of the same bytes between the GPU and pinned host memory, each way.
Each in float32 (the default published layout) and bfloat16 (`trainer.publish_dtype` /
`rollout.weight_dtype: bfloat16`); medians of 5 after a warm-up. Passes when the pulled weights
equal the packed ones bit for bit. (The relay chain between hosts is CPU work: bench/bench_relay.py.)
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import DEVICE, finish, median_s, smollm2_args, start  # noqa: E402

start()
import torch  # noqa: E402

from laminar_hpc.model.llama import Transformer  # noqa: E402
from laminar_hpc.model.weights import WeightLayout  # noqa: E402
from laminar_hpc.rollout.node import NodeWeights  # noqa: E402
from laminar_hpc.transport.shm_dir import remove_private_dir  # noqa: E402
from laminar_hpc.transport.weight_store import WeightStore, checksum, digest_to_int  # noqa: E402


class Engine:
    """What a pull touches of TorchEngine: load_weights unpacks into its model."""

    def __init__(self, model):
        self.model, self.version = model, -1

    def load_weights(self, version, buf, layout, checksum=False, in_flight=False):
        return layout.unpack(buf, self.model, checksum=checksum)


torch.manual_seed(0)
args = smollm2_args()
figs: dict = {"model": "SmolLM2-135M shape"}
problems: list[str] = []
shm = tempfile.mkdtemp(prefix="laminar-gpucheck-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
try:
    for dtype in ("float32", "bfloat16"):
        trainer = Transformer(args).to(DEVICE)  # the trainer keeps float32 parameters; the layout casts
        rollout = Engine(Transformer(args).to(DEVICE).to(getattr(torch, dtype)))
        layout = WeightLayout.from_model(trainer, dtype)
        n, digest = layout.nbytes, digest_to_int(layout.digest)
        handoff = WeightStore.create(os.path.join(shm, f"handoff-{dtype}"), slots=3, capacity=n)
        relay = WeightStore.create(os.path.join(shm, f"relay-{dtype}"), slots=3, capacity=n)
        version = [0]

        def pack():
            version[0] += 1
            slot, buf = handoff.begin(version[0])
            layout.pack(trainer, buf)
            handoff.commit(slot, version[0], n, 0, digest)
        pack_s = median_s(pack)
        slot, buf = relay.begin(1)  # what the relays hold: the same bytes, checksummed
        layout.pack(trainer, buf)
        relay.commit(slot, 1, n, checksum(buf[:n]), digest)
        weights = NodeWeights(relay.path)
        weights.newest()
        pull_s = median_s(lambda: weights.pull(rollout, layout, verify=False))
        pull_verify_s = median_s(lambda: weights.pull(rollout, layout, verify=True))
        want = {k: p.detach().to(getattr(torch, dtype)) for k, p in trainer.named_parameters()}
        if not all(torch.equal(p, want[k]) for k, p in rollout.model.named_parameters()):
            problems.append(f"{dtype}: the pulled weights differ from the trainer's")
        tag = "" if dtype == "float32" else "_bf16"
        figs.update({f"MB{tag}": round(n / 1e6, 1), f"pack_GBps{tag}": round(n / pack_s / 1e9, 2),
                     f"pull_GBps{tag}": round(n / pull_s / 1e9, 2),
                     f"pull_verify_GBps{tag}": round(n / pull_verify_s / 1e9, 2)})
        if dtype == "float32" and DEVICE == "cuda":
            flat = torch.empty(n, dtype=torch.uint8, device=DEVICE)
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            figs["d2h_pinned_GBps"] = round(n / median_s(lambda: host.copy_(flat, non_blocking=True)) / 1e9, 2)
            figs["h2d_pinned_GBps"] = round(n / median_s(lambda: flat.copy_(host, non_blocking=True)) / 1e9, 2)
            del flat, host
        weights.store.close()
        for s in (handoff, relay):
            s.close()
            s.unlink()
        trainer = rollout = None  # freed before the next dtype
finally:
    remove_private_dir(shm)
finish(not problems, figs, "; ".join(problems))

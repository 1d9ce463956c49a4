"""The master relay's reshard: the trainer publishes in its layout, rollouts load theirs.

The trainer hands off the cheapest thing for it to write: its weights as they are (e.g.
float32 master weights, or the HF-named tensors rank 0 of a Megatron trainer gathered), in
`trainer.publish_dtype`. When the rollouts load another layout (`rollout.weight_dtype`, e.g.
bfloat16 for vLLM), the master relay converts each version once, tensor by tensor by HF name,
before the chain broadcast: the trainer never stalls for the cast, and the chain and every pull
move the rollouts' (smaller) bytes. Both layouts come from the model's shape, so a mismatch is
caught by the layout digest on either side.

The master converts piece by piece (`pieces`), on several threads, while it sends the pieces
already converted down the chain (relay/pipeline.py).

    rs = Reshard.from_config(cfg)                 # None when both sides share one layout
    rs.convert(handoff_view, slot_view)           # src layout -> dst layout, one pass
    fill = rs.pieces(handoff_view, slot_view)     # fill(lo, hi): dst bytes [lo, hi) converted, hashed
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from laminar_hpc.config.backend_specs import rollout_backend
from laminar_hpc.transport.store_layout import rollout_dtype
from laminar_hpc.transport.weight_store import digest_to_int, piece_digest

if TYPE_CHECKING:
    from laminar_hpc.config import Config


class Reshard:
    def __init__(self, src, dst):
        if [(s.name, s.shape) for s in src.specs] != [(s.name, s.shape) for s in dst.specs]:
            raise ValueError("the published and the rollout layouts hold different tensors: "
                             "trainer and rollouts must build the same model.* shape")
        self.src, self.dst = src, dst
        self.src_digest, self.dst_digest = digest_to_int(src.digest), digest_to_int(dst.digest)

    @classmethod
    def from_config(cls, cfg: Config) -> Reshard | None:
        if not rollout_backend(cfg).reshards(cfg, rollout_dtype(cfg)):
            return None
        from laminar_hpc.model.factory import build_tokenizer, model_args
        from laminar_hpc.model.weights import layout_for
        args = model_args(cfg.model, build_tokenizer(cfg.model).vocab_size)
        return cls(layout_for(args, cfg.trainer.publish_dtype), layout_for(args, rollout_dtype(cfg)))

    def convert(self, src_buf: memoryview, dst_buf: memoryview) -> None:
        """dst_buf <- src_buf, each tensor cast to the rollout layout's dtype. (Alignment padding
        keeps whatever the slot held: the checksum is taken after the conversion.)"""
        import torch
        src = self.src.views(src_buf)
        with torch.no_grad():
            for name, t in self.dst.views(dst_buf).items():
                t.copy_(src[name])

    def pieces(self, src_buf: memoryview, dst_buf: memoryview):
        """`fill(lo, hi) -> digest`: converts the elements whose rollout-layout bytes lie in
        [lo, hi) and returns the xxh3 digest of those bytes (padding as the slot held it). Piece
        bounds must fall on element bounds: the checksum pieces (4 MiB multiples) do, since every
        tensor starts 64-byte aligned. The views are made once per version, not per piece."""
        import torch
        src = {k: t.reshape(-1) for k, t in self.src.views(src_buf).items()}
        dst = [(s.offset, s.nbytes, t.reshape(-1), src[s.name])
               for s, t in zip(self.dst.specs, self.dst.views(dst_buf).values()) if s.nbytes]
        starts = [d[0] for d in dst]

        def fill(lo: int, hi: int) -> int:
            first, end = max(0, bisect.bisect_right(starts, lo) - 1), bisect.bisect_left(starts, hi)
            with torch.no_grad():
                for off, nbytes, d, s in dst[first:end]:
                    a, b = max(lo, off) - off, min(hi, off + nbytes) - off
                    if a < b:
                        item = d.element_size()
                        if a % item or b % item:
                            raise ValueError(f"piece [{lo}, {hi}) splits an element of a tensor at {off}")
                        d[a // item:b // item].copy_(s[a // item:b // item])
            return piece_digest(dst_buf[lo:hi])
        return fill

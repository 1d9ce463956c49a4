"""The chain broadcast's fixed-size header (laminar_hpc.relay.chain), packed and unpacked in-process;
the broadcast itself runs under a real mpirun in tests/integration/test_chain.py."""
from __future__ import annotations

import numpy as np

from laminar_hpc.relay.chain import STOP, WEIGHTS, Header


def test_header_pack_round_trip():
    hdr = Header(kind=WEIGHTS, version=12, nbytes=3 << 30, checksum=-(2**62), digest=2**59 + 3,
                 t_ns=1_700_000_000_000_000_000)
    arr = hdr.pack()
    assert arr.dtype == np.int64 and arr.shape == (6,)
    assert Header.unpack(arr) == hdr
    assert Header.unpack(Header(kind=STOP).pack()) == Header(STOP, -1, 0, 0, 0, 0)

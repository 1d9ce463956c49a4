"""The chain broadcast's fixed-size header (laminar_hpc.relay.chain), packed and unpacked in-process;
the broadcast itself runs under a real mpirun in tests/integration/test_chain.py."""
from __future__ import annotations

import numpy as np

from laminar_hpc.relay.chain import DISCARD, SEALED, STOP, WEIGHTS, Header


def test_header_pack_round_trip():
    hdr = Header(kind=WEIGHTS, version=12, nbytes=3 << 30, checksum=-(2**62), digest=2**59 + 3,
                 t_ns=1_700_000_000_000_000_000)
    arr = hdr.pack()
    assert arr.dtype == np.int64 and arr.shape == (6,)
    assert Header.unpack(arr) == hdr
    assert Header.unpack(Header(kind=STOP).pack()) == Header(STOP, -1, 0, 0, 0, 0)


def test_the_trailer_is_a_header_that_carries_the_checksum():
    """The master knows the checksum only after the bytes: the trailer (kind SEALED, or DISCARD
    when its copy was overtaken) repeats version, nbytes and digest, and adds the checksum."""
    lead = Header(kind=WEIGHTS, version=3, nbytes=10, checksum=0, digest=9, t_ns=5)
    for kind in (SEALED, DISCARD):
        trailer = Header(kind, lead.version, lead.nbytes, -77, lead.digest, lead.t_ns)
        assert Header.unpack(trailer.pack()) == trailer
    assert len({WEIGHTS, STOP, SEALED, DISCARD}) == 4

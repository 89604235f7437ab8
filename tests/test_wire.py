"""The wire format (swarmfd.comm.wire) on its own: plain data, no plane.

(Decoding garbage and recovering shapes from their hash: tests/test_fuzz.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

from swarmfd.comm import wire
from swarmfd.errors import ProtocolError


def _sig(**kw: object) -> wire.Signature:
    base = dict(coll=wire.Collective.ALL_REDUCE, op=wire.ReduceOp.SUM,
                dtype=wire.dtype_code(np.dtype(np.float32)), count=6,
                shape=wire.shape_hash((2, 3)))
    base.update(kw)
    return wire.Signature(**base)  # type: ignore[arg-type]


def test_a_header_round_trips_every_field() -> None:
    sig = _sig(root=3, fused=True)
    raw = wire.pack_header(wire.Kind.DATA, sig, src=5, seq=(1 << 32) + 9, tag=77, nbytes=24,
                           group=0xBEEF)
    assert len(raw) == wire.HEADER_SIZE == 40
    hdr = wire.unpack_header(raw)
    assert (hdr.kind, hdr.coll, hdr.op, hdr.dtype, hdr.src, hdr.root, hdr.seq, hdr.tag,
            hdr.count, hdr.shape, hdr.nbytes, hdr.group, hdr.fused, hdr.inline) == (
        wire.Kind.DATA, wire.Collective.ALL_REDUCE, wire.ReduceOp.SUM, sig.dtype, 5, 3,
        9, 77, 6, sig.shape, 24, 0xBEEF, True, False)  # the sequence travels modulo 2**32
    assert hdr.matches(sig)
    for field, value in [("op", wire.ReduceOp.MAX), ("count", 7), ("root", 0),
                         ("shape", wire.shape_hash((3, 2))), ("coll", wire.Collective.REDUCE),
                         ("dtype", wire.dtype_code(np.dtype(np.float64)))]:
        assert not hdr.matches(_sig(**{"root": 3, field: value})), field


def test_the_receiver_reads_the_senders_signature_with_its_shape() -> None:
    hdr = wire.unpack_header(wire.pack_header(wire.Kind.DATA, _sig(), 1, 4, 0, 24))
    assert hdr.signature().describe() == "(all_reduce, op=sum, dtype=float32, shape=(2, 3))"
    fused = wire.unpack_header(wire.pack_header(wire.Kind.DATA, _sig(fused=True), 1, 4, 0, 24))
    assert "a list, 6 elements" in fused.signature().describe()


def test_an_uneven_all_gather_reads_as_all_gather_of_rows() -> None:
    for trailing, shown in [((), "(rows,)"), ((5,), "(rows, 5)"), ((2, 3), "(rows, 2, 3)")]:
        sig = wire.Signature(wire.Collective.ALL_GATHER_V, dtype=wire.dtype_code(
            np.dtype(np.int64)), count=int(np.prod(trailing)), shape=wire.shape_hash(trailing),
            shape_repr=wire.rows_repr(str(trailing)))
        assert sig.describe() == f"(all_gather, dtype=int64, shape={shown})"
        hdr = wire.unpack_header(wire.pack_header(wire.Kind.DATA, sig, 0, 1, 0, 0))
        assert hdr.signature().describe() == sig.describe()
        # Not the same call as an all_gather with out= of a first dimension of one row.
        assert not hdr.matches(wire.Signature(wire.Collective.ALL_GATHER, dtype=sig.dtype,
                                              count=sig.count, shape=sig.shape))


def test_a_mismatch_error_names_both_sides_and_the_rank() -> None:
    mine = _sig()
    theirs = wire.unpack_header(wire.pack_header(
        wire.Kind.DATA, _sig(op=wire.ReduceOp.MAX), src=2, seq=8, tag=0, nbytes=24))
    msg = str(wire.mismatch_error(0, mine, theirs))
    assert "rank 0 called (all_reduce, op=sum" in msg and "rank 2 called (all_reduce, op=max" \
        in msg and "call #8" in msg, msg


def test_point_to_point_keys_never_meet_a_collectives() -> None:
    sig = wire.Signature(wire.Collective.P2P, root=wire.RTS_PIECE)
    hdr = wire.unpack_header(wire.pack_header(wire.Kind.P2P, sig, 3, 5, 9, 0, group=2))
    assert wire.message_key(hdr) == wire.p2p_key(2, 3, 5, 9, wire.RTS_PIECE)
    data = wire.unpack_header(wire.pack_header(wire.Kind.DATA, _sig(), 3, 5, 9, 0, group=2))
    assert wire.message_key(data) == (2, 3, 5, 9)
    assert wire.message_key(hdr) != wire.message_key(data)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.float16,
                                   np.float32, np.float64, np.complex64, np.complex128])
def test_every_numeric_dtype_has_a_stable_code(dtype: type) -> None:
    code = wire.dtype_code(np.dtype(dtype))
    assert wire.DTYPES[code] == np.dtype(dtype)
    assert wire.dtype_name(code) == np.dtype(dtype).name


@pytest.mark.parametrize("dtype", [np.bool_, np.str_, np.object_, np.dtype(">f4")])
def test_other_dtypes_are_refused_naming_the_supported_ones(dtype: object) -> None:
    with pytest.raises(TypeError, match="float32"):
        wire.dtype_code(np.dtype(dtype))


@pytest.mark.waits  # a peer waits for its timeout
def test_a_header_of_another_protocol_version_is_refused_naming_both() -> None:
    raw = bytearray(wire.pack_header(wire.Kind.DATA, _sig(), 0, 1, 0, 0))
    raw[4] = wire.PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"version {wire.PROTOCOL_VERSION + 1}.*"
                                            f"version {wire.PROTOCOL_VERSION}"):
        wire.unpack_header(bytes(raw))

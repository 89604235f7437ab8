"""The wire format: a fixed binary header in front of a raw numpy buffer.

Every message is a 40-byte header and a payload (raw array bytes, or UTF-8 JSON for
control messages). Nothing is pickled: arrays are rebuilt with ``np.frombuffer`` from a
dtype code checked against a fixed table. Every header carries the call's *signature*
(collective, op, dtype, root, count, shape hash), so a receiver catches ranks that
called different collectives, or other arguments, at the first message.

Layout (little-endian)::

    magic    4s  b"SWFD"
    version  B   PROTOCOL_VERSION
    kind     B   Kind (DATA, ABORT, ...)
    coll     B   Collective
    op       B   ReduceOp
    dtype    B   code from DTYPES
    flags    B   FLAG_INLINE (payload in the header's frame), FLAG_LIST
    src      H   sender rank
    root     H   root / src / dst rank, NO_ROOT when the collective has none
    seq      I   collective sequence number within the group
    tag      I   message index within the collective
    count    Q   element count of the collective's buffer
    shape    I   CRC32 of the shape tuple (catches (2, 3) vs (3, 2))
    nbytes   I   payload length in bytes
    group    H   the process group the message belongs to (0: the world)
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import CollectiveTimeout, MismatchError, ProtocolError

__all__ = ["ANY_SIZE", "DTYPES", "DTYPE_CODES", "FLAG_INLINE", "FLAG_LIST", "HEADER", "HEADER_SIZE",
           "MAGIC", "MAX_ABORT_TEXT", "MAX_PAYLOAD", "NO_ROOT", "P2P_KEYS", "PIECE_BYTES",
           "PROTOCOL_VERSION", "READY_PIECE", "RTS_PIECE", "SEQ_AT", "SUPPORTED_DTYPE_NAMES",
           "Collective", "Header", "Kind", "ReduceOp", "Signature", "cut_header", "dtype_code",
           "dtype_name", "finished_call_error", "list_repr", "message_key", "mismatch_error",
           "p2p_key", "pack_header", "recover_shape", "rows_repr", "seq_bytes", "shape_hash",
           "timeout_error", "too_large", "unpack_header"]

MAGIC = b"SWFD"
PROTOCOL_VERSION = 2
NO_ROOT = 0xFFFF

#: Target size of one data message: buffers travel in pieces of about this size, so a
#: receiver can refuse anything over MAX_PAYLOAD (docs/algorithms.md).
PIECE_BYTES = 1 << 20
#: The largest payload: a piece rounded up to whole elements, with room to spare.
MAX_PAYLOAD = PIECE_BYTES + 1024
#: The ``nbytes`` of a receive that takes any size up to MAX_PAYLOAD (the algorithm
#: checks what came).
ANY_SIZE = -1
#: The longest reason text an abort message carries (so it stays far below MAX_PAYLOAD).
MAX_ABORT_TEXT = 8192

HEADER = struct.Struct("<4sBBBBBBHHIIQIIH")
FLAG_INLINE = 1
#: The call's buffer is a list of arrays fused into one (its shape hash covers them all).
FLAG_LIST = 2
HEADER_SIZE = HEADER.size  # 40


class Kind(enum.IntEnum):
    """What a message is."""

    DATA = 1
    ABORT = 2
    #: A piece of a point-to-point message (``root``: the piece number; RTS_PIECE: the
    #: request to send a large one), matched by (group, source, sequence, tag).
    P2P = 3
    #: The receiver of a large point-to-point message is ready for it (clear to send).
    P2P_READY = 4
    #: A status query or its answer (JSON, :mod:`swarmfd.comm.status`): which call of a
    #: group a peer has entered, asked by a rank whose wait stalls.
    STATUS = 5


#: The ``root`` of a point-to-point request to send, and of a ready message.
RTS_PIECE = 0xFFFF
READY_PIECE = 0xFFFE
#: Group ids of point-to-point keys are offset by this, so they never meet a collective's.
P2P_KEYS = 0x10000


class Collective(enum.IntEnum):
    """Which collective a message belongs to."""

    NONE = 0
    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    BARRIER = 5
    REDUCE_SCATTER = 6
    ALL_TO_ALL = 7
    GATHER = 8
    SCATTER = 9
    #: Point-to-point messages (send/recv): their own sequence per peer and tag.
    P2P = 10
    #: The sizes exchanged before a collective of uneven parts (all_gather, all_to_all).
    SIZES = 11
    #: all_gather whose first dimension may differ between ranks: count is one row's
    #: elements, the shape hash the trailing dimensions'; it reads as all_gather.
    ALL_GATHER_V = 12

    @property
    def label(self) -> str:
        return "all_gather" if self is Collective.ALL_GATHER_V else self.name.lower()


class ReduceOp(enum.IntEnum):
    """Reduction applied by all_reduce / reduce (NONE for the others)."""

    NONE = 0
    SUM = 1
    PROD = 2
    MIN = 3
    MAX = 4
    MEAN = 5  # reduces as SUM; distinct on the wire so sum-vs-mean is a mismatch

    @property
    def label(self) -> str:
        return self.name.lower()


#: The dtypes swarmfd moves, with their stable wire codes. Native byte order only.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.int8),
    2: np.dtype(np.int16),
    3: np.dtype(np.int32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint8),
    6: np.dtype(np.uint16),
    7: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
    9: np.dtype(np.float16),
    10: np.dtype(np.float32),
    11: np.dtype(np.float64),
    12: np.dtype(np.complex64),
    13: np.dtype(np.complex128),
}
DTYPE_CODES: dict[np.dtype, int] = {dt: code for code, dt in DTYPES.items()}
SUPPORTED_DTYPE_NAMES = ", ".join(str(dt) for dt in DTYPES.values())


def dtype_code(dtype: np.dtype) -> int:
    """Wire code of ``dtype``; raises ``TypeError`` naming the supported dtypes."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        extra = ""
        if dtype.kind in "iufc" and dtype.byteorder not in ("=", "|"):
            extra = " (non-native byte order: convert with .astype(dtype.newbyteorder('=')))"
        raise TypeError(
            f"unsupported dtype {dtype}{extra}: expected one of {SUPPORTED_DTYPE_NAMES}"
        )
    return code


def dtype_name(code: int) -> str:
    """Human name of a wire dtype code (for error messages)."""
    dt = DTYPES.get(code)
    return str(dt) if dt is not None else f"<dtype code {code}>"


def shape_hash(shape: tuple[object, ...]) -> int:
    """A 32-bit fingerprint of a shape (or a tuple of shapes), carried in every header."""
    return zlib.crc32(repr(shape).encode())


#: recover_shape gives up on element counts above this (trial division gets slow).
_RECOVER_MAX_COUNT = 1 << 32
#: recover_shape's budget, in 4-D shape hashes (a 2-D or 3-D shape costs 3): tens of
#: milliseconds at worst, where the most composite counts took a second (docs/performance.md).
_RECOVER_MAX_WORK = 200_000


def _prime_factors(n: int) -> dict[int, int]:
    """{prime: exponent} of ``n`` >= 1, by trial division (n <= 2**32: < 2**15 steps)."""
    factors: dict[int, int] = {}
    d = 2
    while d * d <= n:
        while n % d == 0:
            factors[d] = factors.get(d, 0) + 1
            n //= d
        d += 1 if d == 2 else 2
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def _shape_count(factors: dict[int, int], dims: int) -> int:
    """How many shapes of ``dims`` dimensions have the element count ``factors`` describes."""
    return math.prod(math.comb(e + dims - 1, dims - 1) for e in factors.values())


def recover_shape(count: int, crc: int) -> str:
    """The shape of up to 4 dimensions of ``count`` elements whose hash is ``crc``, or
    "": names the sender's shape in a mismatch error, by hashing every candidate within
    ``_RECOVER_MAX_WORK`` (the most composite counts skip 4-D, then 3-D shapes)."""
    if count == 1 and crc == shape_hash(()):
        return "()"
    if count < 0 or count > _RECOVER_MAX_COUNT:
        return ""
    if count == 0:
        return "(0,)" if crc == shape_hash((0,)) else ""
    if crc == shape_hash((count,)):
        return str((count,))
    factors = _prime_factors(count)
    divisor_lists: dict[int, list[int]] = {}
    tail_lists: dict[int, list[bytes]] = {}

    def divisors(m: int) -> list[int]:
        """The divisors of ``m`` (a divisor of ``count``), in increasing order."""
        got = divisor_lists.get(m)
        if got is None:
            got = [1]
            for p in factors:
                powers, rest = [1], m
                while rest % p == 0:
                    rest //= p
                    powers.append(powers[-1] * p)
                got = [d * q for d in got for q in powers]
            got.sort()
            divisor_lists[m] = got
        return got

    # shape_hash of (a, b, c) is the CRC of "(a, b, c)": extend the CRC of a prefix
    # "(a, " by each tail "b, c)" instead of hashing every whole shape.
    every = divisors(count)
    comma = {d: b"%d, " % d for d in every}
    close = {d: b"%d)" % d for d in every}

    def search(prefix: tuple[int, ...], prefix_crc: int, rest: int, dims: int) -> str:
        """The shape prefix + (``dims`` more dimensions of ``rest`` elements) hashing to crc."""
        ds = divisors(rest)
        if dims > 2:
            for a in ds:
                found = search((*prefix, a), zlib.crc32(comma[a], prefix_crc), rest // a,
                               dims - 1)
                if found:
                    return found
            return ""
        tails = tail_lists.get(rest)
        if tails is None:  # "b, rest // b)" for each divisor b (rest // ds[i] is ds[-1 - i])
            tails = tail_lists[rest] = list(map(operator.add, map(comma.__getitem__, ds),
                                                map(close.__getitem__, reversed(ds))))
        hashes = list(map(zlib.crc32, tails, itertools.repeat(prefix_crc, len(tails))))
        if crc not in hashes:
            return ""
        b = ds[hashes.index(crc)]
        return str((*prefix, b, rest // b))

    budget = _RECOVER_MAX_WORK
    for dims in (2, 3, 4):
        budget -= _shape_count(factors, dims) * (1 if dims == 4 else 3)
        if budget < 0:
            return ""
        found = search((), zlib.crc32(b"("), count, dims)
        if found:
            return found
    return ""


@dataclass(frozen=True)
class Signature:
    """What every rank of one collective call must agree on."""

    coll: Collective
    op: ReduceOp = ReduceOp.NONE
    dtype: int = 0
    root: int = NO_ROOT
    count: int = 0
    shape: int = 0
    shape_repr: str = ""
    #: A list of arrays fused into one buffer (FLAG_LIST; not compared: its shape hash
    #: differs already).
    fused: bool = False
    #: What :meth:`Header.matches` compares: (coll, op, dtype, root, count, shape).
    key: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.coll, self.op, self.dtype, self.root,
                                         self.count, self.shape))

    def describe(self) -> str:
        """A readable form for error messages."""
        parts = [self.coll.label]
        if self.op != ReduceOp.NONE:
            parts.append(f"op={self.op.label}")
        if self.dtype:
            parts.append(f"dtype={dtype_name(self.dtype)}")
        if self.shape_repr:
            parts.append(f"shape={self.shape_repr}")
        elif self.count or self.dtype:
            parts.append(f"count={self.count}")
        if self.root != NO_ROOT:
            parts.append(f"root={self.root}")
        return "(" + ", ".join(parts) + ")"


class Header(NamedTuple):
    """A decoded message header (a named tuple: cheap to build once per message)."""

    kind: int
    coll: int
    op: int
    dtype: int
    src: int
    root: int
    seq: int
    tag: int
    count: int
    shape: int
    nbytes: int
    inline: bool = False
    group: int = 0
    fused: bool = False

    def signature(self) -> Signature:
        """The sender's view of the signature (its shape by :func:`recover_shape`)."""
        try:
            coll = Collective(self.coll)
        except ValueError:
            coll = Collective.NONE
        try:
            op = ReduceOp(self.op)
        except ValueError:
            op = ReduceOp.NONE
        if self.fused:
            shape = list_repr(None, self.count)
        else:
            shape = recover_shape(self.count, self.shape) if self.dtype else ""
            if shape and coll is Collective.ALL_GATHER_V:
                shape = rows_repr(shape)
        return Signature(coll, op, self.dtype, self.root, self.count, self.shape, shape,
                         self.fused)

    def matches(self, sig: Signature) -> bool:
        """True when the sender agrees with ``sig`` (the receiver's own view)."""
        return (self.coll, self.op, self.dtype, self.root, self.count, self.shape) == sig.key


def rows_repr(trailing: str) -> str:
    """How a signature of an uneven all_gather shows its shape: ``(rows, *trailing)``,
    from the repr of the trailing dimensions (``"()"``, ``"(5,)"``, ``"(2, 3)"``)."""
    inner = trailing.strip("()").rstrip(",").strip()
    return f"(rows, {inner})" if inner else "(rows,)"


def list_repr(arrays: int | None, elements: int) -> str:
    """How a signature describes a list of arrays (the receiver knows only the total)."""
    return f"{'a list' if arrays is None else f'{arrays} arrays'}, {elements} elements"


def pack_header(kind: int, sig: Signature, src: int, seq: int, tag: int, nbytes: int,
                flags: int = 0, group: int = 0) -> bytes:
    """Encode one header."""
    if sig.fused:
        flags |= FLAG_LIST
    return HEADER.pack(
        MAGIC, PROTOCOL_VERSION, kind, sig.coll, sig.op, sig.dtype, flags, src, sig.root,
        seq & 0xFFFFFFFF, tag, sig.count & 0xFFFFFFFFFFFFFFFF, sig.shape, nbytes, group,
    )


#: Where a header carries the call's number (magic, version, kind, coll, op, dtype, flags,
#: src, root, then seq): :func:`cut_header` cuts a header around it.
SEQ_AT = 14


def cut_header(kind: int, sig: Signature, src: int, tag: int, nbytes: int, flags: int = 0,
               group: int = 0) -> tuple[bytes, bytes]:
    """:func:`pack_header`'s header cut around the call's number: a repeated call packs
    its headers once and joins the parts around each run's :func:`seq_bytes`."""
    header = pack_header(kind, sig, src, 0, tag, nbytes, flags, group)
    return header[:SEQ_AT], header[SEQ_AT + 4:]


def seq_bytes(seq: int) -> bytes:
    """The call's number as a header carries it (see :func:`cut_header`)."""
    return (seq & 0xFFFFFFFF).to_bytes(4, "little")


_new_header = tuple.__new__


def too_large(size: int) -> ValueError:
    """The error for a message of ``size`` bytes over MAX_PAYLOAD: a bug, since
    collectives cut buffers into pieces first."""
    return ValueError(f"swarmfd bug: a message of {size} bytes exceeds the limit of "
                      f"{MAX_PAYLOAD}; collectives must cut buffers into pieces")


def unpack_header(data: bytes | memoryview) -> Header:
    """Decode and validate a header (followed by its payload when inline); raises
    :class:`ProtocolError` on garbage."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"bad header length {len(data)}, expected {HEADER_SIZE}")
    (magic, version, kind, coll, op, dtype, flags, src, root, seq, tag, count, shape, nbytes,
     group) = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks swarmfd wire protocol version {version}, this process speaks "
            f"version {PROTOCOL_VERSION}"
        )
    inline = flags & FLAG_INLINE != 0
    if len(data) != (HEADER_SIZE + nbytes if inline else HEADER_SIZE):
        raise ProtocolError(f"frame of {len(data)} bytes does not match its header "
                            f"({nbytes} payload bytes, inline={inline})")
    # (Header(...) without its Python-level __new__: one per message.)
    return _new_header(Header, (kind, coll, op, dtype, src, root, seq, tag, count, shape,
                                nbytes, inline, group, flags & FLAG_LIST != 0))


# -- error messages shared by the channels (TCP and shared memory) ----------------------


def message_key(hdr: Header) -> tuple[int, int, int, int]:
    """What a receive names: (group, source, sequence, tag) of a collective's message; a
    point-to-point one's group is offset by P2P_KEYS and its tag carries the piece."""
    if hdr.kind == Kind.DATA or hdr.kind == Kind.ABORT:
        return (hdr.group, hdr.src, hdr.seq, hdr.tag)
    return (P2P_KEYS | hdr.group, hdr.src, hdr.seq, (hdr.tag << 16) | hdr.root)


def p2p_key(group: int, src: int, seq: int, tag: int, piece: int) -> tuple[int, int, int, int]:
    """The key of piece ``piece`` of a point-to-point message (see :func:`message_key`)."""
    return (P2P_KEYS | group, src, seq & 0xFFFFFFFF, (tag << 16) | piece)


def mismatch_error(rank: int, sig: Signature, hdr: Header) -> MismatchError:
    """The error for a message ``hdr`` of this call whose signature disagrees with ``sig``."""
    if sig.coll == Collective.P2P:
        theirs = hdr.signature()
        return MismatchError(
            f"send/recv mismatch: rank {hdr.src} sent {theirs.describe()} with tag {hdr.tag} "
            f"as its message #{hdr.seq} to rank {rank}, whose recv expects {sig.describe()}; "
            "a recv must match its send's dtype and shape"
        )
    return MismatchError(
        f"collective mismatch at call #{hdr.seq}: rank {rank} called "
        f"{sig.describe()} but rank {hdr.src} called {hdr.signature().describe()}; every "
        "rank must call the same collectives in the same order with the same dtype, shape, "
        "op and root"
    )


def finished_call_error(rank: int, hdr: Header) -> MismatchError:
    """The error for a message ``hdr`` of a call ``rank`` already finished: its sender
    was in another collective (a call consumes all its messages)."""
    return MismatchError(
        f"collective mismatch: rank {hdr.src} sent a message of "
        f"{hdr.signature().describe()} for call #{hdr.seq}, which rank {rank} had already "
        "finished as another collective; every rank must call the same collectives in the "
        "same order"
    )


def timeout_error(activity: str, sig: Signature, timeout: float, culprit: int,
                  where: str = "", waits: str = "") -> CollectiveTimeout:
    """The error for a wait that timed out on rank ``culprit``; ``where`` (its address)
    and ``waits`` (the chain of waiting ranks) where known."""
    at = f" ({where})" if where else ""
    hint = ("set the timeout with init(timeout=...), SWARMFD_TIMEOUT, or swarmfd run/deploy "
            "--timeout")
    if waits:
        hint = f"waits: {waits}; {hint}"
    return CollectiveTimeout(
        f"{activity} {sig.describe()}: timed out after {timeout:g} s waiting for rank "
        f"{culprit}{at}; it may be stuck, stopped or in another collective ({hint})"
    )


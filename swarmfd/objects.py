"""The objects :func:`swarmfd.broadcast_object` and :func:`swarmfd.all_gather_object`
move: plain values in a tagged JSON form, never pickled.

What travels: None, bool, int, float (NaN, infinities), str, bytes, bytearray, and
lists, tuples, dicts (any of these as keys), sets and frozensets of them; numpy scalars
(up to 64 bits) as int, float, bool, a memoryview as bytes. What JSON lacks is written
``{"$": [TAG, PAYLOAD]}`` (so is a dict whose only key is ``"$"``); a top-level ``bytes``
travels raw. Every rank, the sender included, returns the decoded value, so all get the
same. An object that cannot travel travels as a *refusal* entry naming the key path, and
:func:`decode` raises the same error on every rank: no peer is left waiting. Decoding is
bounded (MAX_OBJECT_BYTES checked before allocating, MAX_DEPTH, Python's int digit
limit) and builds only these types.
"""

from __future__ import annotations

import base64
import binascii
import json
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ProtocolError

__all__ = ["MAX_DEPTH", "MAX_INT_BITS", "MAX_OBJECT_BYTES", "decode", "decode_all", "encode"]

#: The largest object broadcast_object / all_gather_object move (encoded), on every rank:
#: a receiver refuses a larger announced size before it allocates anything.
MAX_OBJECT_BYTES = 64 << 20
#: The deepest nesting of containers (a list in a dict is 2): decoding recurses, and a
#: caller deep in its own stack could exhaust Python's recursion limit.
MAX_DEPTH = 32
#: The largest int (bits) an object may carry: under Python's 4300-digit limit.
MAX_INT_BITS = 14_000
#: The key of a tagged value, and the tags.
_TAG = "$"
_SEQUENCES = {"tuple": tuple, "set": set, "frozenset": frozenset}
_BYTES = {"bytes": bytes, "bytearray": bytearray}
#: The first byte of an entry: tagged JSON, raw bytes, a refusal (then T or V: the
#: error's type, and its message).
_JSON, _RAW, _REFUSED = b"J", b"B", b"!"
_ERRORS: dict[bytes, type[Exception]] = {b"T": TypeError, b"V": ValueError}
_MAX_REASON = 2000
_SUPPORTED = ("None, bool, int, float, str, bytes, bytearray, and lists, tuples, dicts, "
              "sets and frozensets of them")


class _Refused(Exception):
    """An object that cannot travel (raised while packing, carried in a refusal entry)."""

    def __init__(self, error: type[Exception], path: str, problem: str) -> None:
        if len(path) > 120:
            path = f"{path[:50]}...{path[-50:]}"
        super().__init__(f"{path} {problem}")
        self.error = error


def encode(obj: Any) -> np.ndarray:
    """``obj``'s entry (uint8): its tagged JSON or its bytes, or a refusal naming what
    cannot travel; never raises for the object's content."""
    try:
        if type(obj) is bytes:
            data = _RAW + obj
        else:
            text = json.dumps(_pack(obj, "obj", 0), separators=(",", ":"), allow_nan=True)
            data = _JSON + text.encode()
        if len(data) > MAX_OBJECT_BYTES:
            raise _Refused(ValueError, "the object", f"is {len(data)} bytes encoded, over "
                           f"the limit of {MAX_OBJECT_BYTES} (send arrays with the array "
                           "collectives)")
    except _Refused as refused:
        code = next(k for k, v in _ERRORS.items() if v is refused.error)
        data = _REFUSED + code + str(refused)[:_MAX_REASON].encode(errors="replace")
    return np.frombuffer(data, np.uint8)


def _pack(x: Any, path: str, depth: int) -> Any:
    """``x`` as JSON-ready values, tuples, sets, bytes and odd keys tagged."""
    if depth > MAX_DEPTH:
        raise _Refused(ValueError, path, f"is nested deeper than {MAX_DEPTH} levels (or "
                                         "contains itself)")
    if x is None or isinstance(x, (bool, np.bool_)):
        return None if x is None else bool(x)
    if isinstance(x, (int, np.integer)):
        if int(x).bit_length() > MAX_INT_BITS:
            raise _Refused(ValueError, path, f"is an int of {int(x).bit_length()} bits, over "
                                             f"the {MAX_INT_BITS} an object may carry")
        return int(x)
    if isinstance(x, float) or (isinstance(x, np.floating) and x.dtype.itemsize <= 8):
        return float(x)
    if isinstance(x, str):
        return str(x)
    if isinstance(x, list):
        return [_pack(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]
    if isinstance(x, dict):
        return _pack_dict(x, path, depth)
    if isinstance(x, (tuple, set, frozenset)):
        tag = "tuple" if isinstance(x, tuple) else "set" if isinstance(x, set) else "frozenset"
        return {_TAG: [tag, [_pack(v, f"{path}[{i}]" if tag == "tuple" else
                                   f"an element of {path}", depth + 1)
                             for i, v in enumerate(x)]]}
    if isinstance(x, (bytes, bytearray, memoryview)):
        tag = "bytearray" if isinstance(x, bytearray) else "bytes"
        return {_TAG: [tag, base64.b64encode(bytes(x)).decode("ascii")]}
    kind = type(x).__qualname__
    if type(x).__module__ != "builtins":
        kind = f"{type(x).__module__}.{kind}"
    raise _Refused(TypeError, path, f"is a {kind} ({reprlib.repr(x)}), which cannot be sent: "
                                    f"objects are {_SUPPORTED}, never pickled; convert it first")


def _pack_dict(x: dict[Any, Any], path: str, depth: int) -> Any:
    if all(type(k) is str for k in x) and not (len(x) == 1 and _TAG in x):
        return {k: _pack(v, f"{path}[{k!r}]", depth + 1) for k, v in x.items()}
    return {_TAG: ["dict", [[_pack(k, f"the key {reprlib.repr(k)} of {path}", depth + 1),
                             _pack(v, f"{path}[{reprlib.repr(k)}]", depth + 1)]
                            for k, v in x.items()]]}


def decode(raw: np.ndarray, name: str, src: int) -> Any:
    """The object of rank ``src``'s entry ``raw`` (see :func:`encode`): raises its
    refusal as the sender's error, and ProtocolError for anything malformed."""
    data = raw.tobytes()
    kind = data[:1]
    if kind == _RAW:
        return data[1:]
    if kind == _REFUSED:
        error = _ERRORS.get(data[1:2])
        if error is None:
            raise ProtocolError(f"swarmfd.{name}: rank {src} sent a refusal of unknown kind")
        reason = data[2:2 + _MAX_REASON].decode("utf-8", "replace")
        raise error(f"swarmfd.{name}: the object of rank {src} cannot be sent: {reason}")
    if kind != _JSON:
        raise ProtocolError(f"swarmfd.{name}: rank {src} sent an object of unknown encoding")
    try:
        return _unpack(json.loads(data[1:].decode("utf-8")), 0)
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError) as exc:
        raise ProtocolError(f"swarmfd.{name}: rank {src} sent an object that is not valid "
                            f"({type(exc).__name__}: {str(exc)[:200]})") from None


def decode_all(entries: Sequence[np.ndarray], name: str, ranks: Sequence[int]) -> list[Any]:
    """Every rank's object (``entries`` in group-rank order, ``ranks`` their world
    ranks); the first refusal among them is raised, the same on every rank."""
    for raw, rank in zip(entries, ranks, strict=True):
        if raw[:1].tobytes() == _REFUSED:
            decode(raw, name, rank)
    return [decode(raw, name, rank) for raw, rank in zip(entries, ranks, strict=True)]


def _unpack(x: Any, depth: int) -> Any:
    """The value of tagged JSON ``x``; TypeError or ValueError when it is malformed."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if type(x) is list:
        return [_unpack(v, depth + 1) for v in x]
    if type(x) is not dict:
        return x  # None, bool, int, float or str: what json.loads makes
    if len(x) != 1 or _TAG not in x:
        return {k: _unpack(v, depth + 1) for k, v in x.items()}
    tagged = x[_TAG]
    if type(tagged) is not list or len(tagged) != 2 or type(tagged[0]) is not str:
        raise ValueError(f"a tagged value is not [tag, payload]: {reprlib.repr(tagged)}")
    tag, payload = tagged
    if tag in _BYTES and type(payload) is str:
        try:
            return _BYTES[tag](base64.b64decode(payload, validate=True))
        except binascii.Error as exc:
            raise ValueError(f"bad base64 in a {tag} value: {exc}") from None
    if type(payload) is not list:
        raise ValueError(f"unknown tag {reprlib.repr(tag)} or a payload of the wrong type")
    if tag in _SEQUENCES:
        return _SEQUENCES[tag](_unpack(v, depth + 1) for v in payload)  # unhashable: TypeError
    if tag == "dict":
        if not all(type(p) is list and len(p) == 2 for p in payload):
            raise ValueError("a dict's items are not [key, value] pairs")
        return {_unpack(k, depth + 1): _unpack(v, depth + 1) for k, v in payload}
    raise ValueError(f"unknown tag {reprlib.repr(tag)}")

"""broadcast_object and all_gather_object (swarmfd/objects.py).

* The codec, in this process with plain data: every supported value comes back equal
  and of the same type; what cannot travel becomes a refusal naming its key path or
  element; what a peer might send that is malformed, too deep or unknown is a
  ProtocolError, and nothing is evaluated.
* The calls in a world of one: the sender returns the decoded value, never its own
  object.
* On two real ranks: every rank returns the same value, equal to the root's object,
  and an object that cannot travel raises on both ranks, after which the job goes on.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import swarmfd as fd
from swarmfd import objects
from swarmfd.errors import ProtocolError

from .conftest import run_ranks

#: Values that travel, each with the type it must come back as (the same as sent, or
#: the plain Python type a numpy scalar or a memoryview travels as).
TRAVELS: list[tuple[str, Any]] = [
    ("the issue's example", {0: [1, 2], "t": (1, 2)}),
    ("plain JSON", {"a": [1, 2.5, "é", None, True, False], "b": {"c": []}}),
    ("non-string keys", {1: "int", 2.5: "float", None: "none", False: "bool",
                         (1, "x"): "tuple", frozenset({3}): "frozenset", b"k": "bytes"}),
    ("a dict whose only key is the tag", {"$": ["tuple", [1]]}),
    ("a dict with the tag among other keys", {"$": 1, "a": 2}),
    ("nested tuples", ((1, (2, (3,))), ())),
    ("sets", [set(), {1, "a", (2, 3)}, frozenset({b"x", None})]),
    ("bytes and bytearray", [b"\x00\xff", bytearray(b"ab"), b""]),
    ("top-level bytes", b"\x00\x01raw"),
    ("unicode and lone surrogates", ["\u2603", "\ud800", ""]),
    ("big ints and signed zeros", [2**1000, -(2**63), -0.0, 1e308, 5e-324]),
    ("infinities", [math.inf, -math.inf]),
]


def roundtrip(obj: Any) -> Any:
    return objects.decode(objects.encode(obj), "test", 0)


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                     math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k, j) and same(a[k], b[j])
                                          for k, j in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize(("what", "obj"), TRAVELS, ids=[t[0] for t in TRAVELS])
def test_a_supported_value_comes_back_equal_and_of_the_same_type(what: str, obj: Any) -> None:
    assert same(roundtrip(obj), obj), roundtrip(obj)


def test_nan_travels_as_nan_and_numpy_scalars_as_python_numbers() -> None:
    got = roundtrip([math.nan, np.float32(0.1), np.float64(2.5), np.int64(-7), np.uint8(200),
                     np.bool_(True), memoryview(b"mv")])
    assert math.isnan(got[0])
    assert same(got[1:], [float(np.float32(0.1)), 2.5, -7, 200, True, b"mv"])
    assert got[1] == np.float32(0.1)  # equal to what was sent


class Custom:
    def __repr__(self) -> str:
        return "Custom()"


def _self_containing() -> list[Any]:
    cycle: list[Any] = []
    cycle.append(cycle)
    return cycle


REFUSED: list[tuple[str, Any, type, str]] = [
    ("an object", Custom(), TypeError, "test_objects.Custom (Custom()), which cannot be sent"),
    ("a nested complex", {"a": [1, {"b": (2, 1j)}]}, TypeError, "obj['a'][1]['b'][1] is a complex"),
    ("an element of a set", {"s": {1, Custom()}}, TypeError, "an element of obj['s'] is a"),
    ("a key", {Custom(): 1}, TypeError, "the key Custom() of obj is a"),
    ("a float128", [np.longdouble(1)] if np.dtype(np.longdouble).itemsize > 8 else [1j],
     TypeError, "obj[0] is a"),
    ("an ndarray", {"x": np.zeros(2)}, TypeError, "obj['x'] is a numpy.ndarray"),
    ("a huge int", [2**20000], ValueError, "obj[0] is an int of 20001 bits"),
    ("too deep", [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], ValueError,
     "nested deeper than 32 levels"),
    ("a list containing itself", _self_containing(), ValueError, "or contains itself"),
    ("too large", b"x" * (objects.MAX_OBJECT_BYTES + 1), ValueError, "over the limit of"),
]


@pytest.mark.parametrize(("what", "obj", "exc", "needle"), REFUSED, ids=[r[0] for r in REFUSED])
def test_what_cannot_travel_is_refused_naming_where(what: str, obj: Any, exc: type,
                                                    needle: str) -> None:
    entry = objects.encode(obj)  # never raises: the refusal travels in the object's place
    with pytest.raises(exc) as info:
        objects.decode(entry, "broadcast_object", 3)
    message = str(info.value)
    assert message.startswith("swarmfd.broadcast_object: the object of rank 3 cannot be sent: ")
    assert needle in message, message
    assert len(message) < 700, message


MALFORMED: list[tuple[str, bytes]] = [
    ("not JSON", b"J[1,"),
    ("not UTF-8", b"J\xff\xfe"),
    ("an unknown encoding", b"P\x80\x04"),
    ("an unknown tag", b'J{"$":["eval","__import__(\'os\')"]}'),
    ("a tag without a payload", b'J{"$":["tuple"]}'),
    ("an unhashable set element", b'J{"$":["set",[[1]]]}'),
    ("an unhashable key", b'J{"$":["dict",[[{"a":1},2]]]}'),
    ("dict items that are not pairs", b'J{"$":["dict",[[1,2,3]]]}'),
    ("bad base64", b'J{"$":["bytes","!!"]}'),
    ("deep JSON", b"J" + b"[" * 100_000 + b"]" * 100_000),
    ("deep tags", b"J" + b'{"$":["tuple",[' * 40 + b"1" + b"]]}" * 40),
    ("an int of too many digits", b"J" + b"7" * 5000),
    ("a refusal of an unknown kind", b"!Xsomething"),
]


@pytest.mark.parametrize(("what", "data"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_entry_from_a_peer_is_a_protocol_error(what: str, data: bytes) -> None:
    with pytest.raises(ProtocolError, match="rank 5"):
        objects.decode(np.frombuffer(data, np.uint8), "all_gather_object", 5)


def test_all_entries_raise_the_first_refusal_on_every_rank() -> None:
    entries = [objects.encode({"ok": 1}), objects.encode(Custom()), objects.encode(2**20000)]
    with pytest.raises(TypeError, match="the object of rank 7 cannot be sent: obj is a "):
        objects.decode_all(entries, "all_gather_object", [4, 7, 9])
    assert objects.decode_all(entries[:1], "all_gather_object", [4]) == [{"ok": 1}]


# -- the calls ------------------------------------------------------------------------------



@pytest.mark.usefixtures("alone")
def test_the_sender_returns_the_decoded_value_not_its_own_object() -> None:
    obj = {0: [1, 2], "t": (1, 2), "n": np.int64(3)}
    got = fd.broadcast_object(obj)
    assert got == obj and got is not obj and type(got["n"]) is int
    assert fd.all_gather_object((1, {2})) == [(1, {2})]
    with pytest.raises(TypeError, match=r"swarmfd.all_gather_object: .* obj\[1\] is a"):
        fd.all_gather_object([1, Custom()])


# -- on two ranks ---------------------------------------------------------------------------


def _objects_on_ranks(rank: int, world: int) -> dict[str, Any]:
    root_obj = {0: [1, 2], "t": (1, 2), "s": {b"x"}}
    mine = root_obj if rank == 1 else {"ignored": rank}
    refused = []
    for call in (lambda: fd.broadcast_object([1, Custom()] if rank == 0 else None),
                 lambda: fd.all_gather_object(Custom() if rank == 1 else rank)):
        try:
            call()
            refused.append("no error")
        except TypeError as exc:
            refused.append(str(exc))
    return {"broadcast": repr(fd.broadcast_object(mine, src=1)),
            "gathered": repr(fd.all_gather_object((rank, {rank: b"r"}))),
            "refused": refused}


def test_every_rank_returns_the_roots_object_and_a_refusal_raises_on_every_rank() -> None:
    """Rank 1 broadcasts {0: [1, 2], 't': (1, 2), 's': {b'x'}}: both ranks return it as
    it was (an int key, a tuple, a set of bytes); each rank's tuple comes back a tuple
    on both. An object rank 0 cannot send raises on both ranks naming the element, as
    does one of rank 1's in all_gather_object; the calls after them work."""
    out = run_ranks(_objects_on_ranks, 2, timeout=60)
    for result in out:
        assert result["broadcast"] == repr({0: [1, 2], "t": (1, 2), "s": {b"x"}})
        assert result["gathered"] == repr([(0, {0: b"r"}), (1, {1: b"r"})])
        assert result["refused"][0].startswith(
            "swarmfd.broadcast_object: the object of rank 0 cannot be sent: obj[1] is a "), result
        assert result["refused"][1].startswith(
            "swarmfd.all_gather_object: the object of rank 1 cannot be sent: obj is a "), result

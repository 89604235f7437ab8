"""The exception tree of swarmfd.

Every error subclasses both :class:`SwarmfdError` and the builtin it most
resembles, so callers can write ``except TimeoutError`` or ``except
swarmfd.SwarmfdError`` as they prefer.
"""

from __future__ import annotations

import json

__all__ = [
    "AbortedError",
    "AbortedMismatchError",
    "AbortedPeerLostError",
    "AbortedTimeout",
    "AlreadyInitializedError",
    "AuthenticationError",
    "CollectiveError",
    "CollectiveTimeout",
    "ConfigError",
    "ElasticError",
    "MismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "RendezvousTimeout",
    "SwarmfdError",
    "abort_finished",
    "abort_is_provisional",
    "abort_kind",
    "abort_waited_for",
    "error_from_abort",
]


class SwarmfdError(Exception):
    """Base class of every error swarmfd raises on purpose."""


class ConfigError(SwarmfdError, ValueError):
    """The process-group configuration (arguments or environment) is invalid."""


class NotInitializedError(SwarmfdError, RuntimeError):
    """A collective or query was called before :func:`swarmfd.init`."""


class AlreadyInitializedError(SwarmfdError, RuntimeError):
    """:func:`swarmfd.init` was called while a process group is active."""


class CollectiveError(SwarmfdError, RuntimeError):
    """A collective failed; the message names the collective and the peer."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective waited longer than the group's timeout for a peer."""


class PeerLostError(CollectiveError, ConnectionError):
    """A peer process disappeared (its connection closed) during a collective."""


class MismatchError(CollectiveError):
    """Ranks called different collectives, or the same one with different arguments."""


class AbortedError(CollectiveError):
    """Another rank failed and told this rank to abort the collective."""


class ProtocolError(SwarmfdError, ConnectionError):
    """A peer spoke another protocol version or sent a malformed message."""


class RendezvousError(SwarmfdError, RuntimeError):
    """The ranks could not form a group (wrong world size, duplicate rank, timeout)."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """Rendezvous did not complete within the timeout."""


class AuthenticationError(RendezvousError, PermissionError):
    """This process could not prove it belongs to the job (another or no job secret)."""


class ElasticError(SwarmfdError, RuntimeError):
    """An elastic job could not re-form its world: too few ranks for longer than its
    timeout, this process was declared lost, or state that cannot move to a new world."""


class AbortedTimeout(AbortedError, CollectiveTimeout):
    """Another rank timed out and aborted the group; also a :class:`CollectiveTimeout`.

    Raised on the ranks that learn of the timeout from the rank that hit it, so
    ``except swarmfd.CollectiveTimeout`` handles a timeout wherever it surfaced.
    """


class AbortedPeerLostError(AbortedError, PeerLostError):
    """Another rank lost a peer and aborted the group; also a :class:`PeerLostError`."""


class AbortedMismatchError(AbortedError, MismatchError):
    """Another rank saw a mismatch and aborted the group; also a :class:`MismatchError`."""


#: The error a relayed abort of each kind (see :func:`abort_kind`) is raised as.
_ABORT_KINDS: dict[str, type[CollectiveError]] = {
    "timeout": AbortedTimeout,
    "lost": AbortedPeerLostError,
    "mismatch": AbortedMismatchError,
}


def abort_kind(error: BaseException) -> str:
    """The word an abort message uses for ``error`` (so peers re-raise the same kind)."""
    if isinstance(error, CollectiveTimeout):
        return "timeout"
    if isinstance(error, PeerLostError):
        return "lost"
    if isinstance(error, MismatchError):
        return "mismatch"
    return "error"


def error_from_abort(activity: str, src: int, payload: bytes) -> CollectiveError:
    """The error to raise when rank ``src`` sent an abort with JSON ``payload``."""
    info = _abort_info(payload)
    try:
        kind, message = str(info["kind"]), str(info["message"])
    except (KeyError, ValueError, OverflowError):
        kind, message = "error", "(unreadable reason)"
    cls = _ABORT_KINDS.get(kind, AbortedError)
    return cls(f"{activity}: rank {src} failed and aborted the group: {message}")


def _abort_info(payload: bytes) -> dict[str, object]:
    try:
        info = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return info if isinstance(info, dict) else {}


def abort_waited_for(payload: bytes) -> int | None:
    """The rank a timed-out peer was waiting for, from its abort message (or None)."""
    value = _abort_info(payload).get("waiting_for")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def abort_finished(payload: bytes) -> int | None:
    """The sequence number (masked to 32 bits) of the aborting rank's last finished call
    of the group, from its abort message (or None: an abort that does not say)."""
    value = _abort_info(payload).get("finished")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFFFFFF:
        return value
    return None


def abort_is_provisional(payload: bytes) -> bool:
    """True for a timeout report sent while the stuck rank is still being found."""
    return _abort_info(payload).get("provisional") is True

"""The challenge-response proof the socket plane's connections (and the shared-memory
plane's local socket) start with; standard library only.

Both sides of a connection send a hello (magic, protocol version, sender and receiver
rank, a fresh 16-byte nonce). With a job secret each side then proves it knows the
*other* side's per-session token, which only the encrypted rendezvous distributed:
an HMAC-SHA256 over a label, the role, both ranks and both nonces. Fresh nonces make
a recorded proof worthless on another connection (no replay); the role and the rank
order make a proof worthless in the other direction (no reflection).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = ["HELLO", "MAC_SIZE", "NO_RANK", "mac", "verify"]

#: magic (8 bytes: which channel and version of its handshake), protocol version, sender
#: rank, receiver rank (NO_RANK from a listener that does not know yet who connected),
#: nonce.
HELLO = struct.Struct("<8sBHH16s")
NO_RANK = 0xFFFF
MAC_SIZE = 32


def mac(label: bytes, token: str | bytes, role: bytes, client: int, server: int,
        nonce_c: bytes, nonce_s: bytes, bound: bytes = b"") -> bytes:
    """The proof that the sender knows ``token``, for this connection (``label`` names the
    channel, ``role`` the side: b"c" the connecting one, b"s" the listening one;
    ``bound``: what both ends know of the connection itself and a relay in its path
    cannot make alike, see swarmfd.comm.shm_setup)."""
    msg = label + role + struct.pack("<HH", client, server) + nonce_c + nonce_s + bound
    key = token.encode() if isinstance(token, str) else token
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify(proof: bytes, expected: bytes) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return hmac.compare_digest(proof, expected)

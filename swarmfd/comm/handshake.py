"""The challenge-response proof the socket plane's and shm setup's connections start with.

Both sides send a hello (magic, version, ranks, a fresh 16-byte nonce); with a job
secret each then proves it knows the *other* side's session token (sent only in the
encrypted rendezvous): HMAC-SHA256 over a label, the role, both ranks and both nonces.
Fresh nonces defeat replay; the role and rank order, reflection.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = ["HELLO", "MAC_SIZE", "NO_RANK", "mac", "verify"]

#: magic (the channel and its handshake's version), protocol version, sender rank,
#: receiver rank (NO_RANK: not known yet), nonce.
HELLO = struct.Struct("<8sBHH16s")
NO_RANK = 0xFFFF
MAC_SIZE = 32


def mac(label: bytes, token: str | bytes, role: bytes, client: int, server: int,
        nonce_c: bytes, nonce_s: bytes, bound: bytes = b"") -> bytes:
    """The proof that the sender knows ``token`` for this connection: ``role`` b"c"
    (connecting) or b"s" (listening); ``bound``: what both ends know of the connection
    itself and a relay cannot make alike (swarmfd.comm.shm_setup)."""
    msg = label + role + struct.pack("<HH", client, server) + nonce_c + nonce_s + bound
    key = token.encode() if isinstance(token, str) else token
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify(proof: bytes, expected: bytes) -> bool:
    """Constant-time comparison of a received proof with the expected one."""
    return hmac.compare_digest(proof, expected)

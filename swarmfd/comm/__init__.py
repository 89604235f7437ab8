"""The communication layer: how ranks find each other and move messages.

:mod:`.wire` (headers, signatures; no I/O), :mod:`.plane` and :mod:`.planes` (socket,
zmq, shm), :mod:`.channel` (the message layer over the planes), :mod:`.security` and
:mod:`.handshake` (keys, ZAP, proofs), :mod:`.rendezvous` (rank 0's table),
:mod:`.shm_setup` (sharing a host's memory), :mod:`.transport` (what init builds). Only
this package imports zmq; the algorithms see an Op, never a socket.
"""

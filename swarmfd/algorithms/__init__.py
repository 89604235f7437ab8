"""The collective algorithms, written once over :class:`~swarmfd.algorithms.base.Op`:
:mod:`.select` (the table that picks one per call), :mod:`.tcp` (point-to-point
messages), :mod:`.shm` (one host's segments), :mod:`.hier` (two levels), :mod:`.p2p`
(send, recv), :mod:`.base` (what they share). Each one and its cost: docs/algorithms.md.
"""

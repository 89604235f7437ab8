"""The collective algorithms, written once over :class:`~swarmfd.algorithms.base.Op`.

* :mod:`~swarmfd.algorithms.select`: the table that picks one per call;
* :mod:`~swarmfd.algorithms.tcp`: over point-to-point messages (ring, direct, chain);
* :mod:`~swarmfd.algorithms.shm`: over one host's shared segments;
* :mod:`~swarmfd.algorithms.hier`: two levels, shared memory inside hosts and TCP
  between them;
* :mod:`~swarmfd.algorithms.p2p`: send and recv;
* :mod:`~swarmfd.algorithms.base`: what they share (:class:`~.base.Op`).

docs/algorithms.md describes each algorithm, its cost, and how the table chooses.
"""

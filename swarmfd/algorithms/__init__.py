"""The collective algorithms, written once over :class:`~swarmfd.algorithms.base.Op`.

* :mod:`~swarmfd.algorithms.select`: the table that picks one per call;
* :mod:`~swarmfd.algorithms.tcp`: over point-to-point messages (ring, direct, chain);
* :mod:`~swarmfd.algorithms.shm`: over one host's shared segments.
"""

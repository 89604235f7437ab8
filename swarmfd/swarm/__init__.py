"""Docker Swarm jobs for swarmfd: ``swarmfd build``, ``deploy``, ``ls``, ``ps``, ``logs``, ``rm``,
``doctor``; what users need is in docs/swarm.md.

The only part of swarmfd that imports the Docker SDK (:mod:`.engine`, :mod:`.follow`,
:mod:`.deploy`, :mod:`.build`, :mod:`.doctor`); :mod:`.spec` and :mod:`.tasks` are pure,
:mod:`.probe` runs inside a task without the SDK, :mod:`.request` and :mod:`.cli` load
it only when a command runs, and importing this package imports nothing.

A *job* is N ranks of one command: one ``replicated`` service of N replicas named after
the job (restart condition ``none``, ``endpoint_mode`` ``dnsrr``: a VIP needs IPVS,
``init``, the image by ID when it is on this node, hostname ``<job>-<slot>``), one
attachable overlay network and one Docker secret ``<job>-secret``, all labelled
``org.swarmfd.job=<job>``, which is how ``ls``, ``ps``, ``logs`` and ``rm`` find it.
Each task runs :mod:`swarmfd.entrypoint` (``RANK = slot - 1``). A job that succeeded is
removed once followed, a failed one kept for ``ps`` and ``logs``. After a failure the
other ranks on this node are stopped through their containers, so their tasks and logs
stay (the failure in the label ``org.swarmfd.failure``); ranks elsewhere are stopped by
scaling to 0. A rank whose node is down is *lost* (Swarm still shows it running) and
named as the cause. ``--max-restarts`` creates the failed service again with
``SWARMFD_RESTART_COUNT`` k+1, on the same network and secret.
"""

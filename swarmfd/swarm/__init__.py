"""Docker Swarm jobs for swarmfd: ``swarmfd deploy``, ``ls``, ``ps``, ``logs`` and ``rm``.

The only part of swarmfd that imports the Docker SDK (in :mod:`.engine`,
:mod:`.follow` and :mod:`.deploy`; :mod:`.spec` and :mod:`.tasks` are pure and
importing this package imports nothing).

A *job* is N ranks of one command, run as Swarm tasks:

* one ``replicated`` service of N replicas named after the job, restart condition
  ``none`` (a rank that ends is never restarted), ``endpoint_mode`` ``dnsrr`` (a
  service VIP needs IPVS, which some hosts lack), ``init`` (SIGTERM reaches the
  command), image referenced by ID when it is on this node (no registry lookup
  when a task starts), hostname ``<job>-<slot>``;
* one attachable overlay network of the same name;
* the label ``org.swarmfd.job=<job>`` on both (and on the containers), which is how
  ``ls``, ``ps``, ``logs`` and ``rm`` find the job, and all ``rm`` removes.

Each task runs the image's entrypoint (:mod:`swarmfd.entrypoint`) with
``WORLD_SIZE=N``, ``SWARMFD_TASK_SLOT`` (1..N), ``MASTER_ADDR=<job>-1`` (the DNS name of
slot 1, rank 0), ``MASTER_PORT`` and ``SWARMFD_JOB``; the entrypoint sets
``RANK = slot - 1`` (and ``LOCAL_RANK``), waits until ``MASTER_ADDR`` resolves and
execs the command. ``swarmfd deploy`` follows the job: task progress on stderr,
every rank's output prefixed ``[rank R]``, and when a rank fails it stops the
others and exits with that rank's exit code, naming the rank and its node.
"""

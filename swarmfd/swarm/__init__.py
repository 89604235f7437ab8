"""Docker Swarm jobs for swarmfd: ``swarmfd build``, ``deploy``, ``ls``, ``ps``, ``logs``, ``rm``.

The only part of swarmfd that imports the Docker SDK (in :mod:`.engine`,
:mod:`.follow`, :mod:`.deploy` and :mod:`.build`; :mod:`.spec` and :mod:`.tasks` are
pure, :mod:`.request` (deploy's options) and :mod:`.cli` (the commands) load it only
when a command runs, and importing this package imports nothing). :mod:`.build` turns a project
directory into an image ``FROM`` the swarmfd image (``swarmfd build``, ``deploy
--build``) and pushes it to a registry (``--push``).

A *job* is N ranks of one command, run as Swarm tasks:

* one ``replicated`` service of N replicas named after the job, restart condition
  ``none`` (a rank that ends is never restarted), ``endpoint_mode`` ``dnsrr`` (a
  service VIP needs IPVS, which some hosts lack), ``init`` (SIGTERM reaches the
  command), image referenced by ID when it is on this node (no registry lookup
  when a task starts), hostname ``<job>-<slot>``;
* one attachable overlay network of the same name (``--encrypt-network``: Docker's
  IPsec ``encrypted`` option);
* one Docker secret ``<job>-secret`` (random, never printed), mounted in every rank at
  ``/run/secrets/swarmfd_secret`` (root, 0400);
* the label ``org.swarmfd.job=<job>`` on both (and on the containers), which is how
  ``ls``, ``ps``, ``logs`` and ``rm`` find the job, and all ``rm`` removes.

Each task runs the image's entrypoint (:mod:`swarmfd.entrypoint`) with
``WORLD_SIZE=N``, ``SWARMFD_TASK_SLOT`` (1..N), ``MASTER_ADDR=<job>-1`` (the DNS name of
slot 1, rank 0), ``MASTER_PORT`` (torch.distributed's; swarmfd's rendezvous derives
``MASTER_PORT + 1``, inside the overlay network, unless ``-e SWARMFD_PORT`` chooses
it) and ``SWARMFD_JOB``; the entrypoint sets
``RANK = slot - 1`` (and ``LOCAL_RANK``), waits until ``MASTER_ADDR`` resolves and
execs the command. ``swarmfd deploy`` follows the job: task progress on stderr,
every rank's output prefixed ``[rank R]``, and when a rank fails it stops the
others and exits with that rank's exit code, naming the rank and its node.

Decisions worth knowing:

* Keep or remove. A job whose ranks all exited 0 is removed once followed to the
  end; a failed job is kept so ``ps`` and ``logs`` can show what happened
  (``--keep`` / ``--rm`` override; a ``--detach`` job is kept until ``swarmfd rm``).
* Stopping after a failure. Scaling the service to 0 or removing it would make Swarm
  drop the tasks, and with them the evidence. So the remaining ranks on this node are
  stopped through their containers: their tasks end ``failed`` (143) and stay
  listed, with their logs. The failure is recorded in the service label
  ``org.swarmfd.failure``. Ranks on other nodes, or not started yet, can only be
  stopped by scaling to 0, which is then done.
* Ctrl-C while following stops following, not the job; the message says how to
  follow it again or remove it.
* Logs come from each task's container on this node. Tasks on other nodes go
  through Swarm's service log stream, the only way to reach them.
* ``LOCAL_RANK`` is per container by default (0 of 1). ``--local-ranks node`` makes
  swarmfd derive it per node at rendezvous instead. Either way a rank's host is its
  node (``SWARMFD_NODE``), and ranks that may share a node mount its volume
  ``swarmfd-shm`` to share memory there (see :mod:`.spec`).
* A rank whose node the manager declares down is *lost*: Swarm keeps showing its task
  as running, so deploy treats it as ended and names it, with its node, as the cause
  of the failure (the ranks that failed meanwhile lost their peer).
* ``--max-restarts K``: a failed group's service is removed and created again (same
  network and secret) with ``SWARMFD_RESTART_COUNT`` k+1, up to K times.
  ``--checkpoint-volume NAME`` mounts a named volume at ``/checkpoints`` and sets
  ``SWARMFD_CHECKPOINT_DIR``, so the new ranks find what the old ones saved.
* Task slots are 1-based: rank R is slot R+1 and host ``<job>-<R+1>``; ``ps`` shows
  both.
"""

"""The communication layer: how ranks find each other and move messages.

* :mod:`~swarmfd.comm.wire`: the message header and signatures (no I/O);
* :mod:`~swarmfd.comm.plane`: the plane interface, and
  :mod:`~swarmfd.comm.planes` its three implementations (socket, zmq, shm);
* :mod:`~swarmfd.comm.channel`: the message layer over the planes, written once;
* :mod:`~swarmfd.comm.security`, :mod:`~swarmfd.comm.handshake`: keys, ZAP, proofs;
* :mod:`~swarmfd.comm.rendezvous`: rank 0's table of every rank;
* :mod:`~swarmfd.comm.shm_setup`: how one host's ranks share memory;
* :mod:`~swarmfd.comm.transport`: what init builds of all this, per process.

Only this package imports zmq; the algorithms (:mod:`swarmfd.algorithms`) see an
:class:`~swarmfd.algorithms.base.Op`, never a socket.
"""

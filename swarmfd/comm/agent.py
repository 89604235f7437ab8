"""The elastic agent: how the ranks of an elastic job reach each other between
generations, whatever their transport is doing.

Every process of an elastic job runs one, from before its first rendezvous to
cleanup: a thread with a ZeroMQ ROUTER on a known endpoint (its entry of
``SWARMFD_ELASTIC_PEERS``, or its address on ``SWARMFD_ELASTIC_PORT``). The socket is
guarded as the rendezvous port is: CURVE with the job's key and the rendezvous's ZAP
policy (a process without the job secret cannot complete a handshake), the frame limit
and handshake deadline of a port strangers reach
(:func:`~swarmfd.comm.security.stranger_facing`). Messages are JSON objects (never
pickled) of at most MAX_MESSAGE bytes, each naming its protocol version and the launch
(``SWARMFD_JOB_ID``): what a process of another launch sends, with the same secret or
not, is dropped and counted.

What the agent does by itself, whatever the main thread is doing (computing, or
waiting in a collective):

* answers ``ping`` with ``pong`` (its incarnation, generation and phase): how ranks
  that re-form the world tell a live process from a lost one (:meth:`Agent.status`);
* records the ``join`` requests of replacements and answers them (``ack``, or
  ``finished`` once the job is over): :meth:`Agent.joiners`;
* refuses a ``reform`` of a generation it has left from a process that is not a member
  any more: a rank that was declared lost and comes back (a healed partition) is not
  let back in as the member it was;
* keeps every other message (``reform``, ``world``, ``fail``, ``finished``,
  ``refused``) for the main thread (:meth:`Agent.take`);
* sends what the main thread posts (:meth:`Agent.post`), pings the endpoints it
  watches (:meth:`Agent.watch`) and, in a replacement, sends ``join`` to every endpoint
  discovery names (:meth:`Agent.joining`).

Its outgoing sockets (one DEALER per endpoint) queue nothing for an endpoint they have
not connected to (``ZMQ_IMMEDIATE``): a post to a lost process is dropped, not kept
for whoever binds its port next. Every waiting loop of the protocol reposts
periodically. The thread sleeps in a poll until a message, a post or a periodic
action is due: an idle agent costs a job nothing. What is said when, and by whom, is
:mod:`swarmfd.membership`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from .security import Authenticator, Security, keepalive, serving_router

__all__ = ["AGENT_PROTOCOL", "JOIN_EVERY", "MAX_MESSAGE", "PING_EVERY", "Agent", "Status",
           "parse_endpoint"]

#: The version of the agents' messages (an agent drops messages of another).
AGENT_PROTOCOL = 1
#: The largest message an agent accepts (a ``world`` table: about 90 bytes a rank).
MAX_MESSAGE = 64 << 10
#: How often a watched endpoint is pinged, and a replacement repeats its ``join``.
PING_EVERY = 0.1
JOIN_EVERY = 0.25
#: The longest the thread sleeps when nothing is due.
IDLE_POLL = 1.0
_LOG = logging.getLogger("swarmfd")
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED


def _now() -> float:
    return time.monotonic()


def parse_endpoint(text: Any) -> tuple[str, int] | None:
    """``host:port`` as (host, port), or None when it is not one."""
    if not isinstance(text, str) or len(text) > 300:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


class Status:
    """What an agent knows of one endpoint it watches: its last answer (``pong_at``,
    the ``inc`` (incarnation), ``gen`` and ``phase`` it told) and since when its
    connection is down (``down_since``: refused or closed; None while it answers)."""

    __slots__ = ("down_since", "gen", "inc", "phase", "pong_at")

    def __init__(self) -> None:
        self.pong_at: float | None = None
        self.inc = ""
        self.gen = -1
        self.phase = ""
        self.down_since: float | None = None


class Agent:
    """This process's elastic agent (see the module docstring).

    ``bind``: (host, port) to listen on ("*" for every interface); ``advertise``: this
    agent's endpoint as a process at a given host reaches it (the address of the
    interface that routes there, and the port); ``security``: the job's keys (None:
    SWARMFD_AUTH=off); ``job``: SWARMFD_JOB_ID.
    """

    def __init__(self, bind: tuple[str, int], advertise: Callable[[str], str],
                 security: Security | None, job: str) -> None:
        self.inc = secrets.token_hex(8)
        self.job = job
        self.advertise = advertise
        self._lock = threading.Lock()
        self._info: dict[str, Any] = {"gen": -1, "phase": "forming", "members": ()}
        self._mail: list[dict[str, Any]] = []
        self._posts: list[tuple[str, bytes]] = []
        self._status: dict[str, Status] = {}
        self._watched: set[str] = set()
        self._joiners: dict[str, dict[str, Any]] = {}
        self._join: tuple[Callable[[], list[str]], dict[str, Any]] | None = None
        self._heard = 0.0
        #: Messages dropped: not JSON, another protocol, another launch.
        self.dropped = 0
        self._closed = False
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.auth: Authenticator | None = None
        self.security = security
        try:
            if security is not None:
                self.auth = Authenticator(self.ctx, security, 0, 1, "")
                self.auth.start()
            self.router = self._bind(*bind)
            self._wake_in = self.ctx.socket(zmq.PAIR)
            self._wake_in.bind(f"inproc://swarmfd-agent-{self.inc}")
            self._wake_out = self.ctx.socket(zmq.PAIR)
            self._wake_out.connect(f"inproc://swarmfd-agent-{self.inc}")
        except BaseException:
            self._destroy()
            raise
        self.port = bind[1]
        self._thread = threading.Thread(target=self._loop, name="swarmfd-agent", daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> zmq.Socket:
        router = serving_router(self.ctx, self.security, MAX_MESSAGE)
        try:
            router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            router.close(linger=0)
            from ..errors import RendezvousError

            raise RendezvousError(
                f"the elastic agent cannot listen on {host}:{port} ({exc}): its port "
                "(SWARMFD_ELASTIC_PEERS, SWARMFD_ELASTIC_PORT) is in use; is another job "
                "using it?") from None
        return router

    # -- what the main thread calls --------------------------------------------------

    def set_info(self, **values: Any) -> None:
        """What pongs tell (``gen``, ``phase``) and who is a member now (``members``:
        their incarnations; a ``reform`` of an older generation from anyone else is
        refused)."""
        with self._lock:
            self._info.update(values)

    def info(self, key: str) -> Any:
        with self._lock:
            return self._info.get(key)

    def post(self, endpoint: str, message: dict[str, Any]) -> None:
        """Send ``message`` to the agent at ``endpoint`` (dropped if not connected)."""
        body = self._encode(message)
        with self._lock:
            self._posts.append((endpoint, body))
        self._wake()

    def take(self, *ops: str) -> list[dict[str, Any]]:
        """The messages received of kinds ``ops`` (removed from the mailbox)."""
        with self._lock:
            got = [m for m in self._mail if m["op"] in ops]
            self._mail = [m for m in self._mail if m["op"] not in ops]
        return got

    def watch(self, endpoints: Iterable[str], *, more: bool = False) -> None:
        """Ping ``endpoints`` (and only them) from now on, their status started afresh;
        with ``more``, ping them too, and keep what is known of every endpoint."""
        with self._lock:
            if more:
                added = set(endpoints) - self._watched
                self._watched |= added
            else:
                added = self._watched = set(endpoints)
            for e in added:
                self._status[e] = Status()
        self._wake()

    def status(self, endpoint: str) -> Status:
        with self._lock:
            s = self._status.get(endpoint)
            out = Status()
            if s is not None:
                out.pong_at, out.inc, out.gen = s.pong_at, s.inc, s.gen
                out.phase, out.down_since = s.phase, s.down_since
            return out

    def joiners(self, fresh: float) -> list[dict[str, Any]]:
        """The replacements heard from in the last ``fresh`` seconds, first come first."""
        now = _now()
        with self._lock:
            alive = [dict(j) for j in self._joiners.values() if now - j["last"] <= fresh]
        return sorted(alive, key=lambda j: j["first"])

    def forget_joiners(self, incs: Iterable[str]) -> None:
        with self._lock:
            for inc in incs:
                self._joiners.pop(inc, None)

    def joining(self, targets: Callable[[], list[str]] | None,
                message: dict[str, Any] | None = None) -> None:
        """As a replacement: send ``message`` (a ``join``) to every endpoint
        ``targets()`` names, every JOIN_EVERY seconds (None: stop)."""
        with self._lock:
            self._join = None if targets is None else (targets, message or {})
            self._heard = 0.0
        self._wake()

    def heard(self) -> float:
        """When a member last answered this replacement's ``join`` (0: never)."""
        with self._lock:
            return self._heard

    def finish(self) -> None:
        """The job is over: tell every replacement that asked, and the later ones."""
        with self._lock:
            self._info["phase"] = "finished"
            targets = [j["endpoint"] for j in self._joiners.values()]
        for endpoint in targets:
            self.post(endpoint, {"op": "finished"})

    def close(self) -> None:
        """Stop the thread and close every socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)
        self._destroy()

    def _destroy(self) -> None:
        if self.auth is not None:
            with contextlib.suppress(Exception):
                self.auth.stop()
            self.auth = None
        self.ctx.destroy(linger=0)

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(zmq.ZMQError):
            self._wake_out.send(b"", zmq.NOBLOCK)

    def _encode(self, message: dict[str, Any]) -> bytes:
        return json.dumps({"v": AGENT_PROTOCOL, "job": self.job, **message}).encode()

    # -- the thread --------------------------------------------------------------------

    def _loop(self) -> None:
        out: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        due = {"ping": 0.0, "join": 0.0}
        try:
            while not self._closed:
                timeout = max(0.0, min([IDLE_POLL, *(t - _now() for t in self._due(due))]))
                for sock, _ in poller.poll(int(timeout * 1000) + 1):
                    self._readable(sock, out)
                self._send_posts(out, poller)
                self._periodic(due, out, poller)
        except zmq.ZMQError:
            if not self._closed:
                raise
        finally:
            for dealer, monitor in out.values():
                with contextlib.suppress(zmq.ZMQError):
                    dealer.disable_monitor()
                monitor.close(linger=0)
                dealer.close(linger=0)
            self.router.close(linger=0)
            self._wake_in.close(linger=0)

    def _due(self, due: dict[str, float]) -> list[float]:
        with self._lock:
            times = [due["ping"]] if self._watched else []
            if self._join is not None:
                times.append(due["join"])
        return times

    def _readable(self, sock: zmq.Socket, out: dict[str, tuple[zmq.Socket, zmq.Socket]]
                  ) -> None:
        if sock is self._wake_in:
            while self._wake_in.poll(0):
                self._wake_in.recv()
            return
        if sock is self.router:
            while self.router.poll(0):
                frames = self.router.recv_multipart()
                if len(frames) == 2:
                    self._request(frames[0], frames[1])
            return
        for endpoint, (dealer, monitor) in out.items():
            if sock is dealer:
                while dealer.poll(0):
                    self._reply(endpoint, dealer.recv())
            elif sock is monitor:
                self._monitor_events(endpoint, monitor)

    def _decode(self, body: bytes) -> dict[str, Any] | None:
        try:
            msg = json.loads(body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            msg = None
        if (not isinstance(msg, dict) or msg.get("v") != AGENT_PROTOCOL
                or msg.get("job") != self.job or not isinstance(msg.get("op"), str)):
            self.dropped += 1
            return None
        return msg

    def _request(self, ident: bytes, body: bytes) -> None:
        """A message that came to the ROUTER: answer it, or keep it for the main thread."""
        msg = self._decode(body)
        if msg is None:
            return
        op = msg["op"]
        with self._lock:
            info = dict(self._info)
        if op == "ping":
            answer = {"op": "pong", "inc": self.inc, "gen": info["gen"], "phase": info["phase"]}
        elif op == "join":
            answer = self._join_request(msg, info)
        elif op == "reform" and _stale(msg, info):
            answer = {"op": "refused", "gen": info["gen"], "why": (
                f"this process (rank {msg.get('rank')} of generation {msg.get('gen')}) was "
                f"declared lost when the world was re-formed (now generation {info['gen']}); "
                "it may come back only as a new process (a replacement)")}
        else:
            with self._lock:
                self._mail.append({**msg, "at": _now()})
            return
        if answer is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.router.send_multipart([ident, self._encode(answer)], zmq.NOBLOCK)

    def _join_request(self, msg: dict[str, Any], info: dict[str, Any]) -> dict[str, Any] | None:
        inc, endpoint = msg.get("inc"), msg.get("endpoint")
        if not isinstance(inc, str) or not inc.isalnum() or len(inc) > 64 or \
                parse_endpoint(endpoint) is None:
            self.dropped += 1
            return None
        if info["phase"] == "finished":
            return {"op": "finished"}
        if info["phase"] in ("member", "reforming"):
            now = _now()
            with self._lock:
                j = self._joiners.setdefault(inc, {"inc": inc, "first": now})
                j["endpoint"], j["last"] = endpoint, now
        return {"op": "ack", "inc": self.inc, "gen": info["gen"], "phase": info["phase"]}

    def _reply(self, endpoint: str, body: bytes) -> None:
        """An answer that came back on the DEALER to ``endpoint``."""
        msg = self._decode(body)
        if msg is None:
            return
        op = msg["op"]
        now = _now()
        with self._lock:
            if op == "pong":
                s = self._status.setdefault(endpoint, Status())
                s.pong_at, s.down_since = now, None
                s.inc, s.phase = str(msg.get("inc", "")), str(msg.get("phase", ""))
                gen = msg.get("gen")
                s.gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else -1
            elif op == "ack":
                if msg.get("phase") in ("member", "reforming", "forming", "finished"):
                    self._heard = now
                    self._mail.append({**msg, "at": now, "from": endpoint})
            elif op in ("finished", "refused"):
                self._heard = now
                self._mail.append({**msg, "at": now, "from": endpoint})

    def _monitor_events(self, endpoint: str, monitor: zmq.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            with self._lock:
                s = self._status.get(endpoint)
                if s is None:
                    continue
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    s.down_since = None
                elif s.down_since is None:
                    s.down_since = _now()

    def _dealer(self, endpoint: str, out: dict[str, tuple[zmq.Socket, zmq.Socket]],
                poller: zmq.Poller) -> zmq.Socket | None:
        if endpoint in out:
            return out[endpoint][0]
        where = parse_endpoint(endpoint)
        if where is None:
            return None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.SNDHWM, 64)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        keepalive(dealer)
        if self.security is not None:
            self.security.curve_client(dealer)
        monitor = dealer.get_monitor_socket(_MONITORED)
        dealer.connect(f"tcp://{where[0]}:{where[1]}")
        out[endpoint] = (dealer, monitor)
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return dealer

    def _send(self, endpoint: str, body: bytes, out: dict[str, tuple[zmq.Socket, zmq.Socket]],
              poller: zmq.Poller) -> None:
        dealer = self._dealer(endpoint, out, poller)
        if dealer is not None:
            with contextlib.suppress(zmq.ZMQError):  # not connected (IMMEDIATE): dropped
                dealer.send(body, zmq.NOBLOCK)

    def _send_posts(self, out: dict[str, tuple[zmq.Socket, zmq.Socket]],
                    poller: zmq.Poller) -> None:
        with self._lock:
            posts, self._posts = self._posts, []
        for endpoint, body in posts:
            self._send(endpoint, body, out, poller)

    def _periodic(self, due: dict[str, float], out: dict[str, tuple[zmq.Socket, zmq.Socket]],
                  poller: zmq.Poller) -> None:
        now = _now()
        with self._lock:
            watched = list(self._watched)
            join = self._join
        if watched and now >= due["ping"]:
            due["ping"] = now + PING_EVERY
            ping = self._encode({"op": "ping", "inc": self.inc})
            for endpoint in watched:
                self._send(endpoint, ping, out, poller)
        if join is not None and now >= due["join"]:
            due["join"] = now + JOIN_EVERY
            targets, message = join
            try:
                endpoints = targets()
            except OSError:
                endpoints = []
            for endpoint in endpoints:
                where = parse_endpoint(endpoint)
                if where is None:
                    continue
                mine = self.advertise(where[0])
                if mine != endpoint:  # (tasks.<service> lists this task too)
                    body = self._encode({**message, "op": "join", "inc": self.inc,
                                         "endpoint": mine})
                    self._send(endpoint, body, out, poller)


def _stale(msg: dict[str, Any], info: dict[str, Any]) -> bool:
    """A ``reform`` of a generation this agent has left, from a process that is not a
    member now (a rank declared lost that came back)."""
    gen = msg.get("gen")
    return (isinstance(gen, int) and gen < info["gen"]
            and msg.get("inc") not in info.get("members", ()))

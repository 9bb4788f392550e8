"""The rank → driver event channel.

A small authenticated JSON-lines protocol over TCP, nothing on it ever unpickled: the challenge,
the signed hello, the JSON values and the raw blocks are described once, in ``nbdist.channel``
(what both ends agree on).

The driver pays per write it reads (a wake-up, a read, a parse), far more than per event in
it, so clients coalesce. An event after a quiet spell goes at once; what follows goes in the
next write, at most one every ``SEND_EVERY_S``; progress, metrics and heartbeats wait up to
``LAZY_S`` for something else to travel with; and queued events merge (output of a stream into
one text, the newest progress of a bar replacing older ones, metrics into one dict). The server
keeps its reads near ``MAX_WRITES_PER_S`` whatever the number of ranks: once more ranks are
connected than that allows at ``SEND_EVERY_S``, it tells every client (``{"t": "pace",
"every": S}``) to write at most every ``S = connections / MAX_WRITES_PER_S`` seconds (a
shorter ``S`` once closed connections settled, ``REPACE_AFTER_S``), and wakes up less often
itself (``PACE_S``). Above ``LARGE_FROM`` ranks it aims at fewer writes a second, 250 from
1024 ranks on (``pace_for``). So the channel trades latency for the driver's CPU only in
large jobs: with 4 ranks a line takes about 10 ms; with 256, a busy rank writes every
0.64 s and a line after a quiet spell takes up to 0.1 s; with 1024, every 4.1 s.

This module runs in the kernel; the rank's end is ``nbdist.rank.client``, what both ends agree
on is ``nbdist.channel``.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import json
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from nbdist.channel import (
    MAX_BLOCK_BYTES,
    MAX_HELLO_BYTES,
    PROMPT,
    PROTOCOL_VERSION,
    SEND_EVERY_S,
    Event,
    encode,
    recv_some,
    sign,
)

log = logging.getLogger(__name__)
#: A connection must send its hello this soon after it is accepted, or it is closed (and
#: counted in ``rejected``). A rank sends its hello as soon as it reads the challenge; a
#: stranger that connects and says nothing, or trickles a byte a second (slowloris), holds a
#: descriptor and at most ``MAX_HELLO_BYTES`` for no longer than this.
AUTH_DEADLINE_S = 5.0
#: Most connections waiting for their hello at once. A connection beyond it closes the one that
#: has waited longest (counted in ``rejected``), once that one had ``HELLO_GRACE_S`` to say
#: hello; until then new connections wait in the listen backlog. So a flood of strangers
#: cannot keep a rank out (its hello follows its connection at once), and the strangers hold
#: at most ``MAX_UNAUTHENTICATED * MAX_HELLO_BYTES`` (8 MiB) of the kernel's memory.
MAX_UNAUTHENTICATED = 512
HELLO_GRACE_S = 0.5
#: Highest rank number a hello may name.
MAX_RANK = 2**31 - 1
#: Most bytes of binary blocks read from one connection per wake-up. Blocks (a value being
#: pulled) are read as fast as they come, not one ``READ_BYTES`` per paced wake-up, but one
#: rank's transfer does not keep the server from the other connections for long.
BLOCK_BYTES_PER_WAKE = 64 * 1024 * 1024
#: Longest line accepted after it; the supervisor cuts output lines far below this.
MAX_LINE_BYTES = 16 * 1024 * 1024
#: Most bytes read from a connection at once, into one buffer the server reuses: a fresh
#: bytes object that large per read (``recv(n)``) costs more than the read (~13 µs here).
READ_BYTES = 1 << 18
#: The server handles what arrived at most this often, so that each wake-up reads several
#: writes instead of waking for each; a wake-up costs far more than a read (its caches are
#: cold). With many ranks connected it waits longer, a quarter of the clients' write interval
#: (below), up to ``MAX_PACE_S``. This is what it adds to a line's latency at most.
PACE_S = 0.005
MAX_PACE_S = 0.1
#: Writes per second the server aims to read at most, from all its clients together (see the
#: module docstring): about 1% of a core here for up to ``LARGE_FROM`` connections.
MAX_WRITES_PER_S = 400
#: Above ``LARGE_FROM`` connections it aims lower, down to ``LARGE_WRITES_PER_S`` at
#: ``LARGE_JOB`` connections and beyond: there a write carries seconds of a rank's events, and
#: folding them costs more than reading the write (1024 ranks at 400 writes a second took the
#: driver 1.5-2 % of a core; ``bench_scale.py``).
LARGE_FROM = 256
LARGE_JOB = 1024
LARGE_WRITES_PER_S = 250
#: Longest interval the server asks for: one heartbeat (``protocol.HEARTBEAT_S``), so that a
#: rank's heartbeats still arrive every 5 s, well within the shortest heartbeat timeout a
#: remote job may be given (``launch.MIN_HEARTBEAT_TIMEOUT_S``, 10 s) and the 15 s after which
#: the views call a rank silent. (10 s, two heartbeats, made a job of 2,500 ranks or more with
#: ``--heartbeat-timeout 10`` see its ranks as unheard.)
MAX_EVERY_S = 5.0
#: However the closes go on (a job whose ranks end one by one, under a second apart), the
#: shorter pace is told at most this long after the first of them.
REPACE_AT_MOST_S = 5.0
#: The pace told to clients changes only when it is off by more than this factor, so ranks
#: connecting one by one cause a handful of broadcasts, not one per rank.
_PACE_STEP = 1.25
#: After a connection closes, the shorter interval its peers may now write at is told once no
#: other connection closed for this long: the ranks of a job end together, and telling each
#: of 1024 clients a new pace after every few closes cost the driver more than the job's last
#: writes (3,500 sends as 1024 ranks left). More connections slow the clients down at once.
REPACE_AFTER_S = 1.0


#: ``json.loads`` without its per-call checks (the server parses every write with it).
_decode = json.JSONDecoder().decode


class JobChannel(Protocol):
    """What the server calls for one job; called on the server's thread, so keep it short.

    A job may also have ``block_buffer(rank, event) -> memoryview | None``: where to read the
    binary block that ``event`` announces (exactly ``event["raw"]`` bytes), so that it lands
    where it belongs without a copy; the event then arrives with that view as its ``data``.
    And ``on_events(rank, events)``: the events of one write together, in order, in place of
    one ``on_event`` each (the job folds them at once; it handles each one's errors itself).
    """

    def on_connect(self, rank: int, hello: Event) -> None: ...

    def on_event(self, rank: int, event: Event) -> None: ...

    def on_disconnect(self, rank: int) -> None: ...


class _Conn:
    def __init__(self, sock: socket.socket, nonce: str) -> None:
        self.sock = sock
        self.nonce = nonce
        self.accepted = time.monotonic()
        self.buf = bytearray()
        self.job_id: str | None = None
        self.rank = -1
        self.lock = threading.Lock()
        self.closed = False
        # A binary block being read (protocol 3): the event that announced it, its bytes, how
        # many have arrived, and how many blocks this connection has delivered in all.
        self.block_event: Event | None = None
        self.block: bytearray | memoryview = bytearray()
        self.got = 0
        self.blocks = 0


@dataclasses.dataclass(frozen=True)
class DriverAddress:
    """Where the event server listens, and the address its ranks are told to connect to.

    The two differ on real clusters, as Spark's own ``spark.driver.bindAddress`` and
    ``spark.driver.host`` do: a driver may listen on every interface and be known to the
    executors by a name that resolves to one of them, or sit behind a port forwarder (a
    container) whose address is not the driver's at all. Authentication, not the bound
    interface, is what keeps strangers off the channel.
    """

    #: Interface address to bind; "" means every interface.
    bind: str = "127.0.0.1"
    #: Host name or address the ranks connect to (not necessarily a local address).
    advertise: str = "127.0.0.1"
    #: Port to bind and advertise; 0: any free port.
    port: int = 0
    #: Which settings these values came from, in words, for error messages.
    source: str = ""


class EventServer:
    """The driver-side end: one thread multiplexing every rank connection of every job.

    Parameters
    ----------
    address : DriverAddress or str
        Where to listen and what to tell the ranks (a string: one address for both).
        ``address`` (the attribute) is then the advertised host and the bound port.
    """

    def __init__(self, address: DriverAddress | str | None = None) -> None:
        address = _address(address)
        self._listener = _listen(address.bind, address.port)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = (address.advertise, self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._rbuf = bytearray(READ_BYTES)
        self._rview = memoryview(self._rbuf)
        self._pace = SEND_EVERY_S  # the write interval last told to the clients
        self._repace_at = 0.0  # when to tell the clients a shorter one (0: not due)
        self._repace_first = 0.0  # the first close since the last time it was told
        self._prompt = False  # this wake-up delivered the end of a session cell (PROMPT)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._jobs: dict[str, tuple[str, JobChannel]] = {}
        self._conns: dict[tuple[str, int], _Conn] = {}
        #: Connections that have not said hello yet, oldest first (the server's thread only).
        self._waiting: dict[_Conn, None] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: Connections closed because they failed authentication, broke the protocol, or
        #: waited too long (or among too many others) to authenticate.
        self.rejected = 0
        self._thread = threading.Thread(target=self._loop, name="nbdist-events", daemon=True)
        self._thread.start()

    # -- jobs -------------------------------------------------------------------------------
    def add_job(self, job_id: str, secret: str, channel: JobChannel) -> None:
        with self._lock:
            self._jobs[job_id] = (secret, channel)

    def remove_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
            gone = [c for key, c in self._conns.items() if key[0] == job_id]
        for conn in gone:
            self._wake_close(conn)

    def send(self, job_id: str, rank: int, event: Mapping[str, Any]) -> bool:
        """Send ``event`` to one rank's supervisor; False when it is not connected."""
        with self._lock:
            conn = self._conns.get((job_id, rank))
        if conn is None:
            return False
        try:
            with conn.lock:
                conn.sock.sendall(encode(event))
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._wake_w.close()

    # -- the loop ---------------------------------------------------------------------------
    def _wake_close(self, conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._turn()
            except Exception:  # nbdist's own bug: every job's channel depends on this thread
                log.exception("nbdist: the event server hit an error; it goes on serving")
                time.sleep(0.1)

    def _turn(self) -> None:
        ready = self._sel.select(timeout=self._timeout())
        woke = time.monotonic()
        listener = False
        for key, _ in ready:
            if key.data is None:
                listener = True
            elif key.data == "wake":
                self._wake_r.recv(64)
            else:
                self._serve(key.data)
        if listener:
            # After the reads: hellos that arrived meanwhile leave the waiting list before new
            # connections count against MAX_UNAUTHENTICATED.
            self._accept()
        self._expire()
        if self._repace_at and time.monotonic() >= self._repace_at:
            self._repace_at = 0.0
            self._repace()
        if self._prompt:
            self._prompt = False  # a session cell's end: the other ranks' ends may follow
        elif ready:
            # Let what arrives in the meantime pile up, to be read in one go.
            wait = min(MAX_PACE_S, max(PACE_S, self._pace / 4))
            time.sleep(max(0.0, woke + wait - time.monotonic()))

    def _timeout(self) -> float:
        """How long the loop may wait: until the oldest waiting connection's deadline, or the
        re-pace after closed connections."""
        now = time.monotonic()
        wait = 1.0
        if self._repace_at:
            wait = max(0.0, self._repace_at - now) + 0.001
        for conn in self._waiting:
            due = conn.accepted + AUTH_DEADLINE_S - now
            return min(wait, max(0.0, due) + 0.001)
        return wait

    def _accept(self) -> None:
        # Every connection waiting, not one per wake-up: with the loop paced, 256 ranks
        # connecting at once would otherwise take 256 wake-ups.
        while True:
            if len(self._waiting) >= MAX_UNAUTHENTICATED and not self._evict():
                return  # full of connections that just came: the rest wait in the backlog
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:  # none left
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._evict():
                    continue  # out of descriptors: a stranger made room
                return  # out of descriptors with no stranger to blame; the next wake-up retries
            conn = _Conn(sock, secrets.token_hex(16))
            try:
                sock.setblocking(True)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                challenge = encode({"t": "challenge", "nonce": conn.nonce,
                                    "v": PROTOCOL_VERSION})
                # Never blocks: a peer that does not read could otherwise stall the server.
                if sock.send(challenge, socket.MSG_DONTWAIT) != len(challenge):
                    raise BlockingIOError
            except OSError:
                sock.close()
                continue
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._waiting[conn] = None

    def _evict(self) -> bool:
        """Close the connection that has waited longest for its hello, if it had its chance."""
        for conn in self._waiting:
            if time.monotonic() - conn.accepted < HELLO_GRACE_S:
                return False
            self._drop(conn, rejected=True)
            return True
        return False

    def _expire(self) -> None:
        """Close the connections that did not say hello in time."""
        now = time.monotonic()
        while self._waiting:
            conn = next(iter(self._waiting))
            if conn.accepted + AUTH_DEADLINE_S > now:
                return
            # Its hello may be there unread (a starved server thread): read what is there.
            self._serve(conn, socket.MSG_DONTWAIT)
            if conn in self._waiting:
                self._drop(conn, rejected=True)

    def _drop(self, conn: _Conn, *, rejected: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        if rejected:
            self.rejected += 1
        self._waiting.pop(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.job_id is None:
            return
        key = (conn.job_id, conn.rank)
        with self._lock:
            if self._conns.get(key) is conn:
                del self._conns[key]
            entry = self._jobs.get(conn.job_id)
        if entry is not None:
            try:
                entry[1].on_disconnect(conn.rank)
            except Exception:
                log.exception("nbdist: a job's disconnect handler failed")
        now = time.monotonic()  # (see REPACE_AFTER_S and REPACE_AT_MOST_S)
        if not self._repace_at:
            self._repace_first = now
        self._repace_at = min(now + REPACE_AFTER_S, self._repace_first + REPACE_AT_MOST_S)

    def _serve(self, conn: _Conn, flags: int = 0) -> None:
        """Read from one connection; whatever goes wrong closes it, never the server."""
        if conn.closed:
            return
        try:
            self._read(conn, flags)
        except Exception:  # RecursionError from json, a hello of the wrong types, ...
            log.debug("nbdist: closing an event connection that broke the protocol",
                      exc_info=True)
            self._drop(conn, rejected=True)

    def _read(self, conn: _Conn, flags: int) -> None:
        budget = BLOCK_BYTES_PER_WAKE
        blocks = conn.blocks
        while True:
            if conn.block_event is not None:  # straight into the block, without a copy
                view = memoryview(conn.block)[conn.got:]
                n = recv_some(conn.sock, view, len(view), flags)
                if n is None:
                    return
                if n:
                    conn.got += n
                    if conn.got == len(conn.block):
                        self._block_done(conn)
            else:
                # Before the hello, never more than a hello may hold.
                size = READ_BYTES if conn.job_id is not None else (
                    MAX_HELLO_BYTES + 1 - len(conn.buf))
                n = recv_some(conn.sock, self._rbuf, size, flags)
                if n is None:
                    return
                if n and not self._consume(conn, n):
                    self._drop(conn, rejected=True)
                    return
            if not n:
                self._drop(conn, rejected=False)
                return
            budget -= n
            # Ordinary lines: one read per wake-up (see PACE_S). Blocks: on while they come.
            if conn.closed or budget <= 0 or (conn.block_event is None and conn.blocks == blocks):
                return
            flags = socket.MSG_DONTWAIT

    def _consume(self, conn: _Conn, n: int) -> bool:
        """Handle ``n`` bytes just read: whole lines, and what belongs to a binary block."""
        buf, view = self._rbuf, self._rview
        pos = 0
        while pos < n:
            if conn.block_event is not None:
                take = min(len(conn.block) - conn.got, n - pos)
                conn.block[conn.got:conn.got + take] = view[pos:pos + take]
                conn.got += take
                pos += take
                if conn.got == len(conn.block):
                    self._block_done(conn)
                continue
            limit = MAX_LINE_BYTES if conn.job_id is not None else MAX_HELLO_BYTES
            end = buf.find(b"\n", pos, n)
            if end < 0:  # no line ends here: keep the piece for the next read
                if len(conn.buf) + n - pos > limit:
                    return False
                conn.buf += view[pos:n]
                return True
            line: bytearray | memoryview
            if conn.buf:
                conn.buf += view[pos:end]
                line, conn.buf = conn.buf, bytearray()
            else:
                line = view[pos:end]
            pos = end + 1
            # A line ends at a newline, so at a character boundary: it decodes on its own.
            if line and (len(line) > limit or not self._handle(conn, str(line, "utf-8"))):
                return False
        return True

    def _handle(self, conn: _Conn, line: str) -> bool:
        value = _decode(line)
        if conn.job_id is None:
            return isinstance(value, dict) and self._hello(conn, value)
        if isinstance(value, dict) and "raw" in value:
            size = value["raw"]
            if type(size) is not int or not 0 <= size <= MAX_BLOCK_BYTES:
                return False
            conn.block_event, conn.block, conn.got = value, self._block_buffer(conn, value), 0
            if not size:
                self._block_done(conn)
            return True
        batch = value if isinstance(value, list) else [value]
        for event in batch:  # a plain loop: a generator here costs more than the check
            if not isinstance(event, dict) or "raw" in event:
                return False
        self._deliver(conn, batch)
        return True

    def _block_buffer(self, conn: _Conn, event: Event) -> bytearray | memoryview:
        size: int = event["raw"]
        entry = self._jobs.get(conn.job_id or "")
        where = getattr(entry[1], "block_buffer", None) if entry is not None else None
        if where is not None:
            try:
                view = where(conn.rank, event)
            except Exception:
                log.exception("nbdist: a job's block_buffer failed")
                view = None
            if (isinstance(view, memoryview) and view.format == "B" and view.ndim == 1
                    and view.contiguous and not view.readonly and view.nbytes == size):
                return view
        return bytearray(size)

    def _block_done(self, conn: _Conn) -> None:
        event, data = conn.block_event, conn.block
        assert event is not None
        conn.block_event, conn.block, conn.got = None, bytearray(), 0
        conn.blocks += 1
        del event["raw"]
        event["data"] = data
        self._deliver(conn, [event])

    def _deliver(self, conn: _Conn, batch: list[Event]) -> None:
        entry = self._jobs.get(conn.job_id or "")  # one dict read, atomic: no need for the lock
        if entry is None:
            return
        for event in batch:
            if event.get("t") in PROMPT:
                self._prompt = True
        many = getattr(entry[1], "on_events", None) if len(batch) > 1 else None
        if many is not None:
            try:
                many(conn.rank, batch)
            except Exception:  # a bad event must not kill the channel for every job
                log.exception("nbdist: event handler failed for a write of %d events",
                              len(batch))
            return
        for event in batch:
            try:
                entry[1].on_event(conn.rank, event)
            except Exception:  # a bad event must not kill the channel for every job
                log.exception("nbdist: event handler failed for %r", event.get("t"))

    def _hello(self, conn: _Conn, event: Event) -> bool:
        job_id, rank, mac = event.get("job"), event.get("rank"), event.get("mac")
        if (event.get("t") != "hello" or not isinstance(job_id, str) or type(rank) is not int
                or not 0 <= rank <= MAX_RANK or not isinstance(mac, str) or not mac.isascii()):
            return False  # (compare_digest raises on a str that is not ASCII)
        with self._lock:
            # Checked and registered at once: a job removed in between would otherwise keep
            # this connection open with nobody to close it.
            entry = self._jobs.get(job_id)
            if entry is None or not hmac.compare_digest(
                    mac, sign(entry[0], conn.nonce, job_id, rank)):
                return False
            conn.job_id, conn.rank = job_id, rank
            old = self._conns.get((job_id, rank))
            self._conns[(job_id, rank)] = conn
        self._waiting.pop(conn, None)
        if old is not None:  # a reconnect replaces the old connection
            self._wake_close(old)
        if not self._repace() and self._pace > SEND_EVERY_S:
            self._tell(conn, encode({"t": "pace", "every": self._pace}))
        entry[1].on_connect(rank, event)
        return True

    def _repace(self) -> bool:
        """Tell every client a new write interval if the number of ranks moved it enough."""
        with self._lock:
            conns = list(self._conns.values())
        every = pace_for(len(conns))
        if self._pace / _PACE_STEP <= every <= self._pace * _PACE_STEP:
            return False
        self._pace = every
        data = encode({"t": "pace", "every": every})
        for conn in conns:
            self._tell(conn, data)
        return True

    def _tell(self, conn: _Conn, data: bytes) -> None:
        try:
            with conn.lock:
                conn.sock.sendall(data)
        except OSError:
            pass  # the connection is going; its read will say so


def pace_for(connections: int) -> float:
    """The write interval (seconds) the server asks of each of ``connections`` clients."""
    rate = float(MAX_WRITES_PER_S)
    if connections > LARGE_FROM:
        share = min(1.0, (connections - LARGE_FROM) / (LARGE_JOB - LARGE_FROM))
        rate -= share * (MAX_WRITES_PER_S - LARGE_WRITES_PER_S)
    return min(MAX_EVERY_S, max(SEND_EVERY_S, connections / rate))


def _listen(bind: str, port: int) -> socket.socket:
    """A listening socket on ``bind`` ("" = every interface, IPv6 too where the host has it)."""
    if not bind and socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, backlog=512,
                                        dualstack_ipv6=True)
        except OSError:
            pass  # IPv6 switched off in this network namespace: IPv4 below
    return socket.create_server((bind, port), backlog=512)


_shared: dict[DriverAddress, EventServer] = {}
_shared_lock = threading.Lock()


def interface_text(bind: str) -> str:
    """A bind address in words: ``every interface`` or the address."""
    return "every interface" if bind in ("", "0.0.0.0", "::") else bind


def _address(address: DriverAddress | str | None) -> DriverAddress:
    if isinstance(address, str):
        return DriverAddress(address, address)
    return address or DriverAddress()


def shared_server(address: DriverAddress | str | None = None) -> EventServer:
    """The kernel's one event server for ``address``, started on first use."""
    address = _address(address)
    key = dataclasses.replace(address, source="")  # one server per place, however it was set
    with _shared_lock:
        server = _shared.get(key)
        if server is None or server._closed.is_set():
            server = _shared[key] = EventServer(address)
        return server


def close_shared() -> None:
    """Close the kernel's event servers (``%unload_ext nbdist``); the next job starts anew."""
    with _shared_lock:
        servers = list(_shared.values())
        _shared.clear()
    for server in servers:
        server.close()


def rejected_connections() -> int:
    """Connections the kernel's event servers refused (bad secret, malformed), in all."""
    with _shared_lock:
        return sum(server.rejected for server in _shared.values())


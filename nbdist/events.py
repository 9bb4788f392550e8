"""The rank → driver event channel.

A small authenticated JSON-lines protocol over TCP; nothing on it is ever unpickled.

1. The server sends ``{"t": "challenge", "nonce": HEX, "v": 3}``.
2. The client answers ``{"t": "hello", "job": ID, "rank": R, "mac": HMAC, ...}`` where HMAC is
   HMAC-SHA256 of ``"{nonce}:{job}:{rank}"`` keyed by the job's secret. The secret travels with
   the payload (pipe or Spark closure), never on this channel; the nonce makes a recorded hello
   useless on another connection. A connection that does not prove the secret within
   ``AUTH_DEADLINE_S``, in at most ``MAX_HELLO_BYTES``, is closed and counted in
   :attr:`EventServer.rejected`; so is one that breaks any rule of the protocol, whatever it
   sent: handling one connection never stops the server.
3. Then both sides send one JSON value per line: an event object, or (rank → driver) an
   array of event objects sent together. Rank → driver: output batches,
   progress, metrics, state changes, heartbeats. Driver → rank: the rendezvous answer
   (``world``), ``cancel``, and ``ping`` (a remote job's keepalive; see ``nbdist.job``).
4. An event (alone on its line) with ``"raw": N`` is followed by N
   raw bytes (at most ``MAX_BLOCK_BYTES``), handed to the job as the event's ``data``: how a
   session cell's value travels in pieces without base64 or JSON (``nbdist.values``).

The driver pays per write it reads (a wake-up, a read, a parse), far more than per event in
it, so clients coalesce. An event after a quiet spell goes at once; what follows goes in the
next write, at most one every ``SEND_EVERY_S``; progress, metrics and heartbeats wait up to
``LAZY_S`` for something else to travel with; and queued events merge (output of a stream into
one text, the newest progress of a bar replacing older ones, metrics into one dict). The server
keeps its reads near ``MAX_WRITES_PER_S`` whatever the number of ranks: once more ranks are
connected than that allows at ``SEND_EVERY_S``, it tells every client (``{"t": "pace",
"every": S}``) to write at most every ``S = connections / MAX_WRITES_PER_S`` seconds, and wakes
up less often itself (``PACE_S``). So the channel trades latency for the driver's CPU only in
large jobs: with 4 ranks a line takes about 10 ms; with 256, a busy rank writes every
0.64 s and a line after a quiet spell takes up to 0.1 s.

This module runs on ranks too: standard library only.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
#: Longest line accepted before authentication (the hello, a few hundred bytes).
MAX_HELLO_BYTES = 16 * 1024
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
#: Longest binary block an event may announce (protocol 3, item 4 above).
MAX_BLOCK_BYTES = 16 * 1024 * 1024
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
#: A client writes at most this often; events sent in between go together in the next write.
SEND_EVERY_S = 0.005
#: Writes per second the server aims to read at most, from all its clients together (see the
#: module docstring): about 1% of a core here, whatever the number of ranks.
MAX_WRITES_PER_S = 400
#: The pace told to clients changes only when it is off by more than this factor, so ranks
#: connecting one by one cause a handful of broadcasts, not one per rank.
_PACE_STEP = 1.25
#: Progress, metrics and heartbeats wait up to this long for other events to go with: views
#: show them at most ten times a second, and one write then carries several events.
LAZY_S = 0.25
#: Bytes of events a client holds before ``send`` waits for the driver to take some: a rank
#: printing faster than the driver reads is slowed down, the supervisor's memory stays bounded.
MAX_PENDING_BYTES = 8 * 1024 * 1024
#: Queued output of a stream is merged into one event up to this many characters.
MERGE_CHARS = 64 * 1024
#: Most bytes of events put in one line (one JSON array) by a client.
BATCH_LINE_BYTES = 1024 * 1024
#: Events that need not go at once, and may be merged with a newer one of the same kind.
_LAZY = frozenset({"progress", "metrics", "hb", "res"})

Event = dict[str, Any]


#: ``json.loads`` without its per-call checks (the server parses every write with it).
_decode = json.JSONDecoder().decode


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: str, nonce: str, job_id: str, rank: int) -> str:
    msg = f"{nonce}:{job_id}:{rank}".encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def encode(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class JobChannel(Protocol):
    """What the server calls for one job; called on the server's thread, so keep it short.

    A job may also have ``block_buffer(rank, event) -> memoryview | None``: where to read the
    binary block that ``event`` announces (exactly ``event["raw"]`` bytes), so that it lands
    where it belongs without a copy; the event then arrives with that view as its ``data``.
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
        if ready:
            # Let what arrives in the meantime pile up, to be read in one go.
            wait = min(MAX_PACE_S, max(PACE_S, self._pace / 4))
            time.sleep(max(0.0, woke + wait - time.monotonic()))

    def _timeout(self) -> float:
        """How long the loop may wait: until the oldest waiting connection's deadline."""
        for conn in self._waiting:
            due = conn.accepted + AUTH_DEADLINE_S - time.monotonic()
            return min(1.0, max(0.0, due) + 0.001)
        return 1.0

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
        self._repace()

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
                n = _recv(conn.sock, view, len(view), flags)
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
                n = _recv(conn.sock, self._rbuf, size, flags)
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
        if entry is not None:
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
            self._tell(conn, {"t": "pace", "every": self._pace})
        entry[1].on_connect(rank, event)
        return True

    def _repace(self) -> bool:
        """Tell every client a new write interval if the number of ranks moved it enough."""
        with self._lock:
            conns = list(self._conns.values())
        every = max(SEND_EVERY_S, len(conns) / MAX_WRITES_PER_S)
        if self._pace / _PACE_STEP <= every <= self._pace * _PACE_STEP:
            return False
        self._pace = every
        for conn in conns:
            self._tell(conn, {"t": "pace", "every": every})
        return True

    def _tell(self, conn: _Conn, event: Event) -> None:
        try:
            with conn.lock:
                conn.sock.sendall(encode(event))
        except OSError:
            pass  # the connection is going; its read will say so


def _recv(sock: socket.socket, buf: bytearray | memoryview, size: int, flags: int) -> int | None:
    """Bytes read into ``buf`` (0: the peer closed or reset), None if none are there now."""
    try:
        return sock.recv_into(buf, size, flags)
    except BlockingIOError:
        return None
    except OSError:  # reset by the peer
        return 0


class EventClient:
    """The rank-side end, used by the supervisor.

    ``send`` queues the event for a thread that writes it (see the module docstring for how
    events are coalesced), and never raises: when the driver cannot be reached the rank keeps
    running and the loss is counted in :attr:`dropped`. ``close`` sends what is still queued.
    """

    def __init__(
        self,
        address: tuple[str, int],
        job_id: str,
        rank: int,
        secret: str,
        hello: Mapping[str, Any],
        on_message: Callable[[Event], None],
        timeout: float = 10.0,
    ) -> None:
        self.dropped = 0
        self._on_message = on_message
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = self._sock.makefile("rb")
        try:
            try:
                challenge = json.loads(self._reader.readline(MAX_HELLO_BYTES) or b"{}")
            except ValueError:
                challenge = {}
            nonce = challenge.get("nonce") if isinstance(challenge, dict) else None
            if not isinstance(nonce, str):
                raise ConnectionError(f"no nbdist event server at {address[0]}:{address[1]}")
            self._sock.settimeout(None)
            mac = sign(secret, nonce, job_id, rank)
            hello = {**hello, "t": "hello", "job": job_id, "rank": rank, "mac": mac}
            self._sock.sendall(encode(hello))
            version = challenge.get("v")
            if version != PROTOCOL_VERSION:
                # Ranks run the notebook's own nbdist (the same installation, or one Spark's
                # executors import from the same release): no older protocol is spoken.
                raise ConnectionError(
                    f"the nbdist event server at {address[0]}:{address[1]} speaks protocol "
                    f"{version}, this rank {PROTOCOL_VERSION}: install the same nbdist version "
                    f"on the driver and the ranks")
        except BaseException:
            self._reader.close()
            self._sock.close()
            raise
        #: The server's protocol version (always ``PROTOCOL_VERSION``; see the module docstring).
        self.protocol: int = version
        self._pending: list[Event] = []
        self._pending_bytes = 0
        self._urgent = False  # something in _pending must go without waiting LAZY_S
        self._since = 0.0  # when the oldest pending event was queued
        self._closing = False
        self._every = SEND_EVERY_S  # the server may ask for a longer interval (``pace``)
        self._cond = threading.Condition()
        self.alive = True
        #: When the driver last said anything (``time.monotonic()``): a driver that keeps the
        #: ranks alive pings them (``{"t": "ping"}``), so a long silence means it is gone even
        #: where no connection reset ever arrives (a network cut off, a host powered down).
        self.last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._read, name="nbdist-client", daemon=True)
        self._thread.start()
        self._sender = threading.Thread(target=self._send_loop, name="nbdist-client-send",
                                        daemon=True)
        self._sender.start()

    def send(self, event: Mapping[str, Any]) -> bool:
        """Queue ``event`` for the driver; False (and counted) when the channel is down.

        An event whose ``data`` is bytes (at most ``MAX_BLOCK_BYTES``) travels as a binary
        block.
        """
        # Queued as it is (``_merge`` may fold later events of its kind into it).
        event = cast(Event, event)
        kind = event.get("t")
        size = len(event.get("text") or "") + 100  # what matters is the output text
        data = event.get("data")
        if isinstance(data, (bytes, bytearray, memoryview)):
            size += memoryview(data).nbytes
        with self._cond:
            while self._pending_bytes > MAX_PENDING_BYTES and self.alive:
                self._cond.wait()  # the driver is behind: wait rather than pile up
            if not self.alive:
                self.dropped += 1
                return False
            if not self._pending:
                self._since = time.monotonic()
            if kind in _LAZY:
                _merge(self._pending, event)
            else:
                if kind != "out" or not _append_output(self._pending, event):
                    self._pending.append(event)
                self._urgent = True
            self._pending_bytes += size
            self._cond.notify_all()
        return True

    def _send_loop(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._closing or not self.alive:
                        due = now
                    elif not self._pending:
                        due = None
                    else:
                        due = max(last + self._every,
                                  now if self._urgent else self._since + LAZY_S)
                    if due is not None and due <= now:
                        break
                    self._cond.wait(None if due is None else due - now)
                batch, self._pending = self._pending, []
                self._pending_bytes, self._urgent = 0, False
                self._cond.notify_all()
                if not batch:
                    return  # closing, everything sent
                if not self.alive:
                    self.dropped += len(batch)
                    continue
            if len(batch) > 1:  # a heartbeat says nothing that another event does not
                batch = [e for e in batch if e.get("t") != "hb"] or batch[-1:]
            try:
                for data in _lines(batch):
                    self._sock.sendall(data)
            except OSError:
                with self._cond:
                    self.alive = False
                    self.dropped += len(batch)
                    self._cond.notify_all()
            last = time.monotonic()

    def _read(self) -> None:
        try:
            for line in self._reader:
                self.last_heard = time.monotonic()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict) or event.get("t") == "ping":
                    continue
                if event.get("t") == "pace":
                    every = event.get("every")
                    if isinstance(every, (int, float)) and 0 <= every <= 60:
                        with self._cond:
                            self._every = max(SEND_EVERY_S, float(every))
                            self._cond.notify_all()
                    continue
                self._on_message(event)
        except OSError:
            pass
        with self._cond:
            self.alive = False
            self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then disconnect once the driver has read it all.

        Waits at most ``timeout`` for each: the queue to go out, then the driver to close its
        end. Closing ours first while the driver may still write to us (a ``cancel``, a
        ``pace``) would make our kernel answer with a reset, and a reset makes the driver's
        kernel throw away what it has not read yet: the rank's last lines.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._sender.join(timeout)
        with self._cond:
            self.alive = False
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the end of our writes, after the last one
        except OSError:
            pass
        self._thread.join(timeout)  # the reader ends when the driver closes its end
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sender.join(2)
        self._thread.join(2)
        self._sock.close()
        # The reader holds its own reference to the socket's fd: closing the socket alone
        # would leak one descriptor per connection.
        self._reader.close()


def _append_output(pending: list[Event], event: Event) -> bool:
    """Add an output event's text to the queued output of the same stream, if nothing but
    lazy events (which views show apart from the log) was queued after it."""
    text = event.get("text")
    if not isinstance(text, str):
        return False
    for i in range(len(pending) - 1, -1, -1):
        old = pending[i]
        kind = old.get("t")
        if kind in _LAZY:
            continue
        done = old.get("text")
        if kind == "out" and old.get("s") == event.get("s") and isinstance(done, str):
            if len(done) + len(text) > MERGE_CHARS:
                return False  # big chunks gain nothing from merging, and copying them costs
            pending[i] = {**old, "text": done + text}
            return True
        return False
    return False


def _lines(events: list[Event]) -> list[bytes | bytearray | memoryview]:
    """What one write carries: the events as arrays of up to ``BATCH_LINE_BYTES`` per line
    (each far below the server's ``MAX_LINE_BYTES``); an
    event with binary ``data`` alone on its line, ``"raw": N`` in place of the data, followed
    by the N bytes (as they are: joining them with the lines would copy them)."""
    out: list[bytes | bytearray | memoryview] = []
    text: list[bytes] = []
    groups: list[list[bytes]] = [[]]
    size = 0

    def flush() -> None:
        nonlocal size
        text.extend(b"[" + b",".join(g) + b"]\n" if len(g) > 1 else g[0] + b"\n"
                    for g in groups if g)
        groups[:] = [[]]
        size = 0

    for e in events:
        data = e.get("data")
        if isinstance(data, (bytes, bytearray, memoryview)):
            flush()
            head = {k: v for k, v in e.items() if k != "data"}
            text.append(encode({**head, "raw": memoryview(data).nbytes}))
            out += [b"".join(text), data]
            text.clear()
            continue
        p = json.dumps(e, separators=(",", ":"), ensure_ascii=False).encode()
        if groups[-1] and size + len(p) > BATCH_LINE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += len(p) + 1
    flush()
    if text:
        out.append(b"".join(text))
    return out


def _merge(pending: list[Event], event: Event) -> None:
    """Queue a lazy event, folding it into one of its kind already queued.

    Metrics merge into queued metrics. A progress update replaces the queued one of the same bar
    and goes to the end (views show the bar updated last); a heartbeat or a resources sample
    (``res``) replaces a queued one.
    """
    kind = event.get("t")
    for i, old in enumerate(pending):
        if old.get("t") != kind:
            continue
        if kind == "metrics":
            values, new = old.get("values"), event.get("values")
            if isinstance(values, dict) and isinstance(new, dict):
                # The newest event's other fields (its step) with both events' values.
                pending[i] = {**old, **event, "values": {**values, **new}}
                return
        elif kind == "hb" or old.get("id") == event.get("id"):
            del pending[i]
            break
    pending.append(event)


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


def free_port(host: str = "") -> int:
    """A TCP port for MASTER_PORT, chosen below the kernel's ephemeral range.

    Binding port 0 and closing it (what torchrun and TorchDistributor do) hands out a port
    from the ephemeral range, which the kernel may give to any outgoing connection before
    torch binds it. A port outside that range is never assigned implicitly, so once we saw it
    free only another program asking for that exact number could take it.
    """
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    top = max(low - 1, 10001)
    bottom = max(10000, top - 20000)
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randint(bottom, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # fall back to the OS's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def hostname_for_peers() -> str:
    """This host's address as other hosts should use it (loopback when SPARK_LOCAL_IP says so)."""
    env = os.environ.get("SPARK_LOCAL_IP") or os.environ.get("NBDIST_HOST")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

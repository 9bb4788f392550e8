"""The rank → driver event channel.

A small authenticated JSON-lines protocol over TCP; nothing on it is ever unpickled.

1. The server sends ``{"t": "challenge", "nonce": HEX, "v": 1}``.
2. The client answers ``{"t": "hello", "job": ID, "rank": R, "mac": HMAC, ...}`` where HMAC is
   HMAC-SHA256 of ``"{nonce}:{job}:{rank}"`` keyed by the job's secret. The secret travels with
   the payload (pipe or Spark closure), never on this channel; the nonce makes a recorded hello
   useless on another connection. A connection that does not prove the secret is closed and
   counted in :attr:`EventServer.rejected`.
3. Then both sides send one JSON object per line. Rank → driver: output batches, progress,
   metrics, state changes. Driver → rank: the rendezvous answer (``world``) and ``cancel``.

This module runs on ranks too: standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
#: Longest line accepted before authentication (the hello).
MAX_HELLO_BYTES = 64 * 1024
#: Longest line accepted after it; the supervisor cuts output lines far below this.
MAX_LINE_BYTES = 16 * 1024 * 1024

Event = dict[str, Any]


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: str, nonce: str, job_id: str, rank: int) -> str:
    msg = f"{nonce}:{job_id}:{rank}".encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def encode(event: Event) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


class JobChannel(Protocol):
    """What the server calls for one job; called on the server's thread, so keep it short."""

    def on_connect(self, rank: int, hello: Event) -> None: ...

    def on_event(self, rank: int, event: Event) -> None: ...

    def on_disconnect(self, rank: int) -> None: ...


class _Conn:
    def __init__(self, sock: socket.socket, nonce: str) -> None:
        self.sock = sock
        self.nonce = nonce
        self.buf = bytearray()
        self.job_id: str | None = None
        self.rank = -1
        self.lock = threading.Lock()


class EventServer:
    """The driver-side end: one thread multiplexing every rank connection of every job.

    Parameters
    ----------
    host : str
        Address to listen on: loopback for local ranks, the driver's address as Spark
        executors see it for Spark ranks.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0), backlog=512)
        self._listener.setblocking(False)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._jobs: dict[str, tuple[str, JobChannel]] = {}
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: Connections closed because they failed authentication or spoke garbage.
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

    def send(self, job_id: str, rank: int, event: Event) -> bool:
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
            for key, _ in self._sel.select(timeout=1.0):
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    self._wake_r.recv(64)
                else:
                    self._read(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, secrets.token_hex(16))
        try:
            sock.sendall(encode({"t": "challenge", "nonce": conn.nonce, "v": PROTOCOL_VERSION}))
        except OSError:
            sock.close()
            return
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn, *, rejected: bool) -> None:
        if rejected:
            self.rejected += 1
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
            entry[1].on_disconnect(conn.rank)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 18)
        except OSError:
            data = b""
        if not data:
            self._drop(conn, rejected=False)
            return
        conn.buf += data
        limit = MAX_LINE_BYTES if conn.job_id is not None else MAX_HELLO_BYTES
        if b"\n" not in data:
            if len(conn.buf) > limit:
                self._drop(conn, rejected=True)
            return
        *lines, rest = bytes(conn.buf).split(b"\n")
        conn.buf = bytearray(rest)
        for line in lines:
            if not line:
                continue
            if len(line) > limit or not self._handle(conn, line):
                self._drop(conn, rejected=True)
                return

    def _handle(self, conn: _Conn, line: bytes) -> bool:
        try:
            event = json.loads(line)
        except ValueError:
            return False
        if not isinstance(event, dict):
            return False
        if conn.job_id is None:
            return self._hello(conn, event)
        with self._lock:
            entry = self._jobs.get(conn.job_id)
        if entry is not None:
            try:
                entry[1].on_event(conn.rank, event)
            except Exception:  # a bad event must not kill the channel for every job
                log.exception("nbdist: event handler failed for %r", event.get("t"))
        return True

    def _hello(self, conn: _Conn, event: Event) -> bool:
        job_id, rank, mac = event.get("job"), event.get("rank"), event.get("mac")
        if event.get("t") != "hello" or not isinstance(job_id, str) or not isinstance(rank, int):
            return False
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None or not isinstance(mac, str):
            return False
        secret, channel = entry
        if not hmac.compare_digest(mac, sign(secret, conn.nonce, job_id, rank)):
            return False
        conn.job_id, conn.rank = job_id, rank
        with self._lock:
            old = self._conns.get((job_id, rank))
            self._conns[(job_id, rank)] = conn
        if old is not None:  # a reconnect replaces the old connection
            self._wake_close(old)
        channel.on_connect(rank, event)
        return True


class EventClient:
    """The rank-side end, used by the supervisor.

    ``send`` never raises: when the driver cannot be reached the rank keeps running and the
    loss is counted in :attr:`dropped` and reported in the rank's final state.
    """

    def __init__(
        self,
        address: tuple[str, int],
        job_id: str,
        rank: int,
        secret: str,
        hello: Event,
        on_message: Callable[[Event], None],
        timeout: float = 10.0,
    ) -> None:
        self.dropped = 0
        self._lock = threading.Lock()
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
        except BaseException:
            self._reader.close()
            self._sock.close()
            raise
        self.alive = True
        self._thread = threading.Thread(target=self._read, name="nbdist-client", daemon=True)
        self._thread.start()

    def send(self, event: Event) -> bool:
        data = encode(event)
        with self._lock:
            if not self.alive:
                self.dropped += 1
                return False
            try:
                self._sock.sendall(data)
            except OSError:
                self.alive = False
                self.dropped += 1
                return False
        return True

    def _read(self) -> None:
        try:
            for line in self._reader:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self._on_message(event)
        except OSError:
            pass
        self.alive = False

    def close(self) -> None:
        with self._lock:
            self.alive = False
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        self._thread.join(timeout=2)
        # The reader holds its own reference to the socket's fd: closing the socket alone
        # would leak one descriptor per connection.
        self._reader.close()


_shared: dict[str, EventServer] = {}
_shared_lock = threading.Lock()


def shared_server(host: str = "127.0.0.1") -> EventServer:
    """The kernel's one event server for ``host``, started on first use."""
    with _shared_lock:
        server = _shared.get(host)
        if server is None or server._closed.is_set():
            server = _shared[host] = EventServer(host)
        return server


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

"""What a stranger may send to nbdist's event server: each input breaks a rule of the protocol.

Shared by ``tests/test_events.py`` (a server of its own) and the fault matrix
(``tests/faults/rows.py``: the kernel's server, local and Spark, with a real job after them).
Loopback only; every loop here is bounded.
"""

from __future__ import annotations

import json
import resource
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import pytest

from nbdist import channel, events

#: How to build the bytes sent, given the challenge's nonce.
Payload = Callable[[str], bytes]


def _hello(job_id: str, **fields: object) -> Payload:
    def build(nonce: str) -> bytes:
        hello = {"t": "hello", "job": job_id, "rank": 0, "mac": "0" * 64, **fields}
        return json.dumps(hello).encode() + b"\n"

    return build


def _raw(text: bytes) -> Payload:
    return lambda nonce: text


def malformed(job_id: str) -> list[tuple[str, Payload]]:
    """(what, payload) for every malformed input tried; ``job_id`` names a job the server has."""
    head = b'{"t":"hello","job":' + json.dumps(job_id).encode()
    cases: list[tuple[str, Payload]] = [
        ("5000 [ (json's RecursionError)", _raw(b"[" * 5000 + b"\n")),
        ("5000 nested objects", _raw(b'{"a":' * 5000 + b"\n")),
        ("a mac that is not ASCII (compare_digest's TypeError)", _hello(job_id, mac="é" * 64)),
        ("a mac with a lone surrogate", _raw(head + b',"rank":0,"mac":"\\ud800"}\n')),
        ("a rank of 4000 digits", _raw(head + b',"rank":' + b"9" * 4000 + b',"mac":"00"}\n')),
        ("a rank of 5000 digits (int's digit limit)",
         _raw(head + b',"rank":' + b"9" * 5000 + b',"mac":"00"}\n')),
        ("a rank of 1e999", _raw(head + b',"rank":1e999,"mac":"00"}\n')),
        ("a rank of NaN", _raw(head + b',"rank":NaN,"mac":"00"}\n')),
        ("a negative rank", _hello(job_id, rank=-1)),
        ("a rank that is true", _hello(job_id, rank=True)),
        ("NUL bytes", _raw(b"\x00" * 64 + b"\n")),
        ("a NUL in the job id", _hello(job_id + "\x00")),
        ("a raw control character in a string", _raw(head + b',"rank":0,"mac":"\x00"}\n')),
        ("invalid UTF-8", _raw(b"\xff\xfe\xfd\n")),
        ("an empty array", _raw(b"[]\n")),
        ("an array of hellos", lambda nonce: b"[" + _hello(job_id)(nonce)[:-1] + b"]\n"),
        ("a number", _raw(b"3\n")),
        ("null", _raw(b"null\n")),
        ("a string", _raw(b'"hello"\n')),
        ("a line longer than MAX_HELLO_BYTES", _raw(b"x" * (channel.MAX_HELLO_BYTES + 10))),
        ("an HTTP request", _raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("an announced binary block before the hello", _raw(b'{"t":"x","raw":10}\n0123456789')),
    ]
    wrong_types: dict[str, list[object]] = {
        "t": [None, 1, ["hello"], {"hello": 1}],
        "job": [None, 1, [job_id], {job_id: 1}],
        "rank": ["0", 0.0, [0], None, {"0": 0}],
        "mac": [None, 0, ["0" * 64], {"0": 1}],
    }
    for field, values in wrong_types.items():
        for value in values:
            cases.append((f"{field}={value!r}", _hello(job_id, **{field: value})))
    return cases


def greet(address: tuple[str, int], timeout: float = 10) -> tuple[socket.socket, str]:
    """A raw connection to the server, and the nonce of its challenge."""
    sock = socket.create_connection(address, timeout=timeout)
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError("closed before the challenge")
        line += chunk
    return sock, json.loads(line)["nonce"]


def closed_on_us(sock: socket.socket) -> bool:
    """True once the server closes the connection (False if it is still open after the
    socket's timeout: the server did not deal with what it was sent)."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        pass
    return True


def send_each(address: tuple[str, int], cases: list[tuple[str, Payload]]) -> list[str]:
    """Send each case on a connection of its own; the cases the server did NOT close."""
    still_open = []
    for what, payload in cases:
        sock, nonce = greet(address)
        with sock:
            try:
                sock.sendall(payload(nonce))
            except OSError:
                pass  # closed while we wrote: what we check below
            if not closed_on_us(sock):
                still_open.append(what)
    return still_open


class more_files:
    """Raise the soft limit of open files to at least ``n`` for a block (restored after)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.old = resource.getrlimit(resource.RLIMIT_NOFILE)
        soft, hard = self.old
        if soft != resource.RLIM_INFINITY and soft < self.n:
            if hard != resource.RLIM_INFINITY and hard < self.n:
                pytest.skip(f"needs {self.n} open files; the hard limit is {hard}")
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.n, hard))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, self.old)


class IdleStrangers:
    """``n`` connections to ``address`` that never say hello, held while the block runs: one
    the server cuts is replaced at the next round (every ``ROUND_S``, for ``limit_s`` at most).

    ``held`` is how many were open at the end of the last round, once the cut ones had been
    replaced: a figure that does not depend on when it is read (a count read mid-round, or a cap
    on the connections made that a slow job exhausts, would race the server's deadline).
    """

    ROUND_S = 0.25

    def __init__(self, address: tuple[str, int], n: int, limit_s: float = 300) -> None:
        self.address, self.n, self.limit_s = address, n, limit_s
        self.opened = self.cut = self.held = 0
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._files = more_files(2 * n + 600)  # ours and the server's ends, in this process

    def _open(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=5)
        except OSError:
            return  # the backlog is full: the next round tries again
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def __enter__(self) -> IdleStrangers:
        self._files.__enter__()
        for _ in range(self.n):
            self._open()
        self.held = len(self._sel.get_map())
        self._thread = threading.Thread(target=self._keep, daemon=True)
        self._thread.start()
        return self

    def _keep(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self._stop.wait(self.ROUND_S) and time.monotonic() < deadline:
            for key, _ in self._sel.select(0):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(65536):
                        continue  # the challenge: left unanswered
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._sel.unregister(sock)
                sock.close()
                self.cut += 1
            for _ in range(self.n - len(self._sel.get_map())):
                self._open()  # a full backlog fails it: the next round tries again
            self.held = len(self._sel.get_map())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._files.__exit__()


def slowloris(address: tuple[str, int], every: float, limit_s: float) -> float | None:
    """Trickle one byte every ``every`` seconds, never a newline: the seconds until the server
    cut the connection, or None if it had not after ``limit_s``."""
    sock, _ = greet(address)
    start = time.monotonic()
    with sock:
        sock.settimeout(every)
        while time.monotonic() - start < limit_s:
            try:
                sock.send(b"{")
                if sock.recv(1) == b"":
                    return time.monotonic() - start
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - start
    return None


_ATTACKER = r"""
import socket, sys
host, port, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
blob = b"x" * size
held = []
for _ in range(n):
    s = socket.create_connection((host, port), timeout=30)
    s.setblocking(False)
    try:
        s.send(blob)
    except OSError:
        pass
    held.append(s)
print("done", flush=True)
sys.stdin.read()  # hold them until told (or the parent goes)
"""


@dataclass
class Flood:
    peak_growth: int  # bytes: this process's peak resident memory above where it started
    rejected: int  # connections the server closed and counted meanwhile
    seconds: float


def flood(server: events.EventServer, n: int, size: int, limit_s: float = 110) -> Flood:
    """``n`` connections from a child process, each sending ``size`` bytes and no newline,
    held until the server counted ``n`` rejections (or ``limit_s``), while this process's
    memory (the server's) is sampled every 10 ms."""
    me = psutil.Process()
    before = peak = me.memory_info().rss
    rejected = server.rejected
    start = time.monotonic()
    with more_files(n + 600):
        attacker = subprocess.Popen(
            [sys.executable, "-c", _ATTACKER, *map(str, server.address), str(n), str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert attacker.stdin is not None and attacker.stdout is not None
        reader = threading.Thread(target=attacker.stdout.readline, daemon=True)
        reader.start()
        try:
            while ((reader.is_alive() or server.rejected - rejected < n)
                   and time.monotonic() - start < limit_s):
                peak = max(peak, me.memory_info().rss)
                time.sleep(0.01)
        finally:
            attacker.stdin.close()
            attacker.wait(30)
            reader.join(10)
            attacker.stdout.close()
    return Flood(peak - before, server.rejected - rejected, time.monotonic() - start)


# -- the Spark executor zygote's Unix socket (``nbdist.rank.executor_zygote``) -------------------
# One packet per message (SOCK_SEQPACKET), so the event server's lines become packets: the same
# malformed inputs, without their newline, plus what only a packet socket carries.
def zygote_greet(path: str, timeout: float = 30) -> tuple[socket.socket, str]:
    """A raw connection to an executor zygote's socket, and the nonce of its challenge."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        return sock, json.loads(sock.recv(1 << 16))["nonce"]
    except BaseException:
        sock.close()
        raise


def zygote_hello(path: str, secret: str) -> tuple[socket.socket, dict[str, object]]:
    """A connection that proved ``secret``, and the zygote's ``ready`` answer."""
    from nbdist.rank import executor_zygote

    sock, nonce = zygote_greet(path)
    hello = {"t": "hello", "modules": [], "mac": executor_zygote.mac(secret, nonce)}
    sock.send(json.dumps(hello).encode())
    return sock, json.loads(sock.recv(1 << 16) or b"{}")


def zygote_rejected(path: str, secret: str) -> int:
    """How many connections the zygote at ``path`` has closed for breaking its protocol."""
    sock, ready = zygote_hello(path, secret)
    sock.close()
    assert ready.get("t") == "ready", ready
    return int(ready["rejected"])  # type: ignore[call-overload]


def zygote_malformed(secret: str) -> list[tuple[str, Payload, int]]:
    """(what, payload, how many pipe ends go with it) for every input tried on an executor
    zygote's socket; ``secret`` is the application's (for the cases that pass the MAC)."""
    from nbdist.rank import executor_zygote

    def signed(modules: bytes) -> Payload:
        def build(nonce: str) -> bytes:
            mac = executor_zygote.mac(secret, nonce).encode()
            return b'{"t":"hello","mac":"' + mac + b'","modules":' + modules + b"}"

        return build

    cases = [(what, _packet(payload), 0) for what, payload in malformed("j1")]
    cases += [
        ("5000 [ with four descriptors", _raw(b"[" * 5000), 4),
        ("a fork before any hello, with four descriptors",
         _raw(b'{"t":"fork","sync":"x","job":"j","rank":0,"after_rank0":false}'), 4),
        ("a packet of 100 KB (more than the zygote reads: cut short)",
         _raw(b'{"t":"hello","mac":"' + b"0" * 100_000 + b'"}'), 0),
        ("a hello cut short", _raw(b'{"t":"hello","modules":[],"mac":"'), 0),
        ("a hello of the right MAC whose modules nest 5000 deep",
         signed(b"[" * 5000 + b"]" * 5000), 0),
        ("a hello of the right MAC whose modules are not a list", signed(b"7"), 0),
        ("a hello of the right MAC whose modules are a dict", signed(b'{"torch":1}'), 0),
        # A hand-over (``nice``: imported later) of the wrong type: closed, nothing queued.
        ("a hand-over of the right MAC whose nice is a string", signed(b'[],"nice":"19"'), 0),
        ("a hand-over of the right MAC whose nice is a float", signed(b'["json"],"nice":1.5'),
         0),
    ]
    return cases


def _packet(payload: Payload) -> Payload:
    return lambda nonce: payload(nonce).rstrip(b"\n")


def zygote_send_each(path: str, cases: list[tuple[str, Payload, int]]) -> list[str]:
    """Send each case on a connection of its own (with ``n`` write ends of pipes attached);
    the cases the zygote did NOT close, or whose pipe ends it kept open."""
    import os

    failed = []
    for what, payload, n in cases:
        sock, nonce = zygote_greet(path)
        pipes = [os.pipe() for _ in range(n)]
        with sock:
            try:
                socket.send_fds(sock, [payload(nonce)], [w for _, w in pipes])
            except OSError:
                pass  # closed while we wrote: what we check below
            for _, w in pipes:
                os.close(w)
            if not closed_on_us(sock):
                failed.append(what)
        for r, _ in pipes:  # the zygote closed what it was given: end of file here
            readable, _, _ = select.select([r], [], [], 30)
            if not readable or os.read(r, 1) != b"":
                failed.append(f"{what} (its descriptors kept)")
            os.close(r)
    return failed


# -- files and folders another local user can reach (HARDENING.md rules 1-3) --------------------
#: The uid the folders of "another user" are given (nobody).
STRANGER_UID = 65534


def strangers_folder(path: str) -> str:
    """Make ``path`` a folder as another local user would have made it first: theirs, mode
    0777 (root only: ``chown``; the test is skipped otherwise)."""
    import os

    if os.getuid() != 0:
        pytest.skip("making a folder of another user needs root (chown)")
    os.makedirs(path, exist_ok=True)
    os.chown(path, STRANGER_UID, STRANGER_UID)
    os.chmod(path, 0o777)
    return path


def fifo(path: str) -> str:
    """A named pipe at ``path`` that nobody reads: opening it to write blocks (or fails with
    ``O_NONBLOCK``)."""
    import os

    os.mkfifo(path, 0o600)
    return path

"""The Spark executor zygote's socket under attack, on a zygote started here without Spark.

The zygote is the real one (``executor_zygote.main``, as a Spark task starts it), given a socket
in a private directory of its own; ``tests/spark/test_warm_executors.py`` attacks the zygotes of
real executors (``local[2]`` and the standalone cluster) the same way. Also: the variables a
zygote's key leaves out, which each forked rank gets from its own task.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from nbdist.rank import executor_zygote

from . import hostile
from .helpers import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not executor_zygote.supported(), reason="Linux only")]


@dataclass
class Zygote:
    path: str
    secret: str
    proc: psutil.Process
    stderr: Path

    def alive(self) -> bool:
        try:
            return self.proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def start(directory: str, idle_s: float = 600, later: list[str] | None = None,
          env: dict[str, str] | None = None, pid: Callable[[], int] | None = None) -> Zygote:
    """An executor zygote listening in ``directory``, as a task would start it (``later``:
    what a first rank reported it imported, for the zygote to import at nice 19). Its pid is
    asked of the socket (``SO_PEERCRED``), or of ``pid`` where the zygote does not answer yet."""
    path = os.path.join(directory, "z-test.sock")  # short: a socket's path has 108 bytes
    secret = secrets.token_hex(32)
    lock_fd = os.open(path[:-5] + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for its life, as a task does
    config: executor_zygote.ExecutorConfig = {
        "path": path, "secret": secret, "idle_s": idle_s, "modules": [], "nice": 0,
        "watch": [os.getpid()], "lock_fd": lock_fd, "t0": time.time_ns(), "later": later or [],
    }
    stderr = Path(directory, "stderr")
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", executor_zygote.COMMAND],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                pass_fds=(lock_fd,), start_new_session=True, env=env)
    os.close(lock_fd)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config).encode())
    proc.stdin.close()
    proc.wait(60)  # it forks the zygote and exits
    wait_for(lambda: os.path.exists(path), 60, "the zygote's socket")
    if pid is not None:
        return Zygote(path, secret, psutil.Process(pid()), stderr)
    sock, _ = hostile.zygote_greet(path)
    with sock:
        peer = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   struct.calcsize("3i")))[0]
    return Zygote(path, secret, psutil.Process(peer), stderr)


@pytest.fixture
def zygote_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="nbz", dir="/tmp")
    os.chmod(directory, 0o700)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def zygote(zygote_dir: str) -> Iterator[Zygote]:
    z = start(zygote_dir)
    try:
        yield z
    finally:
        if z.alive():
            z.proc.terminate()
            z.proc.wait(30)


def fork_a_rank(z: Zygote) -> None:
    """Ask the zygote for a rank as a task does, and end it: the zygote forks it and tells
    how it ended (proof that it serves)."""
    sock, ready = hostile.zygote_hello(z.path, z.secret)
    with sock:
        assert ready["t"] == "ready" and ready["safe"], ready
        pipes = [os.pipe() for _ in range(4)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]]
        fork = {"t": "fork", "sync": "s", "job": "j1", "rank": 0, "after_rank0": False}
        socket.send_fds(sock, [json.dumps(fork).encode()], theirs)
        for fd in theirs:
            os.close(fd)
        forked = json.loads(sock.recv(1 << 16))
        assert forked["t"] == "forked" and isinstance(forked["pid"], int), forked
        os.close(ours[0])  # control-in closed: the rank stops itself
        ended = json.loads(sock.recv(1 << 16))
        for fd in ours[1:]:
            os.close(fd)
        assert ended["t"] == "exit" and ended["pid"] == forked["pid"], ended
        assert isinstance(ended["code"], int), ended


def test_every_malformed_packet_closes_its_connection_and_the_zygote_goes_on(
    zygote: Zygote,
) -> None:
    """Garbage, deep nesting (json's RecursionError), huge and cut-short packets, non-UTF-8 and
    wrong types, each on its own connection and some with pipes attached: each connection is
    closed and counted, every pipe end it was given is closed, and the zygote still forks."""
    cases = hostile.zygote_malformed(zygote.secret)
    assert hostile.zygote_send_each(zygote.path, cases) == [], zygote.stderr.read_text()
    assert zygote.alive(), zygote.stderr.read_text()
    assert hostile.zygote_rejected(zygote.path, zygote.secret) == len(cases)
    fork_a_rank(zygote)
    assert os.path.exists(zygote.path)


def test_a_silent_connection_is_cut_at_the_hello_deadline_and_counted(zygote: Zygote) -> None:
    """A connection that says nothing, or says hello too late, is closed AUTH_DEADLINE_S after
    it connected and counted; the zygote serves the next task."""
    silent, _ = hostile.zygote_greet(zygote.path, timeout=4 * executor_zygote.AUTH_DEADLINE_S)
    late, nonce = hostile.zygote_greet(zygote.path)
    start_at = time.monotonic()  # after the zygote accepted `late`: its deadline is before this
    with silent, late:
        assert hostile.closed_on_us(silent), "a silent connection was never cut"
        waited = time.monotonic() - start_at
        assert waited >= executor_zygote.AUTH_DEADLINE_S * 0.9
        # `late` connected after `silent` (by up to seconds on a loaded machine): its hello must
        # come after its own deadline, not just after silent's, or it is answered in time.
        time.sleep(max(0.0, start_at + executor_zygote.AUTH_DEADLINE_S - time.monotonic()))
        hello = {"t": "hello", "modules": [], "mac": executor_zygote.mac(zygote.secret, nonce)}
        try:
            late.send(json.dumps(hello).encode())
        except OSError:
            pass  # closed already
        late.settimeout(30)
        assert hostile.closed_on_us(late), "a hello after the deadline was answered"
    assert hostile.zygote_rejected(zygote.path, zygote.secret) == 2
    fork_a_rank(zygote)


def test_a_flood_of_silent_connections_cannot_keep_a_task_out(zygote: Zygote) -> None:
    """Twice MAX_UNAUTHENTICATED silent connections: the oldest are closed (counted) to make
    room, and a task that connects after them still gets its rank."""
    n = 2 * executor_zygote.MAX_UNAUTHENTICATED
    held = [hostile.zygote_greet(zygote.path)[0] for _ in range(n)]
    try:
        fork_a_rank(zygote)
        cut = [s for s in held if select.select([s], [], [], 0)[0] and s.recv(1) == b""]
        assert len(cut) >= n - executor_zygote.MAX_UNAUTHENTICATED
    finally:
        for s in held:
            s.close()
    assert hostile.zygote_rejected(zygote.path, zygote.secret) >= n // 2


def test_strangers_that_never_say_hello_do_not_keep_an_idle_zygote(zygote_dir: str) -> None:
    """An idle zygote goes after idle_s even while strangers stay connected without a hello
    (one cut at its deadline is replaced at once): they are not work."""
    z = start(zygote_dir, idle_s=2)
    stop = threading.Event()

    def strangers() -> None:
        while not stop.is_set():
            try:
                sock, _ = hostile.zygote_greet(z.path, timeout=60)
            except OSError:  # the zygote went
                return
            with sock:
                while not stop.is_set() and not select.select([sock], [], [], 0.05)[0]:
                    pass

    thread = threading.Thread(target=strangers, daemon=True)
    thread.start()
    try:
        wait_for(lambda: not z.alive(), 60, "the idle zygote to go with a stranger connected")
    finally:
        stop.set()
        thread.join(60)
        if z.alive():
            z.proc.terminate()
    assert not os.path.exists(z.path), "the zygote left its socket behind"


def test_strangers_who_connect_during_a_low_priority_import_wait_then_are_refused(
        zygote_dir: str, tmp_path: Path) -> None:
    """While the zygote imports at nice 19 what a first rank reported (minutes on a loaded
    host), nothing is read from anyone: a stranger's garbage and a fork with descriptors
    before any hello wait, unanswered, until the import ends; then each is closed and counted,
    every descriptor given is closed, the rest of the imports still happen (strangers cannot
    stop the warm-up for good) and a task still gets its rank (HARDENING rules 5 and 6)."""
    site = tmp_path / "site-packages"  # what counts as installed (test_warm_pool.py)
    site.mkdir()
    importing, release, second = (tmp_path / n for n in ("importing", "release", "second"))
    (site / "nbdist_slow_later.py").write_text(
        "import os, time\n"
        f"with open({str(importing)!r} + '.tmp', 'w') as f:\n"
        "    f.write(str(os.getpid()))\n"
        f"os.rename({str(importing)!r} + '.tmp', {str(importing)!r})\n"
        "deadline = time.monotonic() + 120\n"
        f"while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n")
    (site / "nbdist_after_slow.py").write_text(f"open({str(second)!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")]))}

    def importer() -> int:  # the zygote, which answers no one while it imports
        wait_for(importing.exists, 60, "the zygote to start its low-priority import")
        return int(importing.read_text())

    z = start(zygote_dir, later=["nbdist_slow_later", "nbdist_after_slow"], env=env,
              pid=importer)
    try:
        cases = [(b"[" * 5000, 0), (b"\xff\xfe not UTF-8", 0),
                 (b'{"t":"fork","sync":"x","job":"j","rank":0,"after_rank0":false}', 4)]
        queued = []
        for payload, n in cases:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(60)
            sock.connect(z.path)  # into the listen queue: nothing accepts during the import
            pipes = [os.pipe() for _ in range(n)]
            socket.send_fds(sock, [payload], [w for _, w in pipes])
            for _, w in pipes:
                os.close(w)
            queued.append((sock, [r for r, _ in pipes]))
        assert not second.exists()
        assert not any(select.select([s], [], [], 0)[0] for s, _ in queued), \
            "the zygote answered a connection in the middle of its import"
        release.touch()
        for sock, reads in queued:
            with sock:
                assert hostile.closed_on_us(sock), "a stranger's connection was kept"
            for r in reads:  # the descriptors it was given are closed: end of file here
                assert select.select([r], [], [], 30)[0] and os.read(r, 1) == b""
                os.close(r)
        wait_for(second.exists, 60, "the zygote to import the rest after the strangers")
        assert z.alive(), z.stderr.read_text()
        assert hostile.zygote_rejected(z.path, z.secret) == len(cases)
        fork_a_rank(z)
    finally:
        release.touch()
        if z.alive():
            z.proc.terminate()
            z.proc.wait(30)


def test_a_zygote_serves_workers_whose_volatile_variables_differ_and_each_rank_gets_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray sets ``RAY_JOB_ID``, ``PYTHONIOENCODING`` and ``CUDA_VISIBLE_DEVICES`` differently
    in its workers: the key of a node's zygote leaves them out (``RankSpec.volatile``), and the
    rank's environment frame sets them as its own task has them, or unsets them."""
    from nbdist.rank import runtime
    from nbdist.rank.supervisor import RankSpec, env_frame

    spec = RankSpec(rank=0, world_size=1, job_id="j", secret="s", driver=("127.0.0.1", 1),
                    payload=b"", env={"NBDIST_TEST_MINE": "1"},
                    volatile=("NBDIST_TEST_SET", "NBDIST_TEST_UNSET"))
    monkeypatch.setenv("NBDIST_TEST_SET", "worker-1")
    monkeypatch.setenv("NBDIST_TEST_UNSET", "the zygote's")
    first = executor_zygote.key("app", spec)
    monkeypatch.setenv("NBDIST_TEST_SET", "worker-2")
    monkeypatch.delenv("NBDIST_TEST_UNSET")
    assert executor_zygote.key("app", spec) == first
    monkeypatch.setenv("NBDIST_TEST_OTHER", "x")  # any other variable still makes another key
    assert executor_zygote.key("app", spec) != first
    monkeypatch.delenv("NBDIST_TEST_OTHER")

    frame = env_frame(spec, {"RANK": "0"})
    assert frame["env"] == {"NBDIST_TEST_SET": "worker-2", "NBDIST_TEST_MINE": "1", "RANK": "0"}
    assert frame["unset"] == ["NBDIST_TEST_UNSET"]
    monkeypatch.setenv("NBDIST_TEST_UNSET", "the zygote's")  # as the forked rank has it
    monkeypatch.setenv("NBDIST_TEST_SET", "worker-1")
    monkeypatch.setattr(runtime, "_size_thread_pools", lambda threads: None)
    runtime._set_env(frame)
    assert "NBDIST_TEST_UNSET" not in os.environ
    assert os.environ["NBDIST_TEST_SET"] == "worker-2"
    assert "unset" not in env_frame(RankSpec(rank=0, world_size=1, job_id="j", secret="s",
                                             driver=("127.0.0.1", 1), payload=b""), {})

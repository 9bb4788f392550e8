"""Warm ranks on Spark executors: a zygote per executor, owned by the Spark application.

A Spark task's rank would otherwise be a fresh interpreter every time, paying ``import torch``
(about a second) on every run. The first nbdist task on an executor starts its rank as before
and, once that rank's code has returned, a zygote that stays behind
(:meth:`ExecutorZygote.on_mark`): one per executor, Python environment and application,
importing the job's modules in a thread at nice 19, while the rank's result travels back: it
never competes with the rank, so the first run is not slowed.
Later tasks of the same application connect to it over a
local Unix socket as they begin (overlapping the rendezvous) and ask it for a forked rank
(:meth:`ExecutorZygote.take`); a task that finds none starts its rank fresh, as before. The
rules of the local zygote (``zygote.py``) hold: it imports installed packages only, forks only
with one thread and no CUDA driver started (``fork_safety.py``), checks its modules' files at
every request (a changed file: it forks nothing more and goes), reseeds each rank's
generators, and the rank gets the task's environment (the socket's name is a hash of it).

Where it lives: ``<tmpdir>/nbdist-<uid>/z-<jvm>-<hash>.sock`` (the directory 0700, ours),
``<jvm>`` the pid of the executor's JVM (so that two executors on one host never share a
zygote, and the cap counts per executor), the hash taking the application's id, the
Python, the working directory, the whole environment, the installation's stamp and the
process attributes. Who may use it: a peer of the same uid
(``SO_PEERCRED``, both ways) that answers a challenge with HMAC-SHA256 of the application's
secret (32 random bytes the driver makes per SparkContext and ships in the task's closure).
Whatever a connection sends, handling it never ends the zygote: one that breaks the protocol
in any way (garbage, deep nesting, wrong types), or has not proved the secret within
``AUTH_DEADLINE_S``, is closed and counted (``rejected``, told in each ``ready``); until it
proves the secret a connection is not work for the idle timer.
One packet per JSON object (``SOCK_SEQPACKET``): zygote → ``challenge``; task → ``hello``
(mac, modules to import) → ``ready``; task → ``fork`` with the rank's four pipes (SCM_RIGHTS)
→ ``forked``; later ``exit`` with the rank's exit code (the zygote is its parent and guardian).
A task whose rank was forked hands over, on a connection of its own, what the rank reports it
imported (lazily imported subpackages too; the report comes after the rank's code, before it
ends): a ``hello`` with ``nice``. The zygote imports that (and what the first rank reported,
given at its start) at nice 19 once no rank forked here runs and no task is connected, one
module at a time, and stops for a task that connects meanwhile (``_Server._warm_later``).
Both ends are in this module and the messages are typed below (``TaskMsg``, ``ExecutorZygoteMsg``;
``forked`` and ``exit`` are the local zygote's); the task that starts a zygote gives it an
``ExecutorConfig`` on its stdin.

When it goes: when the executor goes (it watches the executor's JVM and the Python daemon
that forks Spark's workers, with pidfds: both end with the application, or when the executor
is killed), when idle for ``idle_s`` (the driver's ``NBDIST_WARM_IDLE_S``) and when a module
file changed. Its ranks go with it. A lock file held for its whole life makes sure one task
starts it, not every task of the executor at once.

Linux only; the zygote side imports the standard library and nbdist's rank runtime.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Literal, TypedDict, cast

from nbdist.rank.host import environ
from nbdist.rank.supervisor import RankProcess, RankSpec, new_sync_marker
from nbdist.rank.zygote import ExitMsg, Forked, ForkedMsg, ForkMsg, import_modules
from nbdist.timeline import END, EXIT
from nbdist.tmpdirs import private_dir

#: How the zygote is started; the ranks it forks show the same command line.
COMMAND = "from nbdist.rank.executor_zygote import main; main()"
#: The longest a task waits for its executor's zygote to answer or finish importing; it then
#: starts its rank fresh (an import in progress is always nearer its end than a new one).
WAIT_S = 60.0
#: At most this many zygotes per executor and uid (each holds its imports: torch ≈ 300 MB);
#: another environment then starts its ranks fresh until one of them goes.
MAX_PER_EXECUTOR = 2
#: The longest ``leave_behind(settle=True)`` waits for the process that forks the zygote.
SETTLE_S = 10.0
#: The longest a rank waits for rank 0 of its job to be forked first on the same zygote.
FIRST_WAIT_S = 1.0
#: The nice value of the imports of a zygote started while a job's rank runs beside it.
LOW_NICE = 19
#: The longest the start of a zygote, once the rank's code returned, waits for the rank to
#: say what it imported (it does at once; a rank that died says nothing).
REPORT_WAIT_S = 5.0
#: The longest a task waits for the executor's zygote to take its rank's modules (``report``):
#: the zygote answers at once and imports them later.
HANDOVER_S = 2.0
#: A connection must send its hello this soon after it is accepted, or it is closed (and
#: counted in ``_Server.rejected``): a task sends it as soon as it reads the challenge. Until
#: then a connection is not work: a silent stranger neither keeps an idle zygote alive past
#: ``idle_s`` nor holds a descriptor for longer than this (the event server's rule).
AUTH_DEADLINE_S = 5.0
#: Most connections waiting for their hello at once; one more closes the one that has waited
#: longest (counted): a flood of strangers cannot run the zygote out of descriptors.
MAX_UNAUTHENTICATED = 64
_PACKET = 1 << 16
_CHALLENGE = b"nbdist-executor-zygote:"


# -- the messages on the socket, and the zygote's configuration: both ends are in this module ------
class ChallengeMsg(TypedDict):
    """Zygote → task, as it connects: answer with ``mac(secret, nonce)``."""

    t: Literal["challenge"]
    nonce: str


class HelloMsg(TypedDict):
    """Task → zygote: the answer to the challenge, and the modules its rank will import (at
    once); with ``nice`` > 0, modules a rank imported, for the next runs: imported at that
    priority once no rank forked here runs (``ExecutorZygote.leave_behind``)."""

    t: Literal["hello"]
    modules: list[str]
    nice: int
    mac: str


class ExecutorReadyMsg(TypedDict):
    """Zygote → task, for a good ``hello``: the modules are imported; whether it can fork (if
    not, why); ``stale``: a file of a module it held changed on disk (it forks nothing more)."""

    t: Literal["ready"]
    safe: bool
    why: str
    stale: bool
    rejected: int  # connections it closed so far for breaking the protocol or its deadline


class ExecutorForkMsg(ForkMsg):
    """Task → zygote, with the rank's four pipes: fork rank ``rank`` of ``job``; with
    ``after_rank0``, once that job's rank 0 was forked here (or ``FIRST_WAIT_S`` later)."""

    job: str
    rank: int
    after_rank0: bool


TaskMsg = HelloMsg | ExecutorForkMsg
ExecutorZygoteMsg = ChallengeMsg | ExecutorReadyMsg | ForkedMsg | ExitMsg


class ExecutorConfig(TypedDict):
    """Task → the zygote it starts, as JSON on its stdin."""

    path: str  # the socket's name
    secret: str  # the application's (the driver.s ``launch.APP_SECRETS``)
    idle_s: float
    modules: list[str]  # to import at once
    nice: int  # the priority of those imports
    later: list[str]  # to import later, at ``LOW_NICE``: what the rank reported it imported
    watch: list[int]  # pids: the zygote goes when any of them ends
    lock_fd: int  # the lock file it holds for its whole life (inherited)
    t0: int  # time.time_ns() before it was started: a module file changed later is not trusted


def _packet(msg: TaskMsg | ExecutorZygoteMsg) -> bytes:
    return json.dumps(msg).encode()


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(
        os, "pidfd_open")


def socket_dir() -> str:
    """``<tmpdir>/nbdist-<uid>``, made 0700 if it is not there; refused if not ours
    (``tmpdirs.private_dir``)."""
    base = tempfile.gettempdir()
    if len(base) > 60:  # a socket's path must fit in 108 bytes (YARN's container tmp does not)
        base = "/tmp"
    return private_dir(f"nbdist-{os.getuid()}", base)


def mac(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), _CHALLENGE + nonce.encode(), hashlib.sha256).hexdigest()


def socket_path(directory: str, app: str, spec: RankSpec) -> str:
    """Where the zygote of this executor for a rank of ``spec`` listens."""
    return os.path.join(directory, f"{_executor_prefix()}{key(app, spec)}.sock")


def _executor_prefix() -> str:
    """``z-<pid>-``: the start of the file names of this executor's zygotes, ``<pid>`` its
    JVM's (the Python daemon's when no JVM is found above this worker)."""
    return f"z-{_ancestors_to_watch()[-1]}-"


def key(app: str, spec: RankSpec) -> str:
    """The hash naming the zygote a rank of ``spec`` may be forked from on this host."""
    from nbdist.rank.zygote import installation_stamp, process_attributes

    env = sorted((k, v) for k, v in {**environ(), **spec.env}.items()
                 if k not in spec.volatile)  # the rank gets the task's (``env_frame``)
    text = json.dumps([app, spec.python, spec.cwd or os.getcwd(), env,
                       list(installation_stamp()), repr(process_attributes())])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _peer_uid(sock: socket.socket) -> int:
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _ancestors_to_watch() -> list[int]:
    """This Python worker's parent (Spark's Python daemon, or the executor's JVM when workers
    are not forked by a daemon) and the JVM above it: the zygote goes when either does."""
    watch = [os.getppid()]
    pid = os.getppid()
    for _ in range(8):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            break
        if comm == "java":
            if pid not in watch:
                watch.append(pid)
            break
        pid = int(fields[1])
        if pid <= 1:
            break
    return watch


class _Refused(OSError):
    """The executor's zygote answered that it cannot fork (its ``why``)."""


class ExecutorZygote:
    """A task's handle on its executor's zygote: connect early, fork the rank, or leave one
    behind. Every failure means "start the rank fresh", never a failed task."""

    def __init__(self, app: str, secret: str, idle_s: float, spec: RankSpec) -> None:
        self.app, self.secret, self.idle_s, self.spec = app, secret, idle_s, spec
        self.sock: socket.socket | None = None
        self.ready_at: float | None = None  # time.time() when it had the job's modules
        self.forked_at: float | None = None
        self.why = ""  # why no rank was forked, in words (``Taken.why``: %dist_status shows it)
        self._connected = threading.Event()
        self._path = ""
        self._thread: threading.Thread | None = None
        self._rank: Forked | None = None
        self._modules: list[str] = []  # the job's (read from its code): imported at once
        self._later: list[str] = []  # what the rank reported it imported: imported later
        #: The pid of the process this task started to become the executor's zygote, if any.
        self.started: int | None = None
        self._intermediate: subprocess.Popen[bytes] | None = None  # that process
        self._wanted = False  # none was there: this task starts one once its rank imported
        self._starting = False
        self._started = threading.Event()
        self._reported = threading.Event()  # the rank said what it imported, or cannot
        self._handed: set[str] = set()  # modules handed over to the zygote (``report``)
        self._handing: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- connecting ------------------------------------------------------------------------------
    def connect(self, modules: list[str] | tuple[str, ...]) -> None:
        """Begin connecting in the background (while the rank says hello and meets the others)."""
        self._modules = sorted(set(modules))
        self._thread = threading.Thread(target=self._connect, name="nbdist-executor-zygote",
                                        daemon=True)
        self._thread.start()

    def _hello(self, modules: list[str], nice: int, timeout: float) -> socket.socket:
        """A connection to the executor's zygote that proved the secret and got ``modules``
        imported (``nice`` 0: before the answer; see ``HelloMsg``); raises ``_Refused`` if it
        cannot fork, an ``OSError`` or a ``ValueError`` if it cannot be reached."""
        self._path = socket_path(socket_dir(), self.app, self.spec)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout)
        try:
            sock.connect(self._path)
            if _peer_uid(sock) != os.getuid():
                raise PermissionError("the zygote's socket is another user's")
            # What the zygote sends is checked as it is read: a wrong shape raises one of
            # the errors the callers catch, and the rank starts fresh.
            challenge = cast(ChallengeMsg, json.loads(sock.recv(_PACKET)))
            sock.send(_packet({"t": "hello", "modules": modules, "nice": nice,
                               "mac": mac(self.secret, challenge["nonce"])}))
            ready = cast(ExecutorReadyMsg, json.loads(sock.recv(_PACKET) or b"{}"))
            if ready.get("t") != "ready" or not ready.get("safe"):
                raise _Refused(str(ready.get("why") or "it did not answer"))
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        return sock

    def _connect(self) -> None:
        try:
            self.sock, self.ready_at = self._hello(self._modules, 0, WAIT_S), time.time()
        except (FileNotFoundError, ConnectionRefusedError):  # none here (any more)
            # This task's rank starts fresh; the zygote for the next ones starts once the
            # rank has imported its modules (``on_mark``), so that it never competes with them.
            self.why = ("no zygote on this executor yet (this task leaves one behind for the "
                        "next runs)")
            self._wanted = True
        except _Refused as exc:
            self.why = f"the executor's zygote cannot fork: {exc}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.why = f"the executor's zygote could not be reached: {type(exc).__name__}: {exc}"
        finally:
            self._connected.set()

    # -- forking ---------------------------------------------------------------------------------
    def take(self, spec: RankSpec, rank0_here: bool = False) -> RankProcess | None:
        """The rank forked from the executor's zygote, or None (start it fresh). With
        ``rank0_here`` (rank 0 of the job runs on this host) a rank but 0 is forked after it,
        or ``FIRST_WAIT_S`` later."""
        if not self._connected.wait(WAIT_S):
            self.why = f"the executor's zygote did not answer within {WAIT_S:g} s"
        sock = self.sock
        if sock is None:
            return None
        ctl_in_r, ctl_in_w = os.pipe()
        ctl_out_r, ctl_out_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        theirs = [ctl_in_r, ctl_out_w, out_w, err_w]
        ours = [ctl_in_w, ctl_out_r, out_r, err_r]
        sync = new_sync_marker()
        pid = None
        try:
            request: ExecutorForkMsg = {
                "t": "fork", "sync": sync, "job": spec.job_id, "rank": spec.rank,
                "after_rank0": rank0_here and spec.rank != 0,
            }
            socket.send_fds(sock, [_packet(request)], theirs)
            sock.settimeout(WAIT_S)
            answer = cast(ForkedMsg, json.loads(sock.recv(_PACKET) or b"{}"))
            sock.settimeout(None)
            if answer.get("t") == "forked" and isinstance(answer.get("pid"), int):
                pid = answer["pid"]
        except (OSError, ValueError) as exc:
            self.why = f"the executor's zygote did not fork the rank: {type(exc).__name__}: {exc}"
        finally:
            for fd in theirs:
                os.close(fd)
        if pid is None:
            for fd in ours:
                os.close(fd)
            self._close()
            return None
        self.forked_at = time.time()
        proc = self._rank = Forked(pid)
        threading.Thread(target=self._watch, args=(sock, proc), daemon=True,
                         name="nbdist-executor-zygote-rank").start()
        proc.stdout, proc.stderr = open(out_r, "rb"), open(err_r, "rb")
        return RankProcess.attach(proc, ctl_in_w, ctl_out_r, sync)

    def _watch(self, sock: socket.socket, proc: Forked) -> None:
        """The rank's exit code, from the zygote; if the zygote is lost first, the rank is
        stopped (nobody else could tell how it ended)."""
        code = -signal.SIGKILL
        try:
            while data := sock.recv(_PACKET):
                msg = cast(ExitMsg, json.loads(data))
                if msg.get("t") == "exit" and msg.get("pid") == proc.pid:
                    code = int(msg["code"])
                    break
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        except (OSError, ValueError):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc._end(code)
        self._close()

    def _close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    # -- leaving one behind ----------------------------------------------------------------------
    def on_mark(self, name: str) -> None:
        """The supervisor's hook: once this task's fresh rank has done its work (the user's
        code returned, or the rank ended), start the zygote for the next tasks in the
        background, its imports at nice 19. Started any earlier, its start and
        ``import torch`` would compete with the rank's own (a function's imports are in its
        body) and its work for the CPU, and make the first run slower (measured)."""
        if name == EXIT:
            self._reported.set()  # a rank that ended says no more
        if name not in (END, EXIT) or not self._wanted:
            return
        with self._lock:
            if self._starting:
                return
            self._starting = True
        threading.Thread(target=self._start_wanted, args=(LOW_NICE,),
                         name="nbdist-executor-zygote-start", daemon=True).start()

    def _start_wanted(self, nice: int) -> None:
        self._reported.wait(REPORT_WAIT_S)  # comes right after the end of the rank's code
        with self._lock:
            later = list(self._later)
        self.started = self._start(self._modules, later, nice)
        self._started.set()

    def report(self, modules: list[str]) -> None:
        """The supervisor's hook: the modules the rank says it imported (``runtime``'s
        ``_imported_since``: lazily imported subpackages too), after its code, before it
        ends. A zygote this task starts imports them after the job's own
        (``ExecutorConfig.later``); its start waits for them (``REPORT_WAIT_S``). A rank forked
        from the zygote hands them over to it now, in the background, while the rank still
        runs: the zygote, which imports nothing while a rank of its runs, answers at once."""
        with self._lock:
            self._later = list(dict.fromkeys([*self._later, *modules]))
            new = [m for m in modules if m not in self._handed]
            self._handed.update(new)
            forked = self._rank is not None
        self._reported.set()
        if forked and new:
            thread = threading.Thread(target=self._hand_over, args=(new,), daemon=True,
                                      name="nbdist-executor-zygote-hand-over")
            self._handing = [t for t in self._handing if t.is_alive()] + [thread]
            thread.start()

    def _hand_over(self, modules: list[str]) -> None:
        """Give the zygote ``modules`` for the next runs (``HelloMsg`` with ``nice``), in one
        packet whatever the names (the first ones imported come first: ``_imported_since``)."""
        names = list(modules)
        while len(json.dumps(names)) > _PACKET // 2:
            names = names[:len(names) // 2]
        if names:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                self._hello(names, LOW_NICE, HANDOVER_S).close()

    def leave_behind(self, modules: list[str], settle: bool = False) -> int | None:
        """After the rank: when no zygote was started for the next tasks yet (the rank never
        got to its imports; or the zygote there would not fork, e.g. a module of it changed on
        disk and it went), start one now, to import ``modules`` (what the rank imported) after
        the job's own; see :meth:`_start`. Returns once the start (a fork and exec) is done; with
        ``settle``, once the zygote is on its own (the process that forks it has exited): a
        Ray actor is killed, with its children, as soon as it returns. A rank forked from
        the zygote hands it ``modules`` instead, for the next runs (``HelloMsg``): what the
        rank imported that the zygote had not (``torch._dynamo``, which DDP imports lazily,
        took every forked rank 1.4 s), as it reports them (``report``)."""
        self._connected.wait(WAIT_S)
        self._reported.set()
        with self._lock:
            starting, self._starting = self._starting, True
        if starting:
            self._started.wait(WAIT_S)
        elif self._rank is not None:
            for thread in self._handing:  # the hand-overs the reports started
                thread.join(HANDOVER_S)
            return None
        else:
            self.report(modules)
            self._start_wanted(LOW_NICE)
        if settle and self._intermediate is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._intermediate.wait(SETTLE_S)
        return self.started

    def _start(self, modules: list[str], later: list[str], nice: int) -> int | None:
        """Start the executor's zygote for the next tasks. The pid of the process started (it
        goes on as the zygote's parent-less grandchild), or None: one is there or starting,
        or this executor has ``MAX_PER_EXECUTOR`` already."""
        if not supported():
            return None
        try:
            directory = socket_dir()
            path = socket_path(directory, self.app, self.spec)
            lock_fd = os.open(path[:-5] + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a zygote of this key lives, or is starting
            os.close(lock_fd)
            return None
        if _live_zygotes(directory, lock_fd, _executor_prefix()) >= MAX_PER_EXECUTOR:
            os.close(lock_fd)
            return None
        spec = self.spec
        config: ExecutorConfig = {"path": path, "secret": self.secret, "idle_s": self.idle_s,
                  "modules": modules, "nice": nice, "later": later,
                  "watch": _ancestors_to_watch(), "lock_fd": lock_fd, "t0": time.time_ns()}
        try:
            proc = subprocess.Popen(
                [spec.python, "-c", COMMAND], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(lock_fd,),
                start_new_session=True, env={**environ(), **spec.env}, cwd=spec.cwd,
            )
        except OSError:
            return None
        finally:
            os.close(lock_fd)  # the zygote holds it from now on
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(json.dumps(config).encode())
            proc.stdin.close()
        # It forks the zygote and exits at once: reaped here, off the task's path.
        self._intermediate = proc
        threading.Thread(target=proc.wait, name="nbdist-executor-zygote-start",
                         daemon=True).start()
        return proc.pid


def _sweep(directory: str) -> None:
    """Remove what zygotes killed by SIGKILL left: a socket and a lock file nobody holds."""
    for name in os.listdir(directory):
        if not name.endswith(".lock"):
            continue
        lock = os.path.join(directory, name)
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live zygote's, or one starting
            os.close(fd)
            continue
        try:
            for path in (lock[:-5] + ".sock", lock):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        finally:
            os.close(fd)


def _live_zygotes(directory: str, mine: int, prefix: str) -> int:
    """How many zygotes of this uid and executor (file names from ``prefix``) live: their lock
    files are held."""
    count = 0
    mine_ino = os.fstat(mine).st_ino
    for name in os.listdir(directory):
        if not (name.startswith(prefix) and name.endswith(".lock")):
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino == mine_ino:
                continue
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            count += 1
        finally:
            os.close(fd)
    return count


# -- the zygote's side ----------------------------------------------------------------------------
class _Conn:
    """One connection to the zygote: its socket, the nonce of its challenge, whether it proved
    the secret, and when it was accepted (its hello is due ``AUTH_DEADLINE_S`` later)."""

    __slots__ = ("sock", "nonce", "authed", "accepted", "closed")

    def __init__(self, sock: socket.socket, nonce: str) -> None:
        self.sock, self.nonce, self.authed, self.closed = sock, nonce, False, False
        self.accepted = time.monotonic()


class _Server:
    """The zygote's loop: connections, forks, exits, and the reasons to go."""

    def __init__(self, config: ExecutorConfig) -> None:
        from nbdist.rank.host import become_subreaper, module_files

        self.path = str(config["path"])
        self.secret = str(config["secret"])
        self.idle_s = float(config["idle_s"])
        self.lock_fd = int(config["lock_fd"])
        self.files = module_files({}, int(config["t0"]))
        self.sel = selectors.PollSelector()
        self.conns: dict[int, _Conn] = {}  # by the socket's fd, in the order accepted
        #: Connections closed because they broke the protocol (whatever they sent: garbage, a
        #: wrong MAC, deep nesting...) or did not say hello within ``AUTH_DEADLINE_S``.
        self.rejected = 0
        self.ranks: dict[int, socket.socket] = {}  # pid: the connection that asked for it
        #: Jobs whose rank 0 was forked here (the latest few), and forks waiting for theirs.
        self.rank0: list[str] = []
        self.deferred: list[tuple[float, _Conn, list[int], ExecutorForkMsg]] = []
        self.retiring = False
        #: Modules a task handed over after its rank (``HelloMsg`` with ``nice``), imported at
        #: ``LOW_NICE`` once no rank forked here runs: an import blocks this loop, and with it
        #: the exit of a rank that is still running, which its job waits for.
        self.later: dict[str, None] = {}  # in the order the ranks imported them
        self.idle_since = time.monotonic()
        self.pidfds: list[int] = []
        for pid in config.get("watch", []):
            try:
                fd = os.pidfd_open(int(pid))
            except OSError:  # gone already: the executor is going
                self._exit()
            self.pidfds.append(fd)
            self.sel.register(fd, selectors.EVENT_READ, "gone")
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGTERM, lambda signum, frame: self._exit())
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        become_subreaper()
        # Bound under another name, then renamed: a task never connects to a half-made socket.
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        staging = f"{self.path}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        self.listener.bind(staging)
        self.listener.listen(64)
        os.rename(staging, self.path)
        self.inode = os.stat(self.path).st_ino
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        with contextlib.suppress(OSError):
            _sweep(os.path.dirname(self.path))
        self.safe, self.why = True, ""
        self._warm(list(config.get("modules", [])), int(config.get("nice") or 0))
        self.later.update((str(m), None) for m in config.get("later", []) if m not in sys.modules)

    def _warm(self, modules: list[str], nice: int = 0,
              until: Callable[[], bool] | None = None) -> tuple[bool, str, bool]:
        """Import what is new of ``modules``; (safe, why, stale). With ``until``, one module
        at a time, and once ``until()`` is true the rest goes back to ``later``."""
        from nbdist.rank.host import changed_file, module_files
        from nbdist.rank.zygote import fork_safety

        changed = changed_file(self.files)
        if changed is not None:
            self.retiring = True
            self._unlink()
            return False, f"{changed} changed on disk since the zygote imported it", True
        new = [m for m in modules if m not in sys.modules]
        if new:
            since = time.time_ns()
            if until is None:
                import_modules(new, nice, check=self._exit_if_gone)
            else:
                for i, name in enumerate(new):
                    if until():  # the rest first, next time
                        self.later = {**dict.fromkeys(new[i:]), **self.later}
                        break
                    if name not in sys.modules:  # or a package imported before brought it
                        import_modules([name], nice, check=self._exit_if_gone)
            self.files.update(module_files(self.files, since))
        self.safe, self.why = fork_safety()
        return self.safe, self.why, False

    def serve(self) -> None:
        self.idle_since = time.monotonic()  # idle from when its first imports are done
        while True:
            # What the ranks reported they imported, once none of them runs and no task is
            # connected; one module at a time, and a task that connects meanwhile is served
            # first (``_warm_later``).
            tasks = any(c.authed for c in self.conns.values())
            later = bool(self.later) and not (self.ranks or self.deferred or self.retiring
                                              or tasks)
            # Only a task that proved the secret, or a rank, is work: a stranger that connects
            # and says nothing keeps no idle zygote alive (it is cut at its hello's deadline).
            busy = later or bool(self.ranks) or tasks
            if busy:
                self.idle_since = time.monotonic()
            elif self.retiring or time.monotonic() - self.idle_since >= self.idle_s:
                self._exit()
            timeout = None if busy else max(0.0, self.idle_s
                                            - (time.monotonic() - self.idle_since)) + 0.01
            dues = [d for d, _, _, _ in self.deferred]
            dues += [c.accepted + AUTH_DEADLINE_S for c in self.conns.values() if not c.authed]
            if dues:
                due = max(0.0, min(dues) - time.monotonic()) + 0.001
                timeout = due if timeout is None else min(timeout, due)
            events = self.sel.select(0 if later else timeout)
            for sel_key, _ in events:
                what = sel_key.data
                if what == "gone":  # the executor (or its Python daemon) ended
                    self._exit()
                elif what == "wake":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self._reap()
                elif what == "accept":
                    self._accept()
                elif what in self.conns:
                    self._message(what)
            self._expire()
            self._run_deferred()
            if later and not events:
                self._warm_later()

    def _exit_if_gone(self) -> None:
        """Go now if the executor ended: called while an import at ``LOW_NICE`` runs, which
        on a loaded host can take minutes (the application's end must take its zygotes)."""
        watch = select.poll()
        for fd in self.pidfds:
            watch.register(fd, select.POLLIN)  # readable once its process ended
        if watch.poll(0):
            self._exit()

    def _warm_later(self) -> None:
        """Import ``later`` at ``LOW_NICE``, in the order the ranks imported them (the first
        ones bring most of the rest), until a task or a rank needs the loop: an import holds
        it, and with it the exit of a rank still running, which its job waits for, and a
        task's fork."""
        todo, self.later = list(self.later), {}
        self._warm(todo, LOW_NICE, until=lambda: bool(self.sel.select(0)))
        self.idle_since = time.monotonic()  # idle from the end of its imports

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        try:
            if self.retiring or _peer_uid(conn) != os.getuid():
                conn.close()
                return
            nonce = secrets.token_hex(16)
            # Never blocks: a peer that does not read could otherwise stall the zygote.
            conn.send(_packet({"t": "challenge", "nonce": nonce}), socket.MSG_DONTWAIT)
        except OSError:
            conn.close()
            return
        waiting = [fd for fd, c in self.conns.items() if not c.authed]
        if len(waiting) >= MAX_UNAUTHENTICATED:
            self._drop(waiting[0], rejected=True)  # the one that has waited longest
        self.conns[conn.fileno()] = _Conn(conn, nonce)
        self.sel.register(conn, selectors.EVENT_READ, conn.fileno())

    def _expire(self) -> None:
        """Close the connections that did not say hello within ``AUTH_DEADLINE_S``."""
        late = time.monotonic() - AUTH_DEADLINE_S
        for fd in [fd for fd, c in self.conns.items() if not c.authed and c.accepted <= late]:
            self._drop(fd, rejected=True)

    def _drop(self, fd: int, *, rejected: bool = False) -> None:
        conn = self.conns.pop(fd, None)
        if conn is None:
            return
        conn.closed = True
        if rejected:
            self.rejected += 1
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()

    def _message(self, fd: int) -> None:
        """Read and handle one packet; whatever goes wrong closes that connection (counted in
        ``rejected``), never the zygote: its ranks and the next tasks depend on it."""
        try:
            data, fds, _, _ = socket.recv_fds(self.conns[fd].sock, _PACKET, 4)
        except OSError:
            data, fds = b"", []
        try:
            if not self._handle(fd, data, fds):
                self._drop(fd, rejected=bool(data))  # an empty read: the peer closed
        except Exception:  # RecursionError from json, a field of the wrong type, ...
            self._drop(fd, rejected=True)
        finally:
            for extra in fds:  # those not handed over to a fork (which empties the list)
                with contextlib.suppress(OSError):
                    os.close(extra)

    def _handle(self, fd: int, data: bytes, fds: list[int]) -> bool:
        """Handle one packet from a connection; False: close it. The descriptors that came
        with it are taken out of ``fds`` when a fork takes them over."""
        conn = self.conns[fd]
        if not data:
            return False
        msg = json.loads(data)  # bytes: invalid UTF-8 is a ValueError like bad JSON
        if not isinstance(msg, dict):
            return False
        # A TaskMsg, checked field by field as it is read: the peer is only known to be of
        # this uid until its hello proves it knows the secret.
        if not conn.authed:
            if time.monotonic() - conn.accepted > AUTH_DEADLINE_S:
                return False  # past its deadline, whatever it says (the timer may be behind)
            hello = cast(HelloMsg, msg)
            given = hello.get("mac")
            if hello.get("t") != "hello" or not isinstance(given, str) or not given.isascii() \
                    or not hmac.compare_digest(given, mac(self.secret, conn.nonce)):
                return False
            modules, nice = hello.get("modules", []), hello.get("nice", 0)
            if not isinstance(modules, list) or type(nice) is not int:
                return False
            conn.authed = True
            modules = [m for m in modules if isinstance(m, str)]
            if nice > 0:  # for the next runs, once no rank of ours runs (``serve``)
                self.later.update((m, None) for m in modules if m not in sys.modules)
                safe, why, stale = self.safe, self.why, self.retiring
            else:
                safe, why, stale = self._warm(modules)
            self._answer(conn.sock, {"t": "ready", "safe": safe, "why": why, "stale": stale,
                                     "rejected": self.rejected})
        elif msg.get("t") == "fork":
            fork = cast(ExecutorForkMsg, msg)
            job = str(fork.get("job", ""))
            taken = fds[:]
            fds.clear()
            if fork.get("after_rank0") and job not in self.rank0 and len(taken) == 4:
                self.deferred.append((time.monotonic() + FIRST_WAIT_S, conn, taken, fork))
                return True
            self._fork_for(conn, taken, fork)
        return True

    def _fork_for(self, conn: _Conn, fds: list[int], msg: ExecutorForkMsg) -> None:
        """Fork the rank a connection asked for (with its four pipes) and answer it."""
        entry = None if conn.closed else conn
        pid = None
        try:
            if entry is not None and self.safe and not self.retiring and len(fds) == 4:
                pid = self._fork(entry.sock, fds, str(msg.get("sync", "")))
        finally:
            for extra in fds:
                os.close(extra)
        if entry is None:  # it went while its fork waited for rank 0's
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            return
        if pid is not None:
            self.ranks[pid] = entry.sock
            if msg.get("rank") == 0:
                self.rank0 = [*self.rank0[-31:], str(msg.get("job", ""))]
        self._answer(entry.sock, {"t": "forked", "pid": pid})

    def _run_deferred(self) -> None:
        """Forks whose rank 0 was forked meanwhile, or that waited ``FIRST_WAIT_S``."""
        now = time.monotonic()
        due = [d for d in self.deferred
               if d[0] <= now or str(d[3].get("job", "")) in self.rank0]
        for entry in due:  # the others stay listed: each fork's child closes their pipes
            self.deferred.remove(entry)
            try:
                self._fork_for(entry[1], entry[2], entry[3])
            except Exception:  # a failed fork (out of memory, of processes): that task's
                # rank starts fresh; the zygote serves on
                if not entry[1].closed:
                    self._drop(entry[1].sock.fileno())

    def _answer(self, conn: socket.socket, msg: ExecutorZygoteMsg) -> None:
        with contextlib.suppress(OSError):
            conn.send(_packet(msg))

    def _fork(self, conn: socket.socket, fds: list[int], sync: str) -> int:
        from nbdist.rank.zygote import become_rank

        pid = os.fork()
        if pid:
            return pid
        try:  # the rank keeps nothing of the zygote's: not its sockets, locks, pidfds, nor
            # the pipes of other ranks whose fork waits for their rank 0 (``deferred``)
            for _, _, waiting, _ in self.deferred:
                for fd in waiting:
                    os.close(fd)
            for other in self.conns.values():
                if other.sock is not conn:
                    other.sock.close()
            self.listener.close()
            for fd in (*self.pidfds, self.lock_fd):
                os.close(fd)
            self.sel.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            become_rank(fds, conn, (self.wake_r, self.wake_w), sync)
        except BaseException:
            import traceback

            traceback.print_exc()
        os._exit(70)

    def _reap(self) -> None:
        from nbdist.rank.host import reap_ranks

        for pid, code in reap_ranks(self.ranks):
            self._answer(self.ranks.pop(pid), {"t": "exit", "pid": pid, "code": code})

    def _unlink(self) -> None:
        """Remove the socket's name if it is still this zygote's (a newer one may have it)."""
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except (OSError, AttributeError):
            pass

    def _exit(self) -> None:
        """Go, and take the ranks along (they are stopped: whoever started them is gone or
        never will ask)."""
        self._unlink()
        for pid in getattr(self, "ranks", {}):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        lock = self.path[:-5] + ".lock"
        with contextlib.suppress(OSError):
            if os.stat(lock).st_ino == os.fstat(self.lock_fd).st_ino:
                os.unlink(lock)
        os._exit(0)


def main() -> None:
    config = cast(ExecutorConfig, json.loads(sys.stdin.buffer.read()))  # _start wrote it
    sys.stdin.close()
    # Not a child of the Spark worker that started it (which may be reused for years, or die
    # at once): the intermediate process exits and is reaped there.
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.close(devnull)
    import nbdist.rank.runtime  # noqa: F401  (what every rank runs, loaded once here)

    _Server(config).serve()


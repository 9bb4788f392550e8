"""The zygote: one interpreter that imports a job's modules once and forks the job's ranks.

``import torch`` costs about a second of CPU per interpreter. Fresh interpreters pay it for
every rank of every run, and interpreters warmed after a run are only ready a second or two
later: a run started right after the previous one gained nothing (measured 1.03×). A zygote
pays it once. The local backend starts one when a job is launched, asks it to import what the
payload imports (``payload_modules``) while the ranks meet, forks each rank from it in a few
milliseconds, and keeps it for the next run, which then starts at once.

What is forked is never the kernel, and never anything that ran the user's code: the zygote
is a fresh interpreter that only imports installed packages (not the user's own modules, which
may be edited before the next run). It forks only while that is safe (``fork_safety.py``): a
single Python thread and no CUDA driver started (a mapped ``libcuda.so`` alone is fine; a
driver started at import would leave the forked ranks unable to use CUDA). Otherwise it says
why, naming the thread or module, and the pool starts fresh interpreters instead. A
forked rank starts as a fresh one would: in a session of its own, with its own stdout, stderr
and control pipes (passed over the zygote's socket with SCM_RIGHTS), default signal handlers
and its own random state (``_fresh_random_state``).

The driver talks to the zygote over a ``SOCK_SEQPACKET`` socket pair, one JSON object per
packet (typed below: ``DriverMsg``, ``ZygoteMsg``). Driver → zygote: ``{"t": "warm",
"modules": [...]}``, answered by ``ready`` (which says
``stale`` when a file of a module it imported changed on disk since: it then forks nothing
more and the pool replaces it);
``{"t": "fork"}`` with four descriptors, answered by ``forked`` with the pid. Zygote → driver:
``{"t": "exit", "pid": P, "code": C}`` for each rank that ended (the zygote is their parent and
reaps them). End of file on the socket means the driver is gone: the zygote kills its ranks
with their process groups, and what they left behind, and exits (``_driver_gone``).

Linux only (fork, SCM_RIGHTS, /proc). The zygote side imports only the standard library and
nbdist's rank runtime.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Literal, NoReturn, TypedDict, cast

from nbdist.rank.fork_safety import fork_safety as fork_safety
from nbdist.rank.fork_safety import note_import, recording_thread_starts
from nbdist.rank.host import (
    ORPHANS_GRACE_S,
    become_subreaper,
    changed_file,
    end_orphans,
    environ,
    installation_dirs,
    is_installed,
    module_files,
    reap_ranks,
)
from nbdist.rank.supervisor import RankProcess, new_sync_marker

#: How the zygote is started; the ranks it forks show the same command line.
COMMAND = "from nbdist.rank.zygote import main; main()"
#: How long a fork may take before the rank is started fresh instead (it takes milliseconds).
FORK_TIMEOUT_S = 10.0
#: How often a zygote waiting for an import at low priority checks that its owner is there.
CHECK_S = 0.5
_PACKET = 1 << 16


# -- the messages on the socket: both ends are in this module --------------------------------------
class WarmMsg(TypedDict):
    """Driver → zygote: import what is new of ``modules`` (at ``nice`` > 0: at that priority),
    and check the files of what it holds."""

    t: Literal["warm"]
    modules: list[str]
    nice: int


class ForkMsg(TypedDict):
    """Driver → zygote, with the rank's four pipes (SCM_RIGHTS): fork a rank; ``sync`` is the
    marker it writes before its first output (``rank.new_sync_marker``)."""

    t: Literal["fork"]
    sync: str


class ReadyMsg(TypedDict):
    """Zygote → driver, for each ``warm``: what it imported; whether it can fork (if not, why);
    ``stale``: a file of a module it held changed on disk (it forks nothing more)."""

    t: Literal["ready"]
    modules: list[str]
    safe: bool
    why: str
    stale: bool


class ForkedMsg(TypedDict):
    """Zygote → driver, for each ``fork``: the rank's pid, or None when it did not fork."""

    t: Literal["forked"]
    pid: int | None


class ExitMsg(TypedDict):
    """Zygote → driver: a rank it forked ended with ``code`` (``os.waitstatus_to_exitcode``)."""

    t: Literal["exit"]
    pid: int
    code: int


DriverMsg = WarmMsg | ForkMsg
ZygoteMsg = ReadyMsg | ForkedMsg | ExitMsg


def _packet(msg: DriverMsg | ZygoteMsg) -> bytes:
    return json.dumps(msg).encode()


class Forked:
    """A rank forked by a zygote, as the supervisor sees it: the parts of ``Popen`` it uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Zygote:
    """The driver's handle on one zygote (one Python, working directory and environment)."""

    def __init__(self, python: str, env: dict[str, str], cwd: str | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # When it starts importing: a module file modified after this is not trusted.
        full = {**environ(), **env, "NBDIST_ZYGOTE_FD": str(theirs.fileno()),
                "NBDIST_ZYGOTE_T0": str(time.time_ns())}
        full.setdefault("PYTHONIOENCODING", "utf-8")
        try:
            # Its own output goes nowhere: the ranks it forks get pipes of their own.
            self.proc = subprocess.Popen(
                [python, "-c", COMMAND], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True,
                env=full, cwd=cwd,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        # One request at a time (answers come in order); fork_rank holds it over its answer.
        self._send_lock = threading.RLock()
        self._forks: queue.Queue[int | None] = queue.Queue()
        self._ranks: dict[int, Forked] = {}
        self._cond = threading.Condition()
        self._asked = self._answered = 0
        self._retiring = False
        self.alive = True
        #: Modules imported so far; whether forking is safe, and if not, why.
        self.modules: set[str] = set()
        self.safe = True
        self.why = ""
        #: A module it imported changed on disk since: it would fork stale code.
        self.stale = False
        threading.Thread(target=self._read, name="nbdist-zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    # -- requests ------------------------------------------------------------------------------
    def warm(self, modules: list[str] | tuple[str, ...], check: bool = False,
             nice: int = 0) -> None:
        """Import ``modules`` (those not imported yet) in the background; with ``check`` (at
        a launch), also when there is nothing new, for the zygote's check of its files. With
        ``nice`` > 0 the imports run at that lower priority (``%load_ext``'s warm-up: the
        kernel is never slowed by it); the ranks forked later are not affected."""
        new = sorted(set(modules) - self.modules)
        if not new and self._asked and not check:
            return
        with self._cond:
            self._asked += 1
        if not self._send({"t": "warm", "modules": new, "nice": nice}):
            with self._cond:
                self._asked -= 1

    def ready(self, timeout: float | None = None, abort: threading.Event | None = None) -> bool:
        """Wait until every import asked for is done (or ``abort`` is set); True if ranks can
        be forked now."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.alive and self._answered < self._asked:
                left = None if deadline is None else deadline - time.monotonic()
                if (abort is not None and abort.is_set()) or (left is not None and left <= 0):
                    break
                # A short wait, not one until notified: ``abort`` is set from other threads.
                self._cond.wait(0.1 if left is None else min(0.1, left))
            return self.alive and self._answered >= self._asked and self.safe

    def fork_rank(self) -> RankProcess | None:
        """A new rank forked from the zygote, or None if it cannot fork now."""
        if not self.ready(timeout=0):
            return None
        ctl_in_r, ctl_in_w = os.pipe()
        ctl_out_r, ctl_out_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        theirs = [ctl_in_r, ctl_out_w, out_w, err_w]
        sync = new_sync_marker()
        try:
            with self._send_lock:
                sent = self._send({"t": "fork", "sync": sync}, theirs)
                try:
                    pid = self._forks.get(timeout=FORK_TIMEOUT_S) if sent else None
                except queue.Empty:  # its answer could pair with the next request: retire it
                    pid = None
                    with self._cond:
                        self.safe, self.why = False, "a fork did not answer in time"
                    self.discard()
        finally:
            for fd in theirs:
                os.close(fd)
        with self._cond:
            proc = self._ranks.get(pid) if pid is not None else None
        if proc is None:
            for fd in (ctl_in_w, ctl_out_r, out_r, err_r):
                os.close(fd)
            return None
        proc.stdout, proc.stderr = open(out_r, "rb"), open(err_r, "rb")
        return RankProcess.attach(proc, ctl_in_w, ctl_out_r, sync)

    def why_not(self) -> str:
        """Why it cannot fork a rank now, in words a user can act on; "" when it can."""
        with self._cond:
            if not self.alive:
                return "the zygote exited"
            if self.stale:
                return (f"the zygote forks no more: {self.why}; the next job gets a new one")
            if not self.safe:
                return f"the zygote cannot fork: {self.why}"
            if self._answered < self._asked:
                return "the zygote was still importing the job's modules"
        return ""

    def discard(self) -> None:
        """Let the zygote go: now if no rank of it is running, else once the last one ended."""
        with self._cond:
            self._retiring = True
            running = any(p.returncode is None for p in self._ranks.values())
        if not running:
            self._kill()

    def running(self) -> int:
        with self._cond:
            return sum(p.returncode is None for p in self._ranks.values())

    # -- the connection ------------------------------------------------------------------------
    def _send(self, msg: DriverMsg, fds: list[int] | None = None) -> bool:
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [_packet(msg)], fds or [])
        except OSError:
            return False
        return True

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_PACKET)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data)
            except ValueError:  # not from our zygote's code: stop trusting it
                break
            # A ZygoteMsg: each field is checked as it is read (the zygote runs the same code,
            # but what it sends is only trusted as far as these checks go).
            kind = msg.get("t") if isinstance(msg, dict) else None
            if kind == "forked":
                forked = cast(ForkedMsg, msg)
                pid = forked.get("pid")
                if isinstance(pid, int):
                    with self._cond:
                        self._ranks[pid] = Forked(pid)
                self._forks.put(pid if isinstance(pid, int) else None)
            elif kind == "exit":
                ended = cast(ExitMsg, msg)
                self._exited(int(ended["pid"]), int(ended["code"]))
            elif kind == "ready":
                ready = cast(ReadyMsg, msg)
                with self._cond:
                    self.modules.update(ready.get("modules", ()))
                    self.safe, self.why = bool(ready.get("safe")), str(ready.get("why", ""))
                    self.stale = self.stale or bool(ready.get("stale"))
                    self._answered += 1
                    self._cond.notify_all()
        self._lost()

    def _exited(self, pid: int, code: int) -> None:
        with self._cond:
            proc = self._ranks.pop(pid, None)
            last = self._retiring and not any(
                p.returncode is None for p in self._ranks.values() if p is not proc)
        if proc is not None:
            proc._end(code)
        if last:
            self._kill()

    def _lost(self) -> None:
        """The zygote is gone: its ranks' exit codes would be lost with it, so they are stopped."""
        with self._cond:
            self.alive = False
            orphans = [p for p in self._ranks.values() if p.returncode is None]
            self._ranks.clear()
            self._cond.notify_all()
        self._forks.put(None)
        for proc in orphans:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc._end(-signal.SIGKILL)
        self._sock.close()
        self._kill()  # dead already, unless it spoke garbage

    def _kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait()


# -- the zygote's side ----------------------------------------------------------------------------
def main() -> None:
    sock = socket.socket(fileno=int(os.environ.pop("NBDIST_ZYGOTE_FD")))
    started = int(os.environ.pop("NBDIST_ZYGOTE_T0", "0")) or time.time_ns()
    import nbdist.rank.runtime  # noqa: F401  (what every rank runs, loaded once here)

    # The files of every module it holds, as they were when imported: checked at each request
    # to warm, that is at each launch, so that no rank is forked with code edited since.
    files = module_files({}, started)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select below
    # The guardian of its ranks (host.guard): what a rank that died at once leaves
    # running comes to the zygote, which kills it; only the ranks are its own children.
    become_subreaper()
    ranks: set[int] = set()
    safe, why = fork_safety()
    sel = selectors.PollSelector()  # not select.select: no limit on descriptor numbers
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        readable = [key.fd for key, _ in sel.select()]
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):  # the signals' bytes: only the wake-up matters
                    pass
            except BlockingIOError:
                pass
            _reap(sock, ranks)
        if sock.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _PACKET, 4)
        if not data:
            _driver_gone(ranks)
        msg = json.loads(data)  # a DriverMsg: the driver runs this module's code
        if msg.get("t") == "warm":
            warm = cast(WarmMsg, msg)
            changed = changed_file(files)
            if changed is None:
                since = time.time_ns()
                imported = import_modules(warm.get("modules", []), int(warm.get("nice") or 0),
                                          check=lambda: _driver_gone(ranks) if _eof(sock)
                                          else None)
                files.update(module_files(files, since))
                safe, why = fork_safety()
            else:  # no more imports nor forks: the pool replaces it
                imported = []
                safe, why = False, f"{changed} changed on disk since the zygote imported it"
            sock.send(_packet({"t": "ready", "modules": imported, "safe": safe, "why": why,
                               "stale": changed is not None}))
        elif msg.get("t") == "fork":
            fork = cast(ForkMsg, msg)
            ok = safe and len(fds) == 4
            pid = _fork(fds, sock, (wake_r, wake_w), str(fork.get("sync", ""))) if ok else None
            if pid is not None:
                ranks.add(pid)
            for fd in fds:
                os.close(fd)
            sock.send(_packet({"t": "forked", "pid": pid}))


def _eof(sock: socket.socket) -> bool:
    """True once the driver closed its end (the packets it sent before stay unread)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _driver_gone(ranks: set[int]) -> NoReturn:
    """The driver is gone (its kernel killed, say): kill the ranks with their process groups,
    then what they left behind, and exit.

    A rank whose control pipe closes with the driver stops itself, but only if its watch thread
    can run: a rank in C code that holds the GIL (a stuck extension, a ``PyDLL`` call) would
    live on, with whatever it started. Their results have nowhere to go. What a rank started in
    a session of its own comes to the zygote (a child subreaper) as the rank dies, and is
    killed with the rest of its children (``end_orphans``), as a guardian does."""
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # taken by sigtimedwait
    for pid in ranks:  # not reaped yet: none of these pids can be another process's
        try:
            os.killpg(pid, signal.SIGKILL)  # each rank leads a session of its own
        except (ProcessLookupError, PermissionError):
            pass
    end_orphans(within=ORPHANS_GRACE_S)
    os._exit(0)


def _reap(sock: socket.socket, ranks: set[int]) -> None:
    """Reap what ended; say which ranks did, once what they left behind is killed."""
    for pid, code in reap_ranks(ranks):
        ranks.discard(pid)
        sock.send(_packet({"t": "exit", "pid": pid, "code": code}))


def _installed(name: str, dirs: list[str]) -> bool:
    """True for a package of the installation (``host.is_installed``: site-packages, the
    standard library), not one of the user's (on the working directory or PYTHONPATH,
    symlinked into site-packages), which may be edited between runs."""
    top = name.partition(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin in ("built-in", "frozen"):
        return True
    paths = [p for p in (spec.origin, *(spec.submodule_search_locations or ())) if p]
    return bool(paths) and all(is_installed(p, dirs) for p in paths)


def import_modules(modules: list[str], nice: int = 0,
                   check: Callable[[], None] | None = None) -> list[str]:
    """Import the installed ones of ``modules``; those imported.

    With ``nice`` > 0, in a thread of its own at that nice value, joined before returning. On
    Linux the nice value is a thread's, and a fork inherits the forking thread's: the ranks,
    forked later by the main thread, keep the kernel's priority. (Lowering the nice value back
    would need CAP_SYS_NICE, so the main thread never raises its own.) The thread is gone
    before ``fork_safety`` counts threads. Meanwhile ``check`` is called every
    ``CHECK_S``: one import at nice 19 on a loaded host can take minutes, and a zygote whose
    owner ended (``check`` exits then) must not wait for it.
    """
    if nice <= 0:
        return _import(modules)
    done: list[str] = []

    def low() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except (AttributeError, OSError):  # not Linux, or not allowed: import anyway
            pass
        done.extend(_import(modules))

    worker = threading.Thread(target=low, name="nbdist-zygote-import")
    worker.start()
    while worker.is_alive():
        worker.join(CHECK_S)
        if check is not None:
            check()
    return done


def _import(modules: list[str]) -> list[str]:
    done = []
    dirs = installation_dirs()
    # Noting who starts a thread or the CUDA driver, for the message of ``fork_safety``.
    with recording_thread_starts():
        for name in modules:
            if not _installed(name, dirs):
                continue
            try:
                importlib.import_module(name)
            except BaseException:  # anything a module does at import must not end the zygote
                continue
            done.append(name)
            note_import(name)
    return done


def _fork(fds: list[int], sock: socket.socket, wake: tuple[int, int], sync: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        become_rank(fds, sock, wake, sync)
    except BaseException:
        traceback.print_exc()  # on the rank's stderr if it got that far: its supervisor shows it
    os._exit(70)  # EX_SOFTWARE: the rank runtime could not start (it leaves by os._exit)


def _fresh_random_state() -> None:
    """Reseed the global generators the zygote's imports created, from fresh OS entropy.

    Every fork would otherwise start from the zygote's state: the same ``torch.randperm`` on
    every rank of every run (correlated dropout, augmentation, sampling). A fresh interpreter
    seeds them from entropy at import; so does this, for those already imported (a module not
    imported yet seeds itself when the rank imports it). Python's ``random`` reseeds itself
    after a fork. torch's CUDA generators need nothing: CUDA is never initialised in a zygote
    (``fork_safety``), and torch seeds each device's generator from entropy when the rank
    first uses it, as in a fresh interpreter (``torch.seed()`` would instead queue the CPU
    seed for every device). The string hash seed is fixed when an interpreter starts and
    stays the zygote's: documented, not changeable after start.
    """
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()  # the legacy global RandomState; default_rng() draws fresh anyway
        except Exception:  # a broken or partial numpy must not stop the rank
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.default_generator.seed()
        except Exception:
            pass


def become_rank(fds: list[int], sock: socket.socket, wake: tuple[int, int], sync: str) -> None:
    """In the forked child: shed the zygote's state, take the rank's pipes, run the rank."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    for fd in wake:
        os.close(fd)
    os.setsid()
    ctl_in, ctl_out, out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.environ["NBDIST_CTL_IN"], os.environ["NBDIST_CTL_OUT"] = str(ctl_in), str(ctl_out)
    os.environ["NBDIST_SYNC"] = sync
    _fresh_random_state()
    from nbdist.rank.runtime import main as run_rank

    run_rank(guard=False)  # the zygote is its guardian


def installation_stamp() -> tuple[int, ...]:
    """When the installation last changed: ``%pip install`` touches site-packages, and what a
    zygote or warm interpreter imported before that is not what a fresh rank would import.
    (A file edited in place inside site-packages does not touch the directory: a zygote finds
    that itself, below.)"""
    stamps = []
    for entry in installation_dirs():
        try:
            stamps.append(os.stat(entry).st_mtime_ns)
        except OSError:
            pass
    return tuple(stamps)


def process_attributes() -> tuple[object, ...]:
    """What a process started now by this thread inherits besides its environment: umask,
    CPU affinity, nice value and resource limits.

    A zygote or warm interpreter started earlier has the kernel's attributes of then; when the
    kernel changed one since (``os.umask``, ``os.sched_setaffinity``, ``os.nice``,
    ``resource.setrlimit``), it is not used, and the rank starts as a fresh interpreter would.
    Affinity and nice are per thread on Linux: the supervisor threads inherit the cell's
    thread's at launch, as do the processes they start.
    """
    umask = None
    try:  # /proc reads it without setting it (os.umask would, for every thread at once)
        with open("/proc/self/status") as status:
            umask = next((line.split()[1] for line in status if line.startswith("Umask:")),
                         None)
    except OSError:
        pass
    affinity = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    try:
        nice: int | None = os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        nice = None
    limits: tuple[tuple[int, int], ...] = ()
    try:
        import resource

        limits = tuple(resource.getrlimit(getattr(resource, name)) for name in sorted(dir(
            resource)) if name.startswith("RLIMIT_"))
    except (ImportError, OSError, ValueError):
        pass
    return (umask, affinity, nice, limits)

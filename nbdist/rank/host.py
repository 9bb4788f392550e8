"""What the rank's host keeps of its installation and its processes, for the rank runtime,
the zygotes and the kernel alike.

- the installation: which directories hold this interpreter's installed packages
  (``installation_dirs``, ``is_installed``), and the files of loaded modules with the check that
  none changed on disk since (``module_files``, ``changed_file``): what decides that a warm
  interpreter or a zygote may serve, and which of the notebook's modules travel by value;
- the guardian: a child subreaper (``become_subreaper``) that ends every orphan a rank leaves
  behind (``end_orphans``), left behind by a fresh rank before it runs (``guard``).

Standard library only (psutil where it is installed): the kernel imports it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from collections.abc import Collection

_SITE_NAMES = ("site-packages", "dist-packages")


def environ() -> dict[str, str]:
    """This process's environment as a plain dict, also while another thread changes it.

    Copying ``os.environ`` iterates its keys and looks each one up: a key deleted meanwhile by
    another thread (MLflow's telemetry thread deletes one of its own) raised ``KeyError`` in
    the launch that was copying it, and the job was left half started. The copy is retried.
    """
    for _ in range(99):
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):  # changed under the copy: copy again
            continue
    return dict(os.environ)


def installation_dirs() -> list[str]:
    """Real paths of the directories this interpreter's packages are installed in: its standard
    library, its site directories, and any ``site-packages``/``dist-packages`` on sys.path."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = [paths.get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # the site module of an old virtualenv
        pass
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [e for e in sys.path if e and os.path.basename(os.path.normpath(e)) in _SITE_NAMES]
    return sorted({os.path.realpath(d) for d in dirs if d})


def is_installed(path: str, dirs: list[str]) -> bool:
    """Whether ``path``, symlinks followed, lies in one of ``dirs`` (``installation_dirs``).

    A real path with a separator boundary: a notebook folder named like the environment
    (``<venv>-notebooks``) or a development checkout symlinked into site-packages is the
    user's code, which may be edited, not part of the installation.
    """
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def module_files(known: dict[str, tuple[int, int]], since_ns: int) -> dict[str, tuple[int, int]]:
    """``(mtime_ns, size)`` of the files of loaded modules not in ``known``.

    A file modified after ``since_ns`` (when the imports that loaded it began) may have been
    read before or after the change: it is recorded as ``(-1, -1)``, which ``changed_file``
    reports as changed, so the doubt costs a restart, never stale code.
    """
    found = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not os.path.isabs(path) or path in known:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        found[path] = (st.st_mtime_ns, st.st_size) if st.st_mtime_ns < since_ns else (-1, -1)
    return found


def changed_file(files: dict[str, tuple[int, int]]) -> str | None:
    """The first of ``files`` (``module_files``) whose size or mtime is not as recorded."""
    for path, (mtime, size) in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return path
        if (st.st_mtime_ns, st.st_size) != (mtime, size):
            return path
    return None


def become_subreaper() -> bool:
    """Adopt orphaned descendants, so that even a double-forked daemon stays findable."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            return bool(libc.prctl(36, 1, 0, 0, 0) == 0)  # 36: PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass
    return False


def guard() -> None:
    """Fork; the parent stays behind as the rank's guardian, the child goes on as the rank.

    A rank kills what it started when it ends, and adopts what its children orphan while it
    runs (it is a child subreaper). But when it dies at once (``os._exit``, SIGKILL, a
    segfault), a process it started in a session of its own (``setsid``,
    ``start_new_session=True``) would be orphaned to init and live on, holding the rank's
    output pipes. Something that outlives the rank must adopt those and end them: the
    guardian, a child subreaper that waits for the rank, kills every process that comes to it
    once the rank is gone, and then ends as the rank ended (the same exit code, or the same
    signal), which is what its supervisor sees. Not the kernel (it would adopt every orphan of
    the notebook's own processes), and not Spark's Python worker (reused for later tasks): a
    process of the rank's own. A rank forked by a zygote has the zygote as its guardian.

    It also watches the process that started it, the rank's supervisor: a rank that outlives
    it (stuck in C code that holds the GIL, its own watch cannot run) is killed, and what it
    started with it (``_wait_unless_orphaned``).

    The guardian holds none of the rank's pipes (its stdout and stderr go to /dev/null), and
    ignores SIGINT, SIGTERM and SIGHUP so that a cancel reaches the rank and the guardian
    still cleans up after it; SIGKILL to the process group ends both.
    """
    if not become_subreaper():
        return  # not Linux: the rank kills what it can find when it ends, as before
    supervisor = _pidfd(os.getppid())  # before the fork: the process that started this one
    rank = os.fork()
    if rank == 0:
        if supervisor is not None:
            os.close(supervisor)
        return  # the rank (the subreaper attribute is not inherited: main() sets its own)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])  # taken by sigtimedwait
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for name in ("NBDIST_CTL_IN", "NBDIST_CTL_OUT"):
        try:
            os.close(int(os.environ[name]))
        except (KeyError, ValueError, OSError):
            pass
    _wait_unless_orphaned(rank, supervisor)
    code = os.waitstatus_to_exitcode(os.waitpid(rank, 0)[1])
    end_orphans(within=ORPHANS_GRACE_S)
    if code < 0:  # end by the same signal, without a core dump of the guardian's own
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(-code, signal.SIG_DFL)
        except (ImportError, OSError, ValueError):
            pass
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default is not to end the process
    os._exit(code)


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3 and later)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _wait_unless_orphaned(rank: int, supervisor: int | None) -> None:
    """Return when the rank ends, or kill it when its supervisor (this guardian's parent: the
    kernel, a Spark task's or a Ray actor's worker) ends first.

    A rank whose control pipe closes with its supervisor stops itself, but only if its watch
    thread can run: a rank in C code that holds the GIL (a stuck extension, a ``PyDLL`` call)
    would live on, with what it started; its result has nowhere to go. What it started then
    comes to the guardian, which kills it (``end_orphans``)."""
    own = _pidfd(rank)
    if supervisor is None or own is None:
        return  # no pidfd here: the rank's own watch is all there is
    poller = select.poll()
    poller.register(own, select.POLLIN)
    poller.register(supervisor, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if own in ready:
            return
        if supervisor in ready:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)
            return


#: How long a guardian waits for the orphans it killed to end (a process stuck in the kernel,
#: in D state, cannot be killed: the guardian then ends anyway rather than hold up the job).
ORPHANS_GRACE_S = 5.0


def end_orphans(keep: frozenset[int] = frozenset(), within: float | None = None) -> None:
    """Kill every child of this process but ``keep`` (a subreaper's orphans), and reap them.

    A killed orphan's own children come to this process as it dies, and are killed in the
    next round, until none is left or ``within`` seconds passed (SIGCHLD is blocked by then:
    see ``guard``). Without ``within`` (the zygote, whose ranks go on), one round: kill, and
    leave the reaping to the caller's next SIGCHLD.
    """
    deadline = time.monotonic() + (within or 0.0)
    while True:
        try:
            import psutil

            for child in psutil.Process().children():
                if child.pid not in keep:
                    try:
                        child.kill()
                    except psutil.Error:
                        pass
        except Exception:  # psutil missing or /proc unreadable: reaping still ends them
            pass
        if within is None:
            return
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # none left
        left = deadline - time.monotonic()
        if left <= 0:
            return
        signal.sigtimedwait([signal.SIGCHLD], left)  # pending already if one ended meanwhile


def reap_ranks(running: Collection[int]) -> list[tuple[int, int]]:
    """Reap every child that ended; the ranks of ``running`` among them, with their exit codes
    (``os.waitstatus_to_exitcode``), once what they left behind is killed.

    A zygote's loop, local or on an executor: a rank's orphans are adopted before its own end
    is signalled, so killing every child that is not a running rank (``end_orphans``) before
    the caller says the rank ended means its supervisor sees its output pipes close right
    after. Their own children come here as they die: the next SIGCHLD.
    """
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid in running:
            ended.append((pid, os.waitstatus_to_exitcode(status)))
    done = {pid for pid, _ in ended}
    end_orphans(keep=frozenset(p for p in running if p not in done))
    return ended

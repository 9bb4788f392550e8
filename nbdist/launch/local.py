"""The local backend: every rank is a fresh interpreter on the driver's machine.

The supervisors run as threads of the driver (the kernel); each starts its rank in a new
process group. If the kernel dies, even by SIGKILL, each rank sees its control pipe close and
kills its own group. When the kernel's event server cannot be reached (a firewall on loopback,
a broken socket layer), the supervisors share their hellos in memory instead (:class:`Hellos`)
and the ranks run without live output.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from nbdist import collectives, timeline
from nbdist._timer import after
from nbdist.errors import CapacityError
from nbdist.events import DriverAddress
from nbdist.launch import Capacity, gpus_text, no_gpu_hint
from nbdist.protocol import (
    DriverEvent,
    Frame,
    HelloEvent,
    LaunchRequest,
    RankOutcome,
    RankStatus,
)
from nbdist.rank import host
from nbdist.rank.supervisor import RankProcess, RankSpec, Supervisor, Taken
from nbdist.rank.zygote import Zygote, installation_stamp, process_attributes
from nbdist.settings import settings

#: Keep interpreters warm for the next job (``NBDIST_WARM_POOL=0`` turns it off).
WARM_POOL = os.environ.get("NBDIST_WARM_POOL", "1") != "0"
#: Idle warm interpreters are let go after this many seconds (``NBDIST_WARM_IDLE_S``).
WARM_IDLE_S = float(os.environ.get("NBDIST_WARM_IDLE_S", "600"))
#: At most this many warm interpreters (each holds its imports in memory: torch ≈ 300 MB).
WARM_MAX = 16
#: Fork ranks from a zygote that imported their modules once (``NBDIST_ZYGOTE=0``: fresh
#: interpreters for every rank, warmed after each job). Linux only: fork, SCM_RIGHTS, /proc.
ZYGOTE = os.environ.get("NBDIST_ZYGOTE", "1") != "0" and sys.platform.startswith("linux")
#: Zygotes kept at once, one per environment (each holds its imports: torch ≈ 300 MB).
ZYGOTES_MAX = 2
#: What a zygote started at ``%load_ext nbdist`` imports ahead of the first cell (those installed;
#: ``NBDIST_WARM_AT_LOAD=0`` or ``%config DistMagics.warm_at_load = False`` turns it off).
PRELOAD = ("torch", "numpy")
#: The nice value of those imports: the kernel, and anything else the user runs, go first.
PRELOAD_NICE = 19
#: What every rank imports besides its payload's modules (``rank/runtime.py``: cloudpickle for
#: the payload, threadpoolctl to size the BLAS pools a fork inherits). A zygote imports them
#: with its first job's modules: learnt from that job's ranks instead, they were imported after
#: it, and a job started right then waited for them (0.5 s on the busy 2-core machine).
RANK_MODULES = ("cloudpickle", "threadpoolctl")
#: The longest a rank waits for its zygote's imports before it starts as a fresh interpreter.
ZYGOTE_WAIT_S = 120.0
#: The longest the other ranks wait for rank 0 to be forked first (it takes milliseconds).
FIRST_WAIT_S = 1.0


def visible_gpus() -> list[str]:
    """GPU indices the driver may use: CUDA_VISIBLE_DEVICES, else what nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip() and g.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _user_paths() -> str:
    """The kernel's sys.path entries a fresh interpreter would not have (added by the user)."""
    dirs = host.installation_dirs()
    keep = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry) or host.is_installed(entry, dirs):
            continue
        keep.append(os.path.abspath(entry))
    old = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*keep, *([old] if old else [])])


def job_template(env: dict[str, str]) -> RankSpec:
    """What every local rank of a job started now with ``env`` (``--env``) has in common:
    the kernel's Python and working directory, its user paths; the pool's key is taken from
    it."""
    full = {"PYTHONPATH": _user_paths(), **env}
    if not full["PYTHONPATH"]:
        del full["PYTHONPATH"]
    return RankSpec(rank=0, world_size=1, job_id="", secret="", driver=("127.0.0.1", 0),
                    payload=b"", host="127.0.0.1", cwd=os.getcwd(), env=full)


def warm_at_load() -> threading.Thread | None:
    """``%load_ext nbdist``: when torch is installed, start the first job's zygote in the
    background (``WarmPool.preload``); the thread doing it, or None when nothing is started
    (``NBDIST_WARM_AT_LOAD=0``, no zygote here, torch not installed)."""
    if os.environ.get("NBDIST_WARM_AT_LOAD", "1").strip() == "0" or not (WARM_POOL and ZYGOTE):
        return None
    try:
        if importlib.util.find_spec("torch") is None:
            return None
    except (ImportError, ValueError):
        return None
    # The key of the job it is for holds this thread's process attributes: a new thread
    # inherits the loading thread's (affinity and nice are per thread on Linux).
    thread = threading.Thread(target=pool.preload, args=(PRELOAD,), name="nbdist-preload",
                              daemon=True)
    pool.preloading = thread
    thread.start()
    return thread


class WarmPool:
    """Where the next job's ranks come from warm: a zygote per environment, else interpreters
    started ahead with the last job's modules imported.

    ``import torch`` alone takes about a second. On Linux a job's ranks are forked from a
    zygote (``zygote.py``) that imports the payload's modules once, while the ranks meet, and
    stays for the next job, which then starts at once, even right after the last one. Where a
    zygote cannot fork safely (a module started a thread or the CUDA driver at import; the
    job's ranks say so), or off Linux, fresh interpreters are warmed after each job instead,
    ready a second or two later.
    Either is only used by a job with the same Python, working directory, environment and
    process attributes (umask, CPU affinity, nice, resource limits) it was started with; the
    rank's own variables (RANK, MASTER_PORT, ...) reach it as a frame before the payload.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zygotes: dict[tuple[object, ...], Zygote] = {}
        self._idle: list[tuple[tuple[object, ...], RankProcess]] = []
        self._timer: threading.Timer | None = None
        self._filler: threading.Thread | None = None
        self._generation = 0  # bumped by clear(): a fill in flight then throws its work away
        self._last: set[str] = set()  # what the last job's ranks imported
        self._start_error = ""  # why the last zygote could not start, if it could not
        #: The thread starting ``%load_ext``'s zygote (``warm_at_load``), if any.
        self.preloading: threading.Thread | None = None

    @staticmethod
    def key(spec: RankSpec) -> tuple[object, ...]:
        return (spec.python, spec.cwd, tuple(sorted({**host.environ(), **spec.env}.items())),
                installation_stamp(), process_attributes())

    @property
    def modules(self) -> list[str]:
        """Top-level modules a warm rank starts with."""
        with self._lock:
            names = self._last.union(*(z.modules for z in self._zygotes.values()))
        return sorted({name.partition(".")[0] for name in names})

    def _zygote(self, spec: RankSpec) -> Zygote | None:
        with self._lock:
            zygote = self._zygotes.get(self.key(spec))
        return zygote if zygote is not None and zygote.alive else None

    def prepare(self, template: RankSpec, modules: tuple[str, ...], nice: int = 0,
                idle: bool = False) -> None:
        """At launch: the zygote of the job's environment starts importing ``modules``.

        With ``idle`` (no job is starting: ``%load_ext``'s warm-up) its idle countdown starts
        at once, and ``nice`` lowers the priority of its imports."""
        if not (WARM_POOL and ZYGOTE):
            return
        key = self.key(template)
        evicted: list[Zygote] = []
        with self._lock:
            zygote = self._zygotes.pop(key, None)  # re-added last: the most recently used
            if zygote is not None and (not zygote.alive or zygote.stale):
                evicted.append(zygote)  # a module it imported was edited: a new one
                zygote = None
            if zygote is None:
                while len(self._zygotes) >= ZYGOTES_MAX:  # the least recently used goes
                    evicted.append(self._zygotes.pop(next(iter(self._zygotes))))
                try:
                    zygote = Zygote(template.python, template.env, template.cwd)
                    self._start_error = ""
                except OSError as exc:
                    zygote = None  # the ranks start as fresh interpreters
                    self._start_error = f"{type(exc).__name__}: {exc}"
            if zygote is not None:
                self._zygotes[key] = zygote
            # Not idle while a job uses it: the countdown starts again when a job ends
            # (fill, rest), so a job longer than the idle limit keeps its zygote.
            if idle:
                self._arm_timer()
            elif self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for old in evicted:
            old.discard()
        if zygote is not None:
            zygote.warm(sorted({*modules, *self._last, *RANK_MODULES}), check=True, nice=nice)

    def preload(self, modules: tuple[str, ...]) -> bool:
        """``%load_ext nbdist``: start the zygote the first local job will use and let it
        import ``modules`` (the installed ones) at low priority; True if one was started.

        Its key is the one a job started now with default options gets (``template``): a
        job with another environment, working directory or process attributes starts its own,
        as always. Idle from the start, so it goes after ``WARM_IDLE_S`` like any other.
        """
        if not (WARM_POOL and ZYGOTE):
            return False
        # The environment a job with default options gives its ranks: torch's flight
        # recorder is on in every rank (job.py), and a zygote is kept per environment.
        template = job_template(collectives.recorder_env(settings.flight_recorder))
        with self._lock:
            if self.key(template) in self._zygotes:  # a job got there first
                return False
        self.prepare(template, modules, nice=PRELOAD_NICE, idle=True)
        return self._zygote(template) is not None

    def ready(self, spec: RankSpec, abort: threading.Event) -> bool:
        """Wait until the zygote of ``spec``'s environment has imported what it was asked
        (or ``abort`` is set): the ranks are forked with their modules loaded. False when
        there is no zygote to wait for."""
        zygote = self._zygote(spec)
        if zygote is not None:
            zygote.ready(timeout=ZYGOTE_WAIT_S, abort=abort)
        return zygote is not None

    def take(self, spec: RankSpec) -> Taken:
        """A rank's interpreter: forked from the zygote of ``spec``'s environment, else a warm
        one, else none (it starts fresh); with why it was not forked, in words."""
        zygote = self._zygote(spec)
        if zygote is not None:
            forked = zygote.fork_rank()
            if forked is not None:
                return Taken(forked, "forked")
        why = self._why_not(spec, zygote)
        key = self.key(spec)
        with self._lock:
            for i, (k, rp) in enumerate(self._idle):
                if k == key and rp.alive():
                    del self._idle[i]
                    return Taken(rp, "warm", why)
        return Taken(None, "fresh", why)

    def _why_not(self, spec: RankSpec, zygote: Zygote | None) -> str:
        """Why a rank of ``spec`` was not forked from a zygote (``zygote``: the live one)."""
        if not WARM_POOL:
            return "warm ranks are off (NBDIST_WARM_POOL=0)"
        if not ZYGOTE:
            return "zygotes are off (NBDIST_ZYGOTE=0)"
        if zygote is not None:
            return zygote.why_not() or "the zygote did not fork the rank"
        with self._lock:
            gone = self._zygotes.get(self.key(spec))
            error = self._start_error
        if gone is not None:
            return gone.why_not() or "the zygote exited"
        if error:
            return f"the zygote could not start: {error}"
        return ("no zygote for this job's environment (it changed since the job was "
                "launched, or the zygote was let go)")

    def fill(self, template: RankSpec, n: int, modules: list[str]) -> None:
        """After a job: what its ranks imported is made warm for the next one.

        The zygote imports it too; without a zygote that can fork, ``n`` fresh interpreters
        are started in the background (replacing the idle ones)."""
        if not WARM_POOL or n <= 0:
            return
        self._last = set(modules)
        zygote = self._zygote(template)
        if zygote is not None and zygote.stale:  # replaced now, ready for the next job
            self.prepare(template, tuple(modules))
            with self._lock:
                self._arm_timer()
            return
        if zygote is not None and zygote.safe:
            zygote.warm(modules)
            with self._lock:
                self._arm_timer()
            return
        self._clear_idle()
        with self._lock:
            self._filler = threading.Thread(
                target=self._start,
                args=(template, min(n, WARM_MAX), sorted(self._last), self._generation),
                name="nbdist-warm", daemon=True,
            )
            self._filler.start()

    def _start(self, template: RankSpec, n: int, modules: list[str], generation: int) -> None:
        key = self.key(template)
        body = json.dumps(modules).encode()
        for _ in range(n):
            try:
                rp = RankProcess(template.python, template.env, template.cwd)
            except OSError:
                return
            rp.send(Frame.WARM, body)
            with self._lock:
                stale = generation != self._generation
                if not stale:
                    self._idle.append((key, rp))
            if stale:
                rp.discard()
                return
        with self._lock:
            self._arm_timer()

    def rest(self) -> None:
        """A job ended without warming anything (cancelled, a session): start the idle
        countdown."""
        with self._lock:
            self._arm_timer()

    def _arm_timer(self) -> None:
        """(Re)start the idle countdown; called with the lock held."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = after(WARM_IDLE_S, self.clear)

    def clear(self) -> None:
        """Let every zygote and idle interpreter go (and wait until each is gone; a zygote
        whose ranks still run goes when the last of them ends)."""
        preloading, self.preloading = self.preloading, None
        if preloading is not None and preloading is not threading.current_thread():
            preloading.join()  # it only starts a process: it is not left to start one after
        with self._lock:
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            if timer is not threading.current_thread():
                timer.join()
        for zygote in zygotes:
            zygote.discard()
        self._clear_idle()

    def _clear_idle(self) -> None:
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
            filler, self._filler = self._filler, None
        if filler is not None and filler is not threading.current_thread():
            filler.join()
        for _, rp in idle:
            rp.discard()

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the zygotes and the interpreters being warmed have
        their imports."""
        deadline = time.monotonic() + timeout
        if self.preloading is not None:
            self.preloading.join(timeout)
        with self._lock:
            filler = self._filler
            zygotes = list(self._zygotes.values())
        ok = all(z.ready(timeout=max(0.0, deadline - time.monotonic())) or not z.alive
                 for z in zygotes)
        if filler is not None:
            filler.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            idle = [rp for _, rp in self._idle]
        return ok and all(rp.warm.wait(max(0.0, deadline - time.monotonic())) for rp in idle)

    def pids(self) -> list[int]:
        """Process ids of the zygotes and of the idle warm interpreters."""
        with self._lock:
            return [z.pid for z in self._zygotes.values() if z.alive] + [
                rp.pid for _, rp in self._idle if rp.alive()]


class Hellos:
    """One job's hellos, shared in memory by its supervisors: the rendezvous without a channel.

    Every supervisor that cannot reach the event server calls :meth:`gather` and waits until
    all ``np`` have; :meth:`cancel` ends the wait. A supervisor that did reach the server never
    calls it, so a job whose ranks disagree on the channel ends at the rendezvous timeout.
    """

    def __init__(self, np: int, timeout: float) -> None:
        self._np = np
        self._timeout = timeout
        self._hellos: dict[int, HelloEvent] = {}
        self._cancelled = False
        self._cond = threading.Condition()

    def gather(self, hello: HelloEvent) -> list[HelloEvent]:
        with self._cond:
            self._hellos[int(hello["rank"])] = hello
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._cancelled or len(self._hellos) == self._np,
                                self._timeout)
            if len(self._hellos) < self._np:
                missing = sorted(set(range(self._np)) - set(self._hellos))
                raise TimeoutError(f"ranks {missing} did not join the rendezvous")
            return [self._hellos[r] for r in range(self._np)]

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()


#: The kernel's pool of warm interpreters, filled after each local job.
pool = WarmPool()


def shutdown() -> None:
    """``%unload_ext nbdist`` (``backends.shutdown``): the warm pool lets its zygotes and
    interpreters go."""
    pool.clear()


atexit.register(pool.clear)


class LocalLauncher:
    """Ranks as local processes; see the module docstring."""

    name = "local"
    remote = False  # the supervisors are threads of the kernel: no keepalive needed

    def __init__(self) -> None:
        self._supervisors: list[Supervisor] = []
        self._lock = threading.Lock()
        self._cancelled = False
        self._finished = 0
        self._np = 0
        self._warm_after = True
        self._hellos: Hellos | None = None
        self._stop = threading.Event()  # set by cancel(): ranks still waiting to start give up
        self._first = threading.Event()  # rank 0 has its process (or never will)
        self._on_outcome: Callable[[RankOutcome], None] = lambda outcome: None

    def driver_address(self) -> DriverAddress:
        return DriverAddress("127.0.0.1", "127.0.0.1", 0, "the local backend (loopback)")

    def capacity(self) -> Capacity:
        cpus = os.cpu_count() or 1
        gpus = len(visible_gpus())
        detail = f"this machine: {cpus} CPU cores, {gpus_text(gpus)}"
        return Capacity(slots=max(cpus, gpus), gpus=gpus, detail=detail)

    def check(self, np: int, gpu: bool) -> None:
        if not gpu:
            return  # CPU ranks may share cores; nothing to refuse
        gpus = visible_gpus()
        if np > len(gpus):
            has = f"{gpus_text(len(gpus))} ({', '.join(gpus)})" if gpus else (
                "no GPU (CUDA_VISIBLE_DEVICES and nvidia-smi name none)")
            fewer = f"-np {len(gpus)} for one rank per GPU, or " if gpus else ""
            raise CapacityError(
                f"asked for {np} ranks with one GPU each, but this machine has {has}: use "
                f"{fewer}{no_gpu_hint(np)}"
            )

    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        self._on_outcome = on_outcome
        self._np = request.np
        # A session's end releases its ranks: nothing is warmed in their place.
        self._warm_after = not request.session
        gpus = visible_gpus() if request.gpu else []
        template = job_template(request.env)
        hellos = self._hellos = Hellos(request.np, RankSpec.rendezvous_timeout)
        specs = [
            RankSpec.for_rank(request, rank, env=template.env, host=template.host,
                              cwd=template.cwd, gpus=(gpus[rank],) if gpus else ())
            for rank in range(request.np)
        ]
        # The zygote imports while the ranks meet; each rank waits for it before its
        # supervisor starts (outside the supervisor, so a cancel is never held up by it).
        pool.prepare(specs[0], request.modules)
        for spec in specs:
            sup = Supervisor(spec, take=self._take, gather=hellos.gather)
            with self._lock:
                self._supervisors.append(sup)
                if self._cancelled:
                    sup.cancel()
            threading.Thread(
                target=_run, args=(sup, self._done, self._stop),
                name=f"nbdist-rank-{spec.rank}", daemon=True,
            ).start()

    def _take(self, spec: RankSpec) -> Taken:
        """A warm rank from the pool, rank 0 first.

        torch's TCPStore client, in every rank but 0, backs off about half a second when it
        finds rank 0's server not listening yet; forks one after another would often start
        rank 1 first. Rank 0 starts first, the others within ``FIRST_WAIT_S`` after.
        """
        if spec.rank != 0:
            self._first.wait(FIRST_WAIT_S)
        try:
            return pool.take(spec)
        finally:
            if spec.rank == 0:
                self._first.set()

    def _done(self, outcome: RankOutcome) -> None:
        """Pass the outcome on; after the last rank, warm interpreters for the next job."""
        with self._lock:
            self._finished += 1
            last = self._finished == len(self._supervisors) == self._np
            sups = list(self._supervisors)
        if last and not self._cancelled and self._warm_after:
            modules = sorted({m for sup in sups for m in sup.modules})
            pool.fill(sups[0].spec, len(sups), modules)
        elif last:
            pool.rest()
        self._on_outcome(outcome)

    def deliver(self, rank: int, event: DriverEvent) -> bool:
        """The supervisors are threads of the kernel: a message goes to one as a call.

        A session's cell then reaches every rank's pipe from the notebook's thread in a
        fraction of a millisecond, where over the event channel it woke each supervisor's
        reader thread, one after another, all of them contending for the kernel's GIL with
        the thread still sending (half of a 16-rank cell's 20 ms; docs/performance.md).
        """
        with self._lock:
            # The newest of the rank's (a launcher that started again holds the old ones too).
            sup = next((s for s in reversed(self._supervisors) if s.spec.rank == rank), None)
        return sup is not None and sup.deliver(event)

    def cancel(self) -> None:
        self._stop.set()
        self._first.set()
        with self._lock:
            self._cancelled = True
            sups = list(self._supervisors)
            hellos = self._hellos
        for sup in sups:
            sup.cancel()
        if hellos is not None:
            hellos.cancel()


def _run(sup: Supervisor, on_outcome: Callable[[RankOutcome], None],
         stop: threading.Event) -> None:
    try:
        sup.mark(timeline.SCHEDULED)
        if pool.ready(sup.spec, abort=stop):
            sup.mark(timeline.PRELOADED)
        outcome = sup.run()
    except BaseException as exc:  # a bug in nbdist must still end the job, not hang it
        outcome = RankOutcome(sup.spec.rank, RankStatus.FAILED, error={
            "type": type(exc).__name__, "traceback": "",
            "message": f"nbdist's supervisor of rank {sup.spec.rank} failed: {exc!r}",
        })
    on_outcome(outcome)

"""The local backend: every rank is a fresh interpreter on the driver's machine.

The supervisors run as threads of the driver (the kernel); each starts its rank in a new
process group. If the kernel dies, even by SIGKILL, each rank sees its control pipe close and
kills its own group. When the kernel's event server cannot be reached (a firewall on loopback,
a broken socket layer), the supervisors share their hellos in memory instead (:class:`Hellos`)
and the ranks run without live output.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nbdist import runtime
from nbdist.errors import CapacityError
from nbdist.launch import Capacity, LaunchRequest
from nbdist.rank import RankOutcome, RankProcess, RankSpec, Supervisor

#: Keep interpreters warm for the next job (``NBDIST_WARM_POOL=0`` turns it off).
WARM_POOL = os.environ.get("NBDIST_WARM_POOL", "1") != "0"
#: Idle warm interpreters are let go after this many seconds (``NBDIST_WARM_IDLE_S``).
WARM_IDLE_S = float(os.environ.get("NBDIST_WARM_IDLE_S", "600"))
#: At most this many warm interpreters (each holds its imports in memory: torch ≈ 300 MB).
WARM_MAX = 16


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
    prefixes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    keep = []
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        if entry.startswith(prefixes) or "site-packages" in entry or "dist-packages" in entry:
            continue
        keep.append(os.path.abspath(entry))
    old = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*keep, *([old] if old else [])])


class WarmPool:
    """Interpreters started ahead of the next job, with the last job's modules imported.

    ``import torch`` alone takes about a second; a warm interpreter has done it while the user
    was reading the last result. An interpreter is only reused by a job with the same Python,
    working directory and environment it was started with; the rank's own variables (RANK,
    MASTER_PORT, ...) reach it as a frame before the payload.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[tuple[tuple[object, ...], RankProcess]] = []
        self._timer: threading.Timer | None = None
        self._filler: threading.Thread | None = None
        self._generation = 0  # bumped by clear(): a fill in flight then throws its work away
        self.modules: list[str] = []

    @staticmethod
    def key(spec: RankSpec) -> tuple[object, ...]:
        return (spec.python, spec.cwd, tuple(sorted({**os.environ, **spec.env}.items())))

    def take(self, spec: RankSpec) -> RankProcess | None:
        key = self.key(spec)
        with self._lock:
            for i, (k, rp) in enumerate(self._idle):
                if k == key and rp.alive():
                    del self._idle[i]
                    return rp
        return None

    def fill(self, template: RankSpec, n: int, modules: list[str]) -> None:
        """Start ``n`` warm interpreters in the background (replacing the idle ones)."""
        if not WARM_POOL or n <= 0:
            return
        self.clear()
        self.modules = sorted(set(modules))
        with self._lock:
            self._filler = threading.Thread(
                target=self._start,
                args=(template, min(n, WARM_MAX), self.modules, self._generation),
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
            rp.send(runtime.WARM, body)
            with self._lock:
                stale = generation != self._generation
                if not stale:
                    self._idle.append((key, rp))
            if stale:
                rp.discard()
                return
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(WARM_IDLE_S, self.clear)
            self._timer.daemon = True
            self._timer.start()

    def clear(self) -> None:
        """Let every idle interpreter go (and wait until each is gone)."""
        with self._lock:
            self._generation += 1
            idle, self._idle = self._idle, []
            filler, self._filler = self._filler, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if filler is not None and filler is not threading.current_thread():
            filler.join()
        for _, rp in idle:
            rp.discard()

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the interpreters being warmed have their imports."""
        deadline = time.monotonic() + timeout
        with self._lock:
            filler = self._filler
        if filler is not None:
            filler.join(timeout)
        with self._lock:
            idle = [rp for _, rp in self._idle]
        return all(rp.warm.wait(max(0.0, deadline - time.monotonic())) for rp in idle)

    def pids(self) -> list[int]:
        """Process ids of the idle warm interpreters."""
        with self._lock:
            return [rp.pid for _, rp in self._idle if rp.alive()]


class Hellos:
    """One job's hellos, shared in memory by its supervisors: the rendezvous without a channel.

    Every supervisor that cannot reach the event server calls :meth:`gather` and waits until
    all ``np`` have; :meth:`cancel` ends the wait. A supervisor that did reach the server never
    calls it, so a job whose ranks disagree on the channel ends at the rendezvous timeout.
    """

    def __init__(self, np: int, timeout: float) -> None:
        self._np = np
        self._timeout = timeout
        self._hellos: dict[int, dict[str, Any]] = {}
        self._cancelled = False
        self._cond = threading.Condition()

    def gather(self, hello: dict[str, Any]) -> list[dict[str, Any]]:
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
atexit.register(pool.clear)


class LocalLauncher:
    """Ranks as local processes; see the module docstring."""

    name = "local"

    def __init__(self) -> None:
        self._supervisors: list[Supervisor] = []
        self._lock = threading.Lock()
        self._cancelled = False
        self._finished = 0
        self._np = 0
        self._hellos: Hellos | None = None
        self._on_outcome: Callable[[RankOutcome], None] = lambda outcome: None

    def driver_host(self) -> str:
        return "127.0.0.1"

    def capacity(self) -> Capacity:
        cpus = os.cpu_count() or 1
        gpus = len(visible_gpus())
        detail = f"this machine: {cpus} CPU cores, {gpus} GPUs"
        return Capacity(slots=max(cpus, gpus), gpus=gpus, detail=detail)

    def check(self, np: int, gpu: bool) -> None:
        if not gpu:
            return  # CPU ranks may share cores; nothing to refuse
        gpus = visible_gpus()
        if np > len(gpus):
            raise CapacityError(
                f"asked for {np} ranks with one GPU each, but this machine has {len(gpus)} "
                f"GPUs ({', '.join(gpus) or 'none'}); use -np {len(gpus) or 1}"
                + (" or --no-gpu" if not gpus else "")
            )

    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        self._on_outcome = on_outcome
        self._np = request.np
        gpus = visible_gpus() if request.gpu else []
        env = {"PYTHONPATH": _user_paths(), **request.env}
        if not env["PYTHONPATH"]:
            del env["PYTHONPATH"]
        cwd = os.getcwd()
        hellos = self._hellos = Hellos(request.np, RankSpec.rendezvous_timeout)
        for rank in range(request.np):
            spec = RankSpec(
                rank=rank, world_size=request.np, job_id=request.job_id, secret=request.secret,
                driver=request.driver, payload=request.payload, host="127.0.0.1", cwd=cwd,
                gpus=(gpus[rank],) if gpus else (), env=env, run_id=request.run_id,
            )
            sup = Supervisor(spec, take=pool.take, gather=hellos.gather)
            with self._lock:
                self._supervisors.append(sup)
                if self._cancelled:
                    sup.cancel()
            threading.Thread(
                target=_run, args=(sup, self._done), name=f"nbdist-rank-{rank}", daemon=True
            ).start()

    def _done(self, outcome: RankOutcome) -> None:
        """Pass the outcome on; after the last rank, warm interpreters for the next job."""
        with self._lock:
            self._finished += 1
            last = self._finished == len(self._supervisors) == self._np
            sups = list(self._supervisors)
        if last and not self._cancelled:
            modules = sorted({m for sup in sups for m in sup.modules})
            pool.fill(sups[0].spec, len(sups), modules)
        self._on_outcome(outcome)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            sups = list(self._supervisors)
            hellos = self._hellos
        for sup in sups:
            sup.cancel()
        if hellos is not None:
            hellos.cancel()


def _run(sup: Supervisor, on_outcome: Callable[[RankOutcome], None]) -> None:
    try:
        outcome = sup.run()
    except BaseException as exc:  # a bug in nbdist must still end the job, not hang it
        outcome = RankOutcome(sup.spec.rank, "failed", error={
            "type": type(exc).__name__, "traceback": "",
            "message": f"nbdist's supervisor of rank {sup.spec.rank} failed: {exc!r}",
        })
    on_outcome(outcome)

"""The local backend: every rank is a fresh interpreter on the driver's machine.

The supervisors run as threads of the driver (the kernel); each starts its rank in a new
process group. If the kernel dies, even by SIGKILL, each rank sees its control pipe close and
kills its own group.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable

from nbdist.errors import CapacityError
from nbdist.launch import Capacity, LaunchRequest
from nbdist.rank import RankOutcome, RankSpec, Supervisor


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


class LocalLauncher:
    """Ranks as local processes; see the module docstring."""

    name = "local"

    def __init__(self) -> None:
        self._supervisors: list[Supervisor] = []
        self._lock = threading.Lock()
        self._cancelled = False

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
        gpus = visible_gpus() if request.gpu else []
        env = {"PYTHONPATH": _user_paths(), **request.env}
        if not env["PYTHONPATH"]:
            del env["PYTHONPATH"]
        cwd = os.getcwd()
        for rank in range(request.np):
            spec = RankSpec(
                rank=rank, world_size=request.np, job_id=request.job_id, secret=request.secret,
                driver=request.driver, payload=request.payload, host="127.0.0.1", cwd=cwd,
                gpus=(gpus[rank],) if gpus else (), env=env,
            )
            sup = Supervisor(spec)
            with self._lock:
                self._supervisors.append(sup)
                if self._cancelled:
                    sup.cancel()
            threading.Thread(
                target=_run, args=(sup, on_outcome), name=f"nbdist-rank-{rank}", daemon=True
            ).start()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            sups = list(self._supervisors)
        for sup in sups:
            sup.cancel()


def _run(sup: Supervisor, on_outcome: Callable[[RankOutcome], None]) -> None:
    try:
        outcome = sup.run()
    except BaseException as exc:  # a bug in nbdist must still end the job, not hang it
        outcome = RankOutcome(sup.spec.rank, "failed", error={
            "type": type(exc).__name__, "traceback": "",
            "message": f"nbdist's supervisor of rank {sup.spec.rank} failed: {exc!r}",
        })
    on_outcome(outcome)

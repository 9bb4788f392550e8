"""A rank's side of ``%dist_check``: what this rank's host has, and how fast its all-reduce is.

:func:`preflight` runs on every rank as an ordinary job (``nbdist.check`` ships it through
the engine, so it runs on every backend): versions (Python, torch, CUDA, NCCL, nbdist), the
GPUs this rank sees (name, memory, NVML's health where ``pynvml`` is installed), free space
in the job's log folder, the clock, and an all-reduce sweep over the job's process group
(bus bandwidth as nccl-tests computes it: ``2 (n-1)/n × bytes / time``). It returns plain
values; the kernel lines the ranks up.

``NBDIST_CHECK_DELAY=RANK:SECONDS`` (a test hook, documented in docs/collectives.md) makes rank
RANK sleep that long before each timed all-reduce: a slow rank made on purpose.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import sys
import time
from typing import Any

#: Sizes swept (bytes): 1 KB to 256 MB by ×4 on GPUs; on CPU (gloo) up to ``CPU_MAX_BYTES``.
MIN_BYTES = 1 << 10
MAX_BYTES = 256 << 20
CPU_MAX_BYTES = 4 << 20
#: Timed repetitions per size (after one warm-up), fewer for the large ones.
REPEATS = 5
#: The test hook's variable, ``RANK:SECONDS``: that rank sleeps that long before each timed
#: all-reduce.
DELAY_ENV = "NBDIST_CHECK_DELAY"


def _delay() -> float:
    rank, _, seconds = os.environ.get(DELAY_ENV, "").partition(":")
    try:
        return float(seconds) if int(rank) == int(os.environ.get("RANK", "-1")) else 0.0
    except ValueError:
        return 0.0


def sizes(gpu: bool, largest: int | None = None) -> list[int]:
    """The sweep's sizes in bytes."""
    top = largest if largest is not None else (MAX_BYTES if gpu else CPU_MAX_BYTES)
    out, n = [], MIN_BYTES
    while n <= top:
        out.append(n)
        n *= 4
    return out


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce (bytes/s): ``algbw × 2 (n-1)/n``."""
    if seconds <= 0 or world < 1:
        return 0.0
    return nbytes / seconds * (2 * (world - 1) / world)


def _versions() -> dict[str, str]:
    from nbdist._version import __version__

    out = {"python": platform.python_version(), "nbdist": __version__}
    try:
        import torch

        out["torch"] = torch.__version__.split("+")[0]
        out["cuda"] = str(torch.version.cuda or "")
        if torch.cuda.is_available():
            try:
                nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
                out["nccl"] = ".".join(map(str, nccl))
            except Exception:  # a build without NCCL
                out["nccl"] = ""
    except ImportError:
        out["torch"] = ""
    return out


def _gpus() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "memory_gb": round(p.total_memory / 2**30, 1),
                     "health": _nvml_health(i)})
    return gpus


def _nvml_health(index: int) -> str:
    """NVML's word on a GPU (pending retired pages, XID-style throttling), or "" without
    ``pynvml``."""
    try:
        import pynvml
    except ImportError:
        return ""
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        temp = pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        hw = reasons & (getattr(pynvml, "nvmlClocksThrottleReasonHwSlowdown", 0x8)
                        | getattr(pynvml, "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40))
        return f"{temp} C" + (", hardware slowdown" if hw else "")
    except Exception as exc:  # NVML absent or refusing: said, not raised
        return f"NVML: {exc}"


def _sweep(gpu: bool, largest: int | None) -> list[tuple[int, float]]:
    """(bytes, best seconds) of an all-reduce at each size, on the default group."""
    import torch
    import torch.distributed as dist

    delay = _delay()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    out = []
    for nbytes in sizes(gpu, largest):
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)  # warm-up: connections, buffers
        repeats = REPEATS if nbytes <= (1 << 20) else 2
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            if delay:
                time.sleep(delay)
            start = time.perf_counter()
            dist.all_reduce(x)
            if gpu:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out.append((nbytes, best))
    return out


def preflight(gpu: bool = False, log_dir: str = "", largest: int | None = None) -> dict[str, Any]:
    """This rank's report (plain values): host, versions, GPUs, free space, clock, sweep."""
    started = time.perf_counter()
    report: dict[str, Any] = {
        "rank": int(os.environ.get("RANK", "0")), "host": socket.gethostname(),
        "pid": os.getpid(), "versions": _versions(), "gpus": _gpus(),
    }
    where = log_dir or os.getcwd()
    probe = where
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        report["free_gb"] = round(shutil.disk_usage(probe or "/").free / 2**30, 1)
    except OSError:
        report["free_gb"] = None
    report["sweep"] = []
    report["error"] = ""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            backend = "nccl" if gpu else "gloo"
            if gpu:
                import torch

                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        report["backend"] = dist.get_backend()
        report["sweep"] = _sweep(gpu, largest)
        dist.barrier()
    except ImportError:
        report["error"] = "torch is not installed on this rank"
    except Exception as exc:  # a failing rank is named by the kernel, not raised here
        report["error"] = f"{type(exc).__name__}: {exc}"
    report["seconds"] = time.perf_counter() - started
    report["clock"] = time.time()  # last: compared with the notebook's clock on return
    report["python_exe"] = sys.executable
    return report

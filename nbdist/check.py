"""``%dist_check``: a preflight of N ranks before a long run, on any backend.

The check is an ordinary job (``nbdist.job.run`` of ``rank/preflight.py``'s
:func:`~nbdist.rank.preflight.preflight`), so it runs wherever ``%%distributed`` runs (local,
Spark, and every backend the engine learns). :func:`judge` lines the ranks' reports up (pure):
a table of host, versions, GPUs, free space, clock offset and the all-reduce sweep, then what
is wrong: a version that differs (between ranks or from the notebook), a rank that failed, a
rank that arrives late to every all-reduce (the slowest rank, and its host), a clock that is
off.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: A rank that arrives this much later than the others to the median all-reduce (seconds,
#: and at least the all-reduce's own time) is named as slow.
SLOW_LAG_S = 0.05
#: A clock further off the notebook's than this (seconds; the measure includes the result's
#: trip back, so it is an upper bound) is named.
CLOCK_S = 1.0
#: Free space in the log folder below this (GB) is named.
LOW_DISK_GB = 1.0


def notebook_versions() -> dict[str, str]:
    """The notebook's own versions (without importing torch into the kernel)."""
    import platform
    from importlib import metadata

    from nbdist._version import __version__

    out = {"python": platform.python_version(), "nbdist": __version__}
    try:
        out["torch"] = metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        out["torch"] = ""
    return out


def _human_rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def _human_size(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(set(ranks))
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


@dataclass
class CheckReport:
    """The preflight of a job's ranks: ``rows`` (one per rank), ``sweep`` (size, seconds,
    bus bandwidth), ``problems`` (each a sentence); ``ok`` when there are none."""

    np: int
    rows: list[list[str]] = field(default_factory=list)
    sweep: list[tuple[int, float, float]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: The job's log folder (written by the notebook's kernel) and its free space in GB.
    log_dir: str = ""
    log_free_gb: float | None = None

    HEADER = ("rank", "host", "python", "torch", "cuda/nccl", "nbdist", "gpus", "free",
              "clock", "late by")

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        table = [list(self.HEADER), *self.rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(self.HEADER))]
        out = [f"%dist_check of {self.np} ranks ({self.seconds:.1f} s)"]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                for r in table]
        if self.log_dir:
            free = f"{self.log_free_gb:g} GB free" if self.log_free_gb is not None else "?"
            out.append(f"log folder: {self.log_dir} ({free})")
        if self.sweep:
            out.append("all-reduce (bus bandwidth as nccl-tests computes it):")
            out += [f"  {_human_size(n):>7}  {t * 1e3:9.3f} ms  {_human_rate(bw)}"
                    for n, t, bw in self.sweep]
        out.append("problems:" if self.problems else "all ranks look healthy")
        out += [f"  {p}" for p in self.problems]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()


def judge(reports: Mapping[int, Mapping[str, Any]], np: int,
          notebook: Mapping[str, str] | None = None,
          delivered: Mapping[int, float] | None = None,
          failed: Mapping[int, str] | None = None, seconds: float = 0.0) -> CheckReport:
    """The ranks' reports (``preflight``'s dicts) → the table and the problems, in order."""
    out = CheckReport(np, seconds=seconds)
    problems = out.problems
    for rank, why in sorted((failed or {}).items()):
        problems.append(f"rank {rank} failed: {why.strip().splitlines()[-1] if why else '?'}")
    for rank in range(np):
        if rank not in reports and rank not in (failed or {}):
            problems.append(f"rank {rank} gave no report")
    lags = _lags(reports)
    for rank, rep in sorted(reports.items()):
        v = rep.get("versions") or {}
        gpus = rep.get("gpus") or []
        gpu_text = ", ".join(f"{g.get('name')} {g.get('memory_gb')} GB"
                             + (f" ({g['health']})" if g.get("health") else "")
                             for g in gpus) or "none"
        offset = None
        if delivered and rank in delivered and isinstance(rep.get("clock"), (int, float)):
            offset = float(rep["clock"]) - delivered[rank]
        free = rep.get("free_gb")
        lag = lags.get(rank)
        cuda = "/".join(x for x in (v.get("cuda", ""), v.get("nccl", "")) if x) or "-"
        out.rows.append([
            str(rank), str(rep.get("host", "?")), v.get("python", "?"), v.get("torch") or "-",
            cuda, v.get("nbdist") or "-", gpu_text,
            f"{free:g} GB" if isinstance(free, (int, float)) else "?",
            f"{offset:+.2f} s" if offset is not None else "?",
            f"{lag * 1e3:.0f} ms" if lag is not None else "-",
        ])
        if rep.get("error"):
            problems.append(f"rank {rank} on {rep.get('host')}: {rep['error']}")
        if isinstance(free, (int, float)) and free < LOW_DISK_GB:
            problems.append(f"rank {rank} on {rep.get('host')}: only {free:g} GB free in its "
                            f"working directory")
        if offset is not None and abs(offset) > CLOCK_S:
            problems.append(f"rank {rank} on {rep.get('host')}: its clock is {offset:+.1f} s "
                            f"off the notebook's")
        for g in gpus:
            if "slowdown" in str(g.get("health", "")) or "NVML:" in str(g.get("health", "")):
                problems.append(f"rank {rank} on {rep.get('host')}: GPU {g.get('name')}: "
                                f"{g['health']}")
    problems.extend(_version_problems(reports, notebook or {}))
    out.sweep = _sweep(reports, np)
    slow = _slow(reports, lags)
    if slow is not None:
        problems.append(slow)
    return out


def _version_problems(reports: Mapping[int, Mapping[str, Any]],
                      notebook: Mapping[str, str]) -> list[str]:
    out = []
    keys = ("python", "torch", "cuda", "nccl", "nbdist")
    for key in keys:
        seen: dict[str, list[int]] = {}
        for rank, rep in sorted(reports.items()):
            value = (rep.get("versions") or {}).get(key)
            if value is not None:
                seen.setdefault(str(value), []).append(rank)
        if len(seen) > 1:
            parts = [f"{_ranks(rs)} {v or 'none'}" for v, rs in
                     sorted(seen.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))]
            out.append(f"{key} differs between the ranks: " + ", ".join(parts))
        elif len(seen) == 1 and notebook.get(key):
            (value, ranks), = seen.items()
            if value and value != notebook[key]:
                out.append(f"{key} on the ranks is {value}, in the notebook {notebook[key]}")
    return out


def _durations(rep: Mapping[str, Any]) -> dict[int, float]:
    out = {}
    for item in rep.get("sweep") or []:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out[int(item[0])] = float(item[1])
    return out


def _lags(reports: Mapping[int, Mapping[str, Any]]) -> dict[int, float]:
    """How much later than the latest-waiting rank each rank arrives at an all-reduce
    (median over the sizes): a rank that is late waits least, the others wait for it."""
    per = {r: _durations(rep) for r, rep in reports.items()}
    per = {r: d for r, d in per.items() if d}
    if len(per) < 2:
        return {}
    sizes = set.intersection(*(set(d) for d in per.values()))
    lags: dict[int, list[float]] = {r: [] for r in per}
    for n in sizes:
        longest = max(d[n] for d in per.values())
        for r, d in per.items():
            lags[r].append(longest - d[n])
    return {r: statistics.median(v) for r, v in lags.items() if v}


def _sweep(reports: Mapping[int, Mapping[str, Any]], np: int) -> list[tuple[int, float, float]]:
    """Per size: the all-reduce's own time (the latest rank's, which waited for no one) and
    its bus bandwidth."""
    from nbdist.rank.preflight import bus_bandwidth

    per = [d for d in (_durations(rep) for rep in reports.values()) if d]
    if not per:
        return []
    sizes = sorted(set.intersection(*(set(d) for d in per)))
    out = []
    for n in sizes:
        t = min(d[n] for d in per)
        out.append((n, t, bus_bandwidth(n, t, np)))
    return out


def _slow(reports: Mapping[int, Mapping[str, Any]], lags: Mapping[int, float]) -> str | None:
    """The rank far slower than the others (late to every all-reduce), or None."""
    if len(lags) < 2:
        return None
    rank = max(lags, key=lambda r: lags[r])
    others = [lag for r, lag in lags.items() if r != rank]
    own = statistics.median(_durations(reports[rank]).values())
    lateness = lags[rank] - max(others)
    if lateness < max(SLOW_LAG_S, own):
        return None
    host = reports[rank].get("host", "?")
    return (f"rank {rank} on {host} is the slowest: it reaches each all-reduce "
            f"{lateness * 1e3:.0f} ms after the others (they wait for it)")


def run_check(np: int, backend: str = "auto", gpu: bool = False, timeout: float = 120.0,
              largest: int | None = None, env: Mapping[str, str] | None = None,
              log_dir: str = "") -> CheckReport:
    """Run the preflight on ``np`` ranks and judge it (a failed job is judged too)."""
    from nbdist import job as jobs
    from nbdist.errors import DistributedError
    from nbdist.rank.preflight import preflight

    started = time.perf_counter()
    job = jobs.run(preflight, gpu, log_dir, largest, np=np, backend=backend, gpu=gpu,
                   timeout=timeout, env=dict(env or {}))
    job.wait()
    failed: dict[int, str] = {}
    reports: dict[int, Mapping[str, Any]] = {}
    try:
        reports = dict(enumerate(job.results))
    except DistributedError as exc:
        failed = dict(exc.failures) or {r: str(exc) for r in range(abs(np))}
    delivered = {}
    for r in reports:
        marks = job.state.ranks[r].marks
        if "delivered" in marks:
            delivered[r] = marks["delivered"]
    got = judge(reports, job.np, notebook_versions(), delivered, failed,
                time.perf_counter() - started)
    got.log_dir = job.state.log_dir or ""
    got.log_free_gb = _free_gb(got.log_dir)
    if got.log_free_gb is not None and got.log_free_gb < LOW_DISK_GB:
        got.problems.append(f"the log folder {got.log_dir} has only {got.log_free_gb:g} GB "
                            f"free")
    return got


def _free_gb(folder: str) -> float | None:
    """Free space where ``folder`` is (or would be: its nearest existing parent)."""
    import os
    import shutil

    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return round(shutil.disk_usage(probe or "/").free / 2**30, 1)
    except OSError:
        return None

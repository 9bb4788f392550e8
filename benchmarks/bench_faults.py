"""How fast nbdist reacts to faults, on the local backend and on Spark (the bounds in
docs/reliability.md), and what 100 jobs leave behind in the driver.

    .venv/bin/python benchmarks/bench_faults.py [--reps 3] [--soak 100] [--no-spark]

Each fault is injected into real ranks (np = 2, gloo, CPU; Spark: a ``local[2]`` session). A
rank writes its pid when it starts and the wall-clock time of the fault just before it
happens; the bench measures from then to the error in the notebook and to the last rank
process being gone (the maximum over the repetitions). The soak runs mixed jobs (a third of
them failing) after five warm-up jobs and compares the driver before and after (psutil).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

import nbdist
from nbdist.channel import free_port
from nbdist.job import Job
from nbdist.launch import local
from nbdist.launch.backends import choose as choose_launcher
from nbdist.protocol import CallPayload
from nbdist.rank.zygote import COMMAND

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 5.0  # --timeout of the hang row

# Rank 1's fault, while rank 0 waits for it in a collective.
FAULTS = {
    "exception on one rank, the other in all_reduce": "raise RuntimeError('boom')",
    "SIGKILL of one rank": "os.kill(os.getpid(), 9)",
    "segfault of one rank": "import ctypes; ctypes.string_at(0)",
    "sys.exit(3) on one rank": "sys.exit(3)",
    "os._exit(0) on one rank": "os._exit(0)",
    f"a hang, --timeout {TIMEOUT_S:g} s (from the timeout)": "time.sleep(600)",
}

SRC = """
def f(where):
    import os, sys, time
    import torch
    import torch.distributed as dist
    open(os.path.join(where, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        with open(os.path.join(where, "stamp"), "w") as fh:
            fh.write(repr(time.time()))
        {fault}
    dist.all_reduce(torch.ones(1))
"""

# Ranks that write their pid (after ``before``) and wait for ever.
_WAITING = """
def f(where):
    import os, signal, time
    {before}
    open(os.path.join(where, "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
    time.sleep(600)
"""
HANG = _WAITING.format(before="")
STUBBORN = _WAITING.format(before="signal.signal(signal.SIGTERM, signal.SIG_IGN)")

LINGERING = """
def f(where):
    import os, subprocess, time
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    open(os.path.join(where, "pid" + os.environ["RANK"]), "w").write(str(child.pid))
    return time.time()
"""

FLOOD = """
def f():
    import os, sys
    os.write(1, b"y" * (10 * 1024 * 1024) + b"\\n")
    os.write(1, b"z" * (8 * 1024 * 1024))
    for i in range(200_000):
        sys.stdout.write(f"{i}\\r")
    sys.stdout.flush()
    chunk = (b"x" * 1023 + b"\\n") * 1024
    for _ in range(64):
        os.write(1, chunk)
    os.write(1, bytes(range(128, 256)) * 1000 + b"\\n")
    return "survived"
"""


def define(src: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(compile(textwrap.dedent(src), "<fault>", "exec"), ns)
    fn: Callable[..., Any] = ns["f"]
    return fn


def pids_in(where: Path) -> list[psutil.Process]:
    procs = []
    for path in where.glob("pid*"):
        try:
            procs.append(psutil.Process(int(path.read_text())))
        except (psutil.Error, ValueError):
            pass  # already gone, or written after we looked
    return procs


def wait_files(where: Path, pattern: str, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(where.glob(pattern))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} {pattern} files did not appear in {where}")
        time.sleep(0.005)


def until_failed(job: Job) -> float:
    try:
        job.result(timeout=120)
    except nbdist.DistributedError:
        pass
    return time.time()


def gone_after(procs: list[psutil.Process], timeout: float = 30.0) -> float:
    """When the last of ``procs`` ended (killed and zombie counts: its parent may be init)."""
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.002)
    return time.time()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Misdirected:
    """A real launcher whose ranks are told a closed port for the driver's event server."""

    def __init__(self, launcher: Any) -> None:
        self._launcher = launcher
        self.port = free_port("127.0.0.1")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._launcher, name)

    def start(self, request: Any, on_outcome: Any) -> None:
        closed = dataclasses.replace(request, driver=(request.driver[0], self.port))
        self._launcher.start(closed, on_outcome)


# -- the rows: each returns (error after, gone after) in seconds, or one figure ------------------
def fault(backend: str, code: str) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        where = Path(d)
        timeout = TIMEOUT_S if "sleep" in code else None
        job = nbdist.run(define(SRC.format(fault=code)), d, np=2, backend=backend,
                         timeout=timeout)
        raised = until_failed(job)
        gone = gone_after(pids_in(where))
        t0 = float((where / "stamp").read_text())
        if timeout is not None:  # from the moment the timeout was due
            t0 = job.state.created + timeout
        return raised - t0, gone - t0


def cancel(backend: str) -> tuple[float, float]:
    """job.cancel() (what %dist_cancel and the stop button do), one rank ignoring SIGTERM."""
    with tempfile.TemporaryDirectory() as d:
        job = nbdist.run(define(STUBBORN), d, np=2, backend=backend)
        wait_files(Path(d), "pid*", 2)  # written after their signal() call
        procs = pids_in(Path(d))
        t0 = time.time()
        job.cancel()
        return until_failed(job) - t0, gone_after(procs) - t0


def lingering_child(backend: str) -> tuple[float, float]:
    """A child the rank started in its own session: gone after the rank's result."""
    with tempfile.TemporaryDirectory() as d:
        ended = nbdist.run(define(LINGERING), d, np=1, backend=backend).result(timeout=120)
        return 0.0, gone_after(pids_in(Path(d))) - ended


def spark_worker_killed(backend: str) -> tuple[float, float]:
    """SIGKILL to a rank's Spark Python worker (its task dies under the supervisor)."""
    with tempfile.TemporaryDirectory() as d:
        job = nbdist.run(define(HANG), d, np=2, backend=backend)
        wait_files(Path(d), "pid*", 2)
        procs = pids_in(Path(d))
        worker = procs[0].parent()
        assert worker is not None
        t0 = time.time()
        worker.kill()
        return until_failed(job) - t0, gone_after(procs) - t0


def spark_kills_unreachable(backend: str) -> tuple[float, float]:
    """Cancel ranks that cannot reach the event server: Spark kills their tasks."""
    with tempfile.TemporaryDirectory() as d:
        launcher = Misdirected(choose_launcher(2, backend)[0])
        payload: CallPayload = {"kind": "call", "fn": define(HANG), "args": (d,), "kwargs": {}}
        job = Job(payload, 2, launcher).start()
        wait_files(Path(d), "pid*", 2)
        procs = pids_in(Path(d))
        t0 = time.time()
        job.cancel()
        return until_failed(job) - t0, gone_after(procs) - t0


def too_many_ranks(backend: str) -> float:
    """From the call to the CapacityError (local: GPU ranks on a machine with one GPU)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        t0 = time.perf_counter()
        try:
            nbdist.run(print, np=3, backend=backend, gpu=backend == "local")
        except nbdist.CapacityError:
            return time.perf_counter() - t0
        raise AssertionError("no CapacityError")
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def unreachable(backend: str) -> tuple[float, float]:
    """A trivial torch job: with its event channel, and with the driver's port closed."""

    def trivial() -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank()

    nbdist.run(trivial, np=2, backend=backend).result(timeout=120)  # both measured warm
    t0 = time.perf_counter()
    nbdist.run(trivial, np=2, backend=backend).result(timeout=120)
    normal = time.perf_counter() - t0
    payload: CallPayload = {"kind": "call", "fn": trivial, "args": (), "kwargs": {}}
    t0 = time.perf_counter()
    job = Job(payload, 2, Misdirected(choose_launcher(2, backend)[0])).start()
    job.wait(120)
    assert job.lost_output is not None and job.error is None
    return normal, time.perf_counter() - t0


def flood(backend: str) -> float:
    """Driver RSS growth (MB) from a rank printing a 10 MB line, 8 MB without a newline, a
    200,000-redraw \\r storm and 64 MiB of lines."""
    before = psutil.Process().memory_info().rss
    nbdist.run(define(FLOOD), np=1, backend=backend).result(timeout=300)
    return (psutil.Process().memory_info().rss - before) / 2**20


def soak(backend: str, n: int) -> dict[str, dict[str, float]]:
    """``n`` jobs, a third failing: the driver before and after."""
    me = psutil.Process()

    def one(i: int) -> None:
        def job(i: int = i) -> int:
            import os

            if i % 3 == 0 and os.environ["RANK"] == "1":
                raise ValueError(f"planned failure {i}")
            print(f"job {i}", flush=True)
            return i

        try:
            nbdist.run(job, np=2, backend=backend).result(timeout=120)
        except nbdist.DistributedError:
            assert i % 3 == 0

    def snapshot() -> dict[str, float]:
        local.pool.clear()  # zygotes and warm interpreters are by design
        ranks = [p for p in me.children(recursive=True)
                 if any(c in " ".join(p.cmdline()) for c in ("nbdist.rank.runtime", COMMAND))]
        gone_after(ranks, timeout=10)  # the last ranks may still be leaving
        return {"threads": me.num_threads(), "fds": me.num_fds(),
                "listening": sum(c.status == "LISTEN" for c in me.net_connections("tcp")),
                "rank processes": sum(map(_running, ranks)),
                "rss_mb": me.memory_info().rss / 2**20}

    for i in range(5):
        one(i)
    before = snapshot()
    for i in range(5, 5 + n):
        one(i)
    after = snapshot()
    return {k: {"before": before[k], "after": after[k]} for k in before}


def start_spark() -> Any:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("nbdist-bench-faults")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("FATAL")  # the killed worker's stack traces
    spark.sparkContext.parallelize([1, 2], 2).count()  # warm
    return spark


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--soak", type=int, default=100, help="jobs in the soak (0: none)")
    parser.add_argument("--no-spark", action="store_true")
    args = parser.parse_args()
    backends = ["local"] if args.no_spark else ["local", "spark"]
    spark = None if args.no_spark else start_spark()
    timed: dict[str, Callable[[str], tuple[float, float]]] = {
        name: functools.partial(fault, code=code) for name, code in FAULTS.items()}
    timed["cancel (%dist_cancel, the stop button), one rank ignoring SIGTERM"] = cancel
    timed["a child started in its own session, from the rank's result"] = lingering_child
    spark_only = {
        "the Spark task's Python worker killed (SIGKILL)": spark_worker_killed,
        "cancel with the event server unreachable (Spark kills the tasks)":
            spark_kills_unreachable,
    }
    rows: list[dict[str, Any]] = []
    for name, measure in {**timed, **spark_only}.items():
        row: dict[str, Any] = {"row": name}
        for backend in backends:
            if name in spark_only and backend != "spark":
                continue
            samples = [measure(backend) for _ in range(args.reps)]
            row[backend] = {"error_max": max(s[0] for s in samples),
                            "gone_max": max(s[1] for s in samples),
                            "gone_median": statistics.median(s[1] for s in samples)}
        rows.append(row)
    figures: dict[str, Any] = {}
    for backend in backends:
        normal, lost = unreachable(backend)
        figures[backend] = {
            "too many ranks: CapacityError after (s)": too_many_ranks(backend),
            "unreachable event server: job (s), with channel / without": [normal, lost],
            "output flood: driver RSS growth (MB)": flood(backend),
        }
        if args.soak:
            figures[backend]["soak"] = soak(backend, args.soak)
    if spark is not None:
        spark.stop()
    local.pool.clear()
    text = markdown(rows, figures, backends, args.soak)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.md").write_text(text)
    (out / "faults.json").write_text(json.dumps({"rows": rows, "figures": figures}, indent=2))
    return 0


def markdown(rows: list[dict[str, Any]], figures: dict[str, Any], backends: list[str],
             n: int) -> str:
    head = " | ".join(f"{b}: error / all gone (max)" for b in backends)
    lines = [f"| fault | {head} |", "| --- |" + " --- |" * len(backends)]
    for row in rows:
        cells = [(f"{row[b]['error_max']:.2f} s / {row[b]['gone_max']:.2f} s" if b in row
                  else "–") for b in backends]
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    lines += ["", "| measure | " + " | ".join(backends) + " |",
              "| --- |" + " --- |" * len(backends)]
    keys = [k for k in figures[backends[0]] if k != "soak"]
    for key in keys:
        cells = []
        for b in backends:
            value = figures[b][key]
            cells.append(" / ".join(f"{v:.2f}" for v in value) if isinstance(value, list)
                         else f"{value:.2f}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if n:
        lines += ["", f"Soak, {n} jobs (before → after):", "",
                  "| | " + " | ".join(backends) + " |", "| --- |" + " --- |" * len(backends)]
        for key in figures[backends[0]]["soak"]:
            cells = [f"{figures[b]['soak'][key]['before']:.1f} → "
                     f"{figures[b]['soak'][key]['after']:.1f}" for b in backends]
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

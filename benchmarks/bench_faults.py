"""How fast nbdist reacts to faults: from the moment a fault happens on a rank to the error in
the notebook and to the last rank process being gone (the bounds in docs/reliability.md).

    .venv/bin/python benchmarks/bench_faults.py [--reps 3]

Each fault is injected on rank 1 of 2 (gloo, CPU) while rank 0 waits in a collective; the
rank writes the wall-clock time of the fault to a file just before it happens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil

import nbdist
from nbdist.launch import local

ROOT = Path(__file__).resolve().parent.parent

FAULTS = {
    "exception in one rank, peer in all_reduce": "raise RuntimeError('boom')",
    "SIGKILL of one rank": "os.kill(os.getpid(), 9)",
    "segfault of one rank": "import ctypes; ctypes.string_at(0)",
    "sys.exit(3) on one rank": "sys.exit(3)",
}

SRC = """
def f(stamp):
    import os, sys, time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        with open(stamp, "w") as fh:
            fh.write(repr(time.time()))
        {fault}
    dist.all_reduce(torch.ones(1))
"""


def ranks() -> list[psutil.Process]:
    warm = set(local.pool.pids())
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid not in warm and "nbdist.runtime" in " ".join(p.cmdline())]


def measure(fault: str, tmp: Path) -> tuple[float, float]:
    ns: dict[str, Any] = {}
    exec(compile(textwrap.dedent(SRC.format(fault=fault)), "<fault>", "exec"), ns)
    stamp = tmp / "stamp"
    job = nbdist.run(ns["f"], str(stamp), np=2)
    try:
        job.result(timeout=120)
    except nbdist.DistributedError:
        pass
    raised = time.time()
    procs = ranks()
    psutil.wait_procs(procs, timeout=15)
    gone = time.time()
    t0 = float(stamp.read_text())
    return raised - t0, gone - t0


def cancel_bound() -> tuple[float, float]:
    """%dist_cancel on two ranks, one of which ignores SIGTERM."""

    def stubborn() -> None:
        import signal
        import time

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("up", flush=True)
        time.sleep(600)

    job = nbdist.run(stubborn, np=2)
    while not all(r.last_line == "up" for r in job.state.ranks):
        time.sleep(0.01)
    procs = ranks()
    t0 = time.time()
    job.cancel()
    try:
        job.result(timeout=60)
    except nbdist.DistributedError:
        pass
    raised = time.time()
    psutil.wait_procs(procs, timeout=15)
    return raised - t0, time.time() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, fault in FAULTS.items():
            samples = [measure(fault, Path(d)) for _ in range(args.reps)]
            rows.append((name, max(s[0] for s in samples), max(s[1] for s in samples),
                         statistics.median(s[1] for s in samples)))
    samples = [cancel_bound() for _ in range(args.reps)]
    rows.append(("cancel, one rank ignoring SIGTERM", max(s[0] for s in samples),
                 max(s[1] for s in samples), statistics.median(s[1] for s in samples)))
    local.pool.clear()
    lines = ["| fault | error raised after (max) | all rank processes gone after (max) | "
             "gone (median) |", "| --- | --- | --- | --- |"]
    lines += [f"| {n} | {a:.2f} s | {b:.2f} s | {c:.2f} s |" for n, a, b, c in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.md").write_text(text)
    (out / "faults.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NBDIST_WARM_POOL", "1")
    raise SystemExit(main())

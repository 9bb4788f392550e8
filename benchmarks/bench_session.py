"""Session benchmark: cells on live ranks (``%dist_session``) against the same cells launched fresh.

1. A trivial cell on a live 4-rank local session, from the cell's start (capture included) to
   its result in the notebook, against the same cell as a fresh ``-np 4`` job (cold: no warm
   interpreters) in the same run. Goal from issue 8: median under 100 ms.
2. A training cell (DDP, ``STEPS`` steps, a print and a tqdm bar each) run again on a live
   2-rank session whose first cell built the model and the process group, against the whole
   cell launched fresh. Reported: time to the first step's output line at the driver (the
   "start") and end to end. Issue 8 expects a start at least 10× faster.

Usage::

    .venv/bin/python benchmarks/bench_session.py [--quick]

Results: ``benchmarks/results/session.md`` and ``.json``. Goals are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from nbdist import job as jobs
from nbdist import session as sessions
from nbdist.capture import capture_cell
from nbdist.launch import local

ROOT = Path(__file__).resolve().parent.parent
STEPS = 50

TRIVIAL = "import os\nint(os.environ['RANK'])"

SETUP = """
import torch, torch.distributed as dist
from tqdm import tqdm
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 32), torch.randn(64, 1)
"""

LOOP = f"""
for step in tqdm(range({STEPS}), mininterval=0.1):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    print(f"step {{step}} loss {{loss.item():.4f}}", flush=True)
float(loss.item())
"""


def on_session(live: sessions.Session, cell: str) -> tuple[float, float]:
    """(seconds to the first output line, seconds to the result) of ``cell`` on ``live``."""
    start = time.perf_counter()
    captured = capture_cell(cell, {}, remote_names=live.defined_names())
    return _timed(live.run_cell(captured.payload()), start)


def fresh(cell: str, np: int) -> tuple[float, float]:
    """The same for ``cell`` as a job of its own, on cold interpreters."""
    local.pool.clear()
    start = time.perf_counter()
    payload = capture_cell(cell, {}).payload()
    times = _timed(jobs.start(payload, -np), start)
    local.pool.clear()
    return times


def _timed(job: jobs.Handle, start: float) -> tuple[float, float]:
    first = None
    while not job.done():
        if first is None and any(r.lines for r in job.state.ranks):
            first = time.perf_counter() - start
        time.sleep(0.001)  # the benchmark's own polling, not part of what is measured
    job.result()
    total = time.perf_counter() - start
    return (first if first is not None else total), total


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    reps_trivial, reps_train = (10, 2) if args.quick else (40, 5)

    trivial_session: list[float] = []
    trivial_fresh: list[float] = []
    live = sessions.start(-4)
    try:
        for i in range(reps_trivial):
            trivial_session.append(on_session(live, TRIVIAL)[1])
            if i % 8 == 0:  # a cold launch costs seconds: fewer of them, interleaved
                trivial_fresh.append(fresh(TRIVIAL, 4)[1])
    finally:
        live.stop()

    start_session: list[float] = []
    total_session: list[float] = []
    start_fresh: list[float] = []
    total_fresh: list[float] = []
    for _ in range(reps_train):
        first, total = fresh(SETUP + LOOP, 2)
        start_fresh.append(first)
        total_fresh.append(total)
        live = sessions.start(-2)
        try:
            on_session(live, SETUP)
            first, total = on_session(live, LOOP)
            start_session.append(first)
            total_session.append(total)
        finally:
            live.stop()

    def ratio(a: list[float], b: list[float]) -> str:
        return f"{statistics.median(a) / statistics.median(b):.3f}×"

    rows = [
        ("1. trivial cell, 4 ranks", "fresh job, cold (baseline)", median_ms(trivial_fresh),
         "1.000×", len(trivial_fresh)),
        ("", "live session", median_ms(trivial_session),
         ratio(trivial_session, trivial_fresh), len(trivial_session)),
        (f"2. DDP training, {STEPS} steps, 2 ranks: start (first line)",
         "fresh job, cold (baseline)", median_ms(start_fresh), "1.000×", len(start_fresh)),
        ("", "second cell on a live session", median_ms(start_session),
         ratio(start_session, start_fresh), len(start_session)),
        ("2. same, end to end", "fresh job, cold (baseline)", median_ms(total_fresh), "1.000×",
         len(total_fresh)),
        ("", "second cell on a live session", median_ms(total_session),
         ratio(total_session, total_fresh), len(total_session)),
    ]
    lines = ["| scenario | contender | median | vs baseline | runs |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    trivial_ms = statistics.median(trivial_session) * 1000
    speedup = statistics.median(start_fresh) / statistics.median(start_session)
    lines += [
        "",
        f"Goal: trivial cell on a live 4-rank session under 100 ms: {trivial_ms:.1f} ms "
        f"({'met' if trivial_ms < 100 else 'missed'}).",
        f"Second training cell starts {speedup:.0f}× sooner than a fresh launch "
        f"(issue 8 expects at least 10×: {'met' if speedup >= 10 else 'missed'}).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.md").write_text(text)
    samples: dict[str, Any] = {
        "trivial_session": trivial_session, "trivial_fresh": trivial_fresh,
        "start_session": start_session, "start_fresh": start_fresh,
        "total_session": total_session, "total_fresh": total_fresh,
    }
    (out / "session.json").write_text(json.dumps({"rows": rows, "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

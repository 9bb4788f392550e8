"""Streaming benchmark: rank output → driver state, through the real local backend.

At 2, 4 and 16 ranks (``--np``), two measurements, each against a baseline measured in the same
run:

1. **Throughput.** The ranks print ``--lines`` lines in all (split between them) as fast as
   they can. Reported: lines/s that reach the driver's state (counted: zero may be lost),
   against the same ranks writing the same lines to ``/dev/null`` (timed inside the ranks).
   Median of ``--reps`` runs, the two contenders interleaved.
2. **Latency.** Each rank prints a time-stamped line every 5 ms; for each line, the time from
   ``print`` on the rank to the line being in the driver's state. p50 / p99 / max.

Usage::

    .venv/bin/python benchmarks/bench_streaming.py            # full run
    .venv/bin/python benchmarks/bench_streaming.py --quick    # smaller numbers, for a smoke test

Results are printed as one markdown table and written to ``benchmarks/results/streaming.json``
and ``streaming.md``. The goals from issue 5 (≥ 200,000 lines/s with 4 ranks and nothing lost,
p99 < 50 ms) are checked and reported, not asserted: timings depend on the machine and on what
else runs on it. The training-loop overhead is ``bench_training.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import nbdist
from nbdist import job as jobs

ROOT = Path(__file__).resolve().parent.parent
#: Seconds between two lines of a rank in the latency measurement.
LATENCY_EVERY_S = 0.005


# -- what the ranks run ------------------------------------------------------------------------
def _wait_gate(gate: str) -> None:
    import os
    import time

    while not os.path.exists(gate):
        time.sleep(0.001)


def flood(gate: str, n: int, to_null: bool) -> float:
    """Print ``n`` lines as fast as possible once ``gate`` exists; return the seconds it took."""
    import os
    import sys
    import time

    _wait_gate(gate)
    out = open(os.devnull, "w") if to_null else sys.stdout
    rank = os.environ["RANK"]
    start = time.perf_counter()
    for i in range(n):
        print("rank", rank, "line", i, "of a loop that prints as fast as it can", file=out)
    out.flush()
    return time.perf_counter() - start


def paced(gate: str, n: int, every: float) -> None:
    """Print ``n`` time-stamped lines, one every ``every`` seconds."""
    import time

    _wait_gate(gate)
    nxt = time.perf_counter()
    for i in range(n):
        print(f"stamp {time.time():.6f} {i}")
        nxt += every
        delay = nxt - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


# -- measurements ----------------------------------------------------------------------------
def _running(job: jobs.Job, np: int, timeout: float = 300.0) -> None:
    # Every rank waits on the gate, so start-up is not part of what is timed.
    deadline = time.monotonic() + timeout
    while sum(r.status == "running" for r in job.state.ranks) < np:
        if time.monotonic() > deadline:
            job.cancel("the benchmark gave up waiting for the ranks")
            raise TimeoutError(f"{np} ranks not all running after {timeout:g} s: "
                               f"{[r.status for r in job.state.ranks]}")
        time.sleep(0.005)


def _flood_once(n: int, np: int, to_null: bool, gate: Path) -> tuple[float, int]:
    """Lines/s of one run, and how many lines did not reach the state."""
    job = nbdist.run(flood, str(gate), n, to_null, np=np)
    _running(job, np)
    start = time.perf_counter()
    gate.touch()
    done_at = None
    while not job.done():
        if done_at is None and sum(r.lines for r in job.state.ranks) >= n * np:
            done_at = time.perf_counter()
        time.sleep(0.001)
    rank_s = job.results
    if to_null:
        return n * np / max(rank_s), 0
    lost = n * np - sum(r.lines for r in job.state.ranks)
    return n * np / ((done_at or time.perf_counter()) - start), lost


def throughput(total: int, np: int, reps: int, tmp: Path) -> dict[str, Any]:
    n = total // np
    runs: dict[str, list[float]] = {"devnull": [], "nbdist": []}
    lost = 0
    for rep in range(reps):  # interleaved, so a change in the machine's load hits both
        for key in runs:
            rate, missing = _flood_once(n, np, key == "devnull", tmp / f"gate-{np}-{rep}-{key}")
            runs[key].append(rate)
            lost += missing
    nb, null = statistics.median(runs["nbdist"]), statistics.median(runs["devnull"])
    return {"lines": n * np, "nbdist_lines_per_s": nb, "devnull_lines_per_s": null,
            "ratio": nb / null, "lost": lost, "all_nbdist": runs["nbdist"],
            "all_devnull": runs["devnull"]}


def latency(n: int, np: int, tmp: Path) -> dict[str, Any]:
    gate = tmp / f"gate-latency-{np}"
    job = nbdist.run(paced, str(gate), n, LATENCY_EVERY_S, np=np)
    seen: list[tuple[float, str]] = []
    apply = job.state.apply

    def stamped(rank: int, event: Mapping[str, Any]) -> None:
        apply(rank, event)
        if event.get("t") == "out":
            seen.append((time.time(), str(event.get("text", ""))))

    job.state.apply = stamped  # type: ignore[method-assign]
    _running(job, np)
    gate.touch()
    job.result()
    delays = sorted(arrived - float(line.split()[1])
                    for arrived, text in seen for line in text.splitlines()
                    if line.startswith("stamp "))

    def pct(p: float) -> float:
        return delays[min(len(delays) - 1, int(p * len(delays)))] * 1000

    return {"lines": len(delays), "lost": n * np - len(delays), "p50_ms": pct(0.5),
            "p99_ms": pct(0.99), "max_ms": delays[-1] * 1000}


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| ranks | lines/s to the driver's state | same ranks to /dev/null | ratio | lost | "
           "latency p50 | p99 | max |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t, lat = r["throughput"], r["latency"]
        out.append(
            f"| {r['np']} | {t['nbdist_lines_per_s']:,.0f} | {t['devnull_lines_per_s']:,.0f} | "
            f"{t['ratio']:.2f}× | {t['lost'] + lat['lost']} | {lat['p50_ms']:.1f} ms | "
            f"{lat['p99_ms']:.1f} ms | {lat['max_ms']:.1f} ms |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small numbers, for a smoke test")
    parser.add_argument("--lines", type=int, default=None,
                        help="lines in all, split between the ranks (throughput)")
    parser.add_argument("--np", default="2,4,16", help="rank counts, comma-separated")
    parser.add_argument("--reps", type=int, default=None, help="throughput runs per contender")
    args = parser.parse_args()
    total = args.lines or (80_000 if args.quick else 1_000_000)
    reps = args.reps or (1 if args.quick else 3)
    per_rank = 200 if args.quick else 1000  # latency: 1000 lines = 5 s per rank
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for np in (int(x) for x in args.np.split(",")):
            rows.append({"np": np, "throughput": throughput(total, np, reps, tmp),
                         "latency": latency(per_rank, np, tmp)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = table(rows)
    four: dict[str, Any] | None = next((r for r in rows if r["np"] == 4), None)
    goals = {"no line lost": all(r["throughput"]["lost"] == r["latency"]["lost"] == 0
                                 for r in rows)}
    if four is not None:
        goals["throughput >= 200k lines/s at 4 ranks"] = (
            four["throughput"]["nbdist_lines_per_s"] >= 200_000)
        goals["p99 latency < 50 ms at 4 ranks"] = four["latency"]["p99_ms"] < 50
    text += "\n" + "".join(f"- [{'met' if ok else 'MISSED'}] {goal}\n"
                           for goal, ok in goals.items())
    text += (f"\n{total:,} lines in all per throughput run (median of {reps}); latency: "
             f"{per_rank} lines per rank, one every {LATENCY_EVERY_S * 1000:g} ms; "
             f"{os.cpu_count()} cores.\n")
    print("\n" + text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "streaming.json").write_text(json.dumps(
        {"cpus": os.cpu_count(), "rows": rows, "goals": goals}, indent=2))
    (results / "streaming.md").write_text(text)


if __name__ == "__main__":
    main()

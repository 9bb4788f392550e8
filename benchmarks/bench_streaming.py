"""Streaming benchmark: rank output → driver state, through the real local backend.

Three measurements, each against a baseline measured in the same run:

1. **Throughput.** 4 ranks print ``--lines`` lines each as fast as they can. Reported: lines/s
   that reach the driver's state (counted: zero may be lost), against the same ranks writing
   the same lines to ``/dev/null``.
2. **Latency.** Ranks print time-stamped lines at a steady pace; for each line, the time from
   ``print`` on the rank to the line being in the driver's state. p50 / p99 / max.
3. **Training overhead.** A loop that does a fixed amount of work, prints a line and advances
   a tqdm bar on every step, timed inside the rank: under nbdist vs the same function started
   by a bare launcher (``python -c``) with its output going to a file.

Usage::

    .venv/bin/python benchmarks/bench_streaming.py            # full run
    .venv/bin/python benchmarks/bench_streaming.py --quick    # smaller numbers, for a smoke test

Results are printed and written to ``benchmarks/results/streaming.json``. The goals from
issue 5 (≥ 200,000 lines/s with nothing lost, p99 < 50 ms, overhead ≤ 3 %) are checked and
reported, not asserted: timings depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import cloudpickle

import nbdist
from nbdist import job as jobs

ROOT = Path(__file__).resolve().parent.parent


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


def train(steps: int, work: int) -> float:
    """A stand-in training loop: ``work`` units of CPU, a print and a tqdm update per step."""
    import time

    from tqdm import tqdm

    def step_work() -> float:
        acc = 0.0
        for j in range(work):
            acc += (j * 0.5) ** 0.5
        return acc

    step_work()  # warm up
    start = time.perf_counter()
    for step in tqdm(range(steps), desc="train"):
        loss = step_work()
        print(f"step {step} loss {loss:.3f}")
    return (time.perf_counter() - start) / steps


# -- measurements ----------------------------------------------------------------------------
def _record_arrivals(job: jobs.Job) -> list[tuple[float, str]]:
    """Wrap the job's state so each output chunk is time-stamped when it is folded in."""
    seen: list[tuple[float, str]] = []
    apply = job.state.apply

    def stamped(rank: int, event: dict[str, Any]) -> None:
        apply(rank, event)
        if event.get("t") == "out":
            seen.append((time.time(), str(event.get("text", ""))))

    job.state.apply = stamped  # type: ignore[method-assign]
    return seen


def throughput(n: int, np: int, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for to_null in (True, False):
        gate = tmp / f"gate-{to_null}"
        job = nbdist.run(flood, str(gate), n, to_null, np=np)
        # Every rank waits on the gate, so startup is not part of what is timed.
        while sum(r.state == "running" for r in job.state.ranks) < np:
            time.sleep(0.005)
        start = time.perf_counter()
        gate.touch()
        done_at = None
        while not job.done():
            if done_at is None and sum(r.lines for r in job.state.ranks) >= n * np:
                done_at = time.perf_counter()
            time.sleep(0.001)
        rank_s = job.results
        if done_at is None:
            done_at = time.perf_counter()
        lines = [r.lines for r in job.state.ranks]
        key = "devnull" if to_null else "nbdist"
        if to_null:
            wall = max(rank_s)
        else:
            wall = done_at - start
            results["lost"] = n * np - sum(lines)
            results["lines_per_rank"] = lines
        results[key] = {"seconds": wall, "lines_per_s": n * np / wall}
    results["ratio"] = results["nbdist"]["lines_per_s"] / results["devnull"]["lines_per_s"]
    return results


def latency(n: int, np: int, every: float, tmp: Path) -> dict[str, Any]:
    gate = tmp / "gate-latency"
    job = nbdist.run(paced, str(gate), n, every, np=np)
    seen = _record_arrivals(job)
    while sum(r.state == "running" for r in job.state.ranks) < np:
        time.sleep(0.005)
    gate.touch()
    job.result()
    delays = []
    for arrived, text in seen:
        for line in text.splitlines():
            if line.startswith("stamp "):
                delays.append(arrived - float(line.split()[1]))
    delays.sort()
    lost = n * np - len(delays)

    def pct(p: float) -> float:
        return delays[min(len(delays) - 1, int(p * len(delays)))] * 1000

    return {"lines": len(delays), "lost": lost, "p50_ms": pct(0.5), "p99_ms": pct(0.99),
            "max_ms": delays[-1] * 1000}


def _bare(steps: int, work: int, np: int, tmp: Path) -> float:
    """Mean seconds per step of ``train`` in ``np`` plain interpreters writing to a file."""
    fn = tmp / "train.pkl"
    fn.write_bytes(cloudpickle.dumps((train, steps, work)))
    code = textwrap.dedent(f"""
        import os, pickle
        fn, steps, work = pickle.load(open({str(fn)!r}, "rb"))
        per_step = fn(steps, work)
        with open(os.environ["RESULT_FILE"], "w") as f:
            f.write(repr(per_step))
    """)
    procs = []
    for rank in range(np):
        with open(tmp / f"bare-{rank}.log", "w") as log:  # stdout and tqdm's stderr
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code], stdout=log, stderr=log,
                env={**os.environ, "RANK": str(rank), "RESULT_FILE": str(tmp / f"r{rank}")},
            ))
    for p in procs:
        p.wait()
    return statistics.mean(float((tmp / f"r{rank}").read_text()) for rank in range(np))


def overhead(steps: int, work: int, np: int, tmp: Path, repeats: int = 3) -> dict[str, Any]:
    # Alternate bare and nbdist runs and take the median ratio, so that a change in the
    # machine's load (other programs) hits both sides alike.
    pairs = []
    for _ in range(repeats):
        bare = _bare(steps, work, np, tmp)
        under = statistics.mean(nbdist.run(train, steps, work, np=np).results)
        pairs.append((bare, under))
    ratios = sorted(u / b for b, u in pairs)
    b, u = pairs[[u / b for b, u in pairs].index(ratios[len(ratios) // 2])]
    return {"bare_step_ms": b * 1000, "nbdist_step_ms": u * 1000,
            "overhead_pct": (u / b - 1) * 100, "all_pct": [(r - 1) * 100 for r in ratios]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small numbers, for a smoke test")
    parser.add_argument("--lines", type=int, default=None, help="lines per rank (throughput)")
    parser.add_argument("--np", type=int, default=4)
    args = parser.parse_args()
    n = args.lines or (20_000 if args.quick else 250_000)
    out: dict[str, Any] = {"np": args.np, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out["throughput"] = throughput(n, args.np, tmp)
        out["latency"] = latency(200 if args.quick else 1000, args.np, 0.005, tmp)
        out["overhead"] = overhead(100 if args.quick else 1000, 20_000, 2, tmp)
    t, lat, ov = out["throughput"], out["latency"], out["overhead"]
    print(f"throughput, {args.np} ranks x {n} lines:")
    print(f"  nbdist   {t['nbdist']['lines_per_s']:>12,.0f} lines/s   lost {t['lost']}")
    print(f"  devnull  {t['devnull']['lines_per_s']:>12,.0f} lines/s   "
          f"(nbdist = {t['ratio']:.2f} x /dev/null)")
    print(f"latency, {lat['lines']} lines: p50 {lat['p50_ms']:.1f} ms  p99 {lat['p99_ms']:.1f} ms"
          f"  max {lat['max_ms']:.1f} ms  lost {lat['lost']}")
    print(f"training overhead: bare {ov['bare_step_ms']:.3f} ms/step, nbdist "
          f"{ov['nbdist_step_ms']:.3f} ms/step ({ov['overhead_pct']:+.1f} %, median of "
          f"{', '.join(f'{x:+.1f}' for x in ov['all_pct'])})")
    goals = {
        "throughput >= 200k lines/s": t["nbdist"]["lines_per_s"] >= 200_000,
        "no line lost": t["lost"] == 0 and lat["lost"] == 0,
        "p99 latency < 50 ms": lat["p99_ms"] < 50,
        "training overhead <= 3 %": ov["overhead_pct"] <= 3,
    }
    for goal, ok in goals.items():
        print(f"  [{'met' if ok else 'MISSED'}] {goal}")
    out["goals"] = goals
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "streaming.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

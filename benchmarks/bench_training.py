"""Training-loop overhead: a loop that prints and updates a bar every step, nbdist vs bare.

The loop does a fixed amount of CPU work per step, prints a line and advances a tqdm bar on
every step; its time per step is measured inside each rank, so launch time is not part of it
(``bench_launch.py`` measures that). Contenders, interleaved, ``--reps`` times each:

- **bare** (baseline): the same function in ``--np`` plain ``python -c`` processes started
  together, stdout and stderr going to a file, as a bare launcher would run them. Python's
  default buffering applies (``PYTHONUNBUFFERED`` is removed from their environment: a file
  is block-buffered unless the user asks otherwise). Each starts in a session of its own, as
  nbdist's ranks do: with Linux's autogroup scheduling a session is a scheduling group, and
  on a machine shared with other work, ranks in one shared session would get less CPU than
  ranks in one session each, which is not what this measures.
- **nbdist**: ``nbdist.run(train, np=--np)``: output streamed to the driver, tqdm bridged to
  the panel's progress events.

With ``--charts`` (issue 16) the loop also reports its loss (``nbdist.report``, a no-op under
the bare launcher) and sets it as the bar's postfix (``set_postfix``, drawn into the bare
launcher's file) on every step, and the driver renders the panel's charts from the job's
series while it runs (``nbdist.views.charts.ChartsView``, polled ten times a second).

Reported: the median time per step of each (the mean over a run's ranks), and the median of
the per-pair ratios. Goal (issue 5): nbdist no more than 3 % slower.

    .venv/bin/python benchmarks/bench_training.py [--np 2] [--steps 1000] [--reps 7] [--quick]
        [--charts]
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
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle

import nbdist

ROOT = Path(__file__).resolve().parent.parent


def train(steps: int, work: int, charts: bool = False) -> tuple[float, float]:
    """``work`` units of CPU, a print and a tqdm update per step; (wall, CPU) s per step.
    ``charts``: the loss reported and set as the bar's postfix on every step too."""
    import time

    from tqdm import tqdm

    import nbdist

    def step_work() -> float:
        acc = 0.0
        for j in range(work):
            acc += (j * 0.5) ** 0.5
        return acc

    step_work()  # warm up
    start, cpu = time.perf_counter(), time.process_time()
    bar = tqdm(range(steps), desc="train")
    for step in bar:
        loss = step_work()
        print(f"step {step} loss {loss:.3f}")
        if charts:
            nbdist.report(loss=loss / (step + 1))
            bar.set_postfix(loss=loss / (step + 1), refresh=False)
    return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def bare(steps: int, work: int, np: int, tmp: Path, charts: bool) -> tuple[float, float]:
    """Mean (wall, CPU) seconds per step of ``train`` in ``np`` plain interpreters."""
    fn = tmp / "train.pkl"
    fn.write_bytes(cloudpickle.dumps((train, steps, work, charts)))
    code = textwrap.dedent(f"""
        import os, pickle
        fn, steps, work, charts = pickle.load(open({str(fn)!r}, "rb"))
        per_step = fn(steps, work, charts)
        with open(os.environ["RESULT_FILE"], "w") as f:
            f.write(repr(per_step))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    procs = []
    for rank in range(np):
        with open(tmp / f"bare-{rank}.log", "w") as log:  # stdout and tqdm's stderr
            procs.append(subprocess.Popen(
                [sys.executable, "-c", code], stdout=log, stderr=log, start_new_session=True,
                env={**env, "RANK": str(rank), "RESULT_FILE": str(tmp / f"r{rank}")},
            ))
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError(f"a bare rank failed; see {tmp / 'bare-0.log'}")
    results = [eval((tmp / f"r{rank}").read_text()) for rank in range(np)]
    return statistics.mean(w for w, _ in results), statistics.mean(c for _, c in results)


def under_nbdist(steps: int, work: int, np: int, charts: bool) -> tuple[float, float]:
    job = nbdist.run(train, steps, work, charts, np=np, gpu=False)  # CPU ranks, GPUs or not
    if charts:  # the panel's charts, drawn in this (the driver's) process meanwhile
        from nbdist.views.charts import ChartsView

        view = ChartsView(job.state.series)

        def draw() -> None:
            while not job.done():
                with job.state.lock:
                    view.render()
                time.sleep(0.1)  # the panel's pace, not a wait for anything

        drawer = threading.Thread(target=draw)
        drawer.start()
    results = job.results
    if charts:
        drawer.join()
        assert view.redraws > 0 and job.state.series.names() == ["loss"]
    return statistics.mean(w for w, _ in results), statistics.mean(c for _, c in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--work", type=int, default=20_000, help="CPU work per step")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument("--charts", action="store_true",
                        help="report a metric every step and draw the charts meanwhile")
    args = parser.parse_args()
    steps = args.steps or (200 if args.quick else 1000)
    reps = args.reps or (3 if args.quick else 7)
    pairs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(reps):  # interleaved: a change in the machine's load hits both sides
            (bw, bc), (nw, nc) = bare(steps, args.work, args.np, Path(d), args.charts), \
                under_nbdist(steps, args.work, args.np, args.charts)
            pairs.append({"bare": bw, "nbdist": nw, "bare_cpu": bc, "nbdist_cpu": nc})
            print(f"bare {bw * 1000:.3f} ms/step, nbdist {nw * 1000:.3f} ms/step "
                  f"({(nw / bw - 1) * 100:+.1f} %)", flush=True)
    med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0]}
    ratios = sorted(p["nbdist"] / p["bare"] for p in pairs)
    overhead = (statistics.median(ratios) - 1) * 100
    result: dict[str, Any] = {
        "np": args.np, "steps": steps, "work": args.work, "reps": reps, "charts": args.charts,
        "bare_ms_per_step": med["bare"] * 1000, "nbdist_ms_per_step": med["nbdist"] * 1000,
        "bare_cpu_ms_per_step": med["bare_cpu"] * 1000,
        "nbdist_cpu_ms_per_step": med["nbdist_cpu"] * 1000,
        "overhead_pct": overhead, "all_pct": [(r - 1) * 100 for r in ratios],
        "goal_met": overhead <= 3.0,
    }
    text = (
        "| contender | time per step (median) | rank CPU per step | vs bare |\n"
        "| --- | --- | --- | --- |\n"
        f"| bare launcher, output to a file | {med['bare'] * 1000:.3f} ms | "
        f"{med['bare_cpu'] * 1000:.3f} ms | 1.00× |\n"
        f"| **nbdist** | **{med['nbdist'] * 1000:.3f} ms** | {med['nbdist_cpu'] * 1000:.3f} ms | "
        f"**{1 + overhead / 100:.3f}×** |\n\n"
        f"{args.np} ranks × {steps} steps, a print and a tqdm update per step"
        f"{' (and a reported metric, a postfix and the charts drawn)' if args.charts else ''}"
        f"; median of {reps} "
        f"interleaved pairs; per-pair overheads: "
        f"{', '.join(f'{x:+.1f} %' for x in result['all_pct'])}. "
        f"Goal ≤ 3 %: {'met' if result['goal_met'] else 'MISSED'}.\n"
    )
    print("\n" + text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "training-charts" if args.charts else "training"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

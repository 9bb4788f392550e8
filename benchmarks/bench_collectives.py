"""The flight recorder's costs and ``%dist_check``'s time (issue 40).

1. **The recorder's cost on a CPU DDP loop.** 2 local ranks train a small MLP with DDP (gloo)
   for ``--steps`` steps; steps/s with the recorder on (``TORCH_FR_BUFFER_SIZE=256``, the
   default) against off (``0``), interleaved, median of ``--reps``. Goal: ≥ 0.99×.
2. **From a cancel to the collectives line on 8 ranks.** 8 local ranks, 7 waiting in
   all_reduce #3 and one that never entered it; the time from ``job.cancel()`` (the same
   forensics a timeout takes) to the job's state holding the ``collectives:`` line. Goal: ≤ 2 s.
   Baseline in the same run: the job's start (``nbdist.run`` to every rank's first line).
3. **``%dist_check -np 4``** on CPU (gloo, the sweep 1 KB–4 MB): wall time of
   ``check.run_check(-4)``, the first run (it may start the zygote) and the median of the
   next ``--reps``. Goal: < 10 s.

    .venv/bin/python benchmarks/bench_collectives.py [--quick]

Results: ``benchmarks/results/collectives.json`` and ``.md``. Goals are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import nbdist
from nbdist import check

ROOT = Path(__file__).resolve().parent.parent


def _ddp_loop(steps: int) -> float:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    for _ in range(20):  # warm-up
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    dist.barrier()
    return steps / (time.perf_counter() - t)


def recorder_cost(steps: int, reps: int) -> dict[str, Any]:
    on: list[float] = []
    off: list[float] = []
    for _ in range(reps):
        for size, into in (("256", on), ("0", off)):
            job = nbdist.run(_ddp_loop, steps, np=2, backend="local",
                             env={"TORCH_FR_BUFFER_SIZE": size})
            into.append(min(job.results))
    return {"steps": steps, "on_steps_per_s": statistics.median(on),
            "off_steps_per_s": statistics.median(off),
            "ratio": statistics.median(on) / statistics.median(off), "on": on, "off": off}


def _hung(gate: str) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.ones(1000)
    dist.all_reduce(x)
    dist.all_reduce(x)
    print("two done", flush=True)
    if dist.get_rank() == 3:
        while not os.path.exists(gate):
            time.sleep(0.05)
    dist.all_reduce(x)


def cancel_to_line(np: int, tmp: Path) -> dict[str, Any]:
    gate = tmp / "gate"
    t0 = time.perf_counter()
    job = nbdist.run(_hung, str(gate), np=np, backend="local")
    while sum(r.lines >= 1 for r in job.state.ranks) < np:
        time.sleep(0.005)
    started = time.perf_counter() - t0
    time.sleep(0.5)  # let the seven enter all_reduce #3
    t = time.perf_counter()
    threading.Thread(target=job.cancel, daemon=True).start()
    while "collectives:" not in job.state.forensics and time.perf_counter() - t < 30:
        time.sleep(0.002)
    took = time.perf_counter() - t
    line = next((ln for ln in job.state.forensics.splitlines() if "collectives:" in ln), "")
    job.wait(30)
    return {"ranks": np, "seconds": took, "job_start_s": started, "line": line}


def check_time(np: int, reps: int) -> dict[str, Any]:
    times = []
    problems: list[str] = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        got = check.run_check(-np)
        times.append(time.perf_counter() - t)
        problems = got.problems
    return {"ranks": np, "first_s": times[0], "median_s": statistics.median(times[1:]),
            "all_s": times, "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small numbers, for a smoke test")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    steps = args.steps or (300 if args.quick else 2000)
    cost = recorder_cost(steps, reps)
    print(f"recorder on/off: {cost['ratio']:.3f}×", flush=True)
    with tempfile.TemporaryDirectory() as d:
        line = cancel_to_line(8, Path(d))
    print(f"cancel → collectives line, 8 ranks: {line['seconds']:.2f} s", flush=True)
    chk = check_time(4, max(1, reps // 2))
    print(f"%dist_check -np 4: {chk['median_s']:.2f} s", flush=True)
    goals = {"recorder costs <= 1 % steps/s": cost["ratio"] >= 0.99,
             "collectives line <= 2 s after the cancel/timeout on 8 ranks":
                 line["seconds"] <= 2.0,
             "%dist_check -np 4 < 10 s": chk["median_s"] < 10.0}
    text = "\n".join([
        "| measurement | result | baseline (same run) | ratio |",
        "| --- | --- | --- | --- |",
        f"| DDP loop, 2 CPU ranks, recorder on (256) | {cost['on_steps_per_s']:,.0f} steps/s "
        f"| recorder off: {cost['off_steps_per_s']:,.0f} steps/s | {cost['ratio']:.3f}× |",
        f"| cancel → `collectives:` line, 8 ranks hung in all_reduce #3 | "
        f"{line['seconds']:.2f} s | the job's start: {line['job_start_s']:.2f} s | "
        f"{line['seconds'] / line['job_start_s']:.2f}× |",
        f"| `%dist_check -np 4` (CPU, sweep 1 KB–4 MB) | {chk['median_s']:.2f} s | first "
        f"run: {chk['first_s']:.2f} s | - |",
    ]) + "\n\n" + "".join(f"- [{'met' if ok else 'MISSED'}] {g}\n" for g, ok in goals.items())
    text += (f"\nmedian of {reps} (recorder, {steps} steps per run); {os.cpu_count()} cores; "
             f"the line: `{line['line'][:160]}`\n")
    print("\n" + text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "collectives.json").write_text(json.dumps(
        {"cpus": os.cpu_count(), "recorder": cost, "cancel_to_line": line, "check": chk,
         "goals": goals}, indent=2))
    (results / "collectives.md").write_text(text)


if __name__ == "__main__":
    main()

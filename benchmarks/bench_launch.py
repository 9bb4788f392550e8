"""Launch and training benchmark: nbdist against what users would pick instead.

Scenarios (np = 2, CPU, gloo: every nbdist job says ``gpu=False``, so that they run the same
on a machine with GPUs, where ``gpu`` defaults to on), every contender interleaved in each
repetition, medians reported with the ratio to the baseline measured in the same run (the GPU
scenarios are ``bench_gpu.py``'s):

1. **launch, local** — a trivial job (``import torch``, ``init_process_group("gloo")``, return
   the rank), cold: nbdist local (no zygote or warm interpreter left from an earlier job; also
   with ``NBDIST_ZYGOTE=0``, every rank a fresh interpreter) vs ``torch.multiprocessing.spawn``
   from a parent that already imported torch (baseline) vs TorchDistributor(local_mode=True)
   vs accelerate's ``notebook_launcher``.
2. **launch, Spark** — the same on a warm ``local[2]`` SparkSession: nbdist's Spark backend vs
   TorchDistributor(local_mode=False) (baseline).
3. **second run** — the trivial job again right after the first, as a user iterating does:
   nbdist (ranks forked from the first run's zygote; and with ``NBDIST_ZYGOTE=0``, warm
   interpreters started when the first run ended) vs nbdist cold (baseline) vs mp.spawn.
4. **training** — a small DDP training, 200 steps, each printing a line and advancing a tqdm
   bar, end to end: nbdist (cold and warm) vs mp.spawn (baseline).
5. **first cell of a fresh kernel** — a new IPython shell in a process of its own loads nbdist,
   waits 5 s (while a tiny cell runs every 20 ms: its latency is the kernel's responsiveness
   while the zygote warms), then runs the trivial job with a barrier (``synced``, also in
   6 and 7: ranks that start warm are quick enough for gloo's race between rank 0 leaving and
   rank 1 still connecting): with the zygote started at load
   (``warm_at_load``, the default) and without, vs ``mp.spawn`` (baseline). The zygote's
   memory (RSS, PSS) is read once it has imported torch and numpy.
6. **Spark, later runs** — ``local[2]``: nbdist with ranks forked from the executor's zygote
   (left by an earlier run of the application) and with ``NBDIST_ZYGOTE=0`` (fresh ranks, the
   old path) vs TorchDistributor(local_mode=False) (baseline).
7. **Spark, first run** — no executor zygote yet (killed before each run): nbdist, which leaves
   one behind once its fresh ranks' code returned, vs the old path, ``NBDIST_ZYGOTE=0``
   (baseline).

Usage::

    .venv/bin/python benchmarks/bench_launch.py [--reps 5] [--quick] [--no-spark] [--only 5,6,7]

TorchDistributor needs numpy, ``pandas<3`` and pyarrow (``pip install -e '.[bench]'``); a
contender that cannot run here is reported as such, not dropped silently.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

import nbdist
from nbdist.launch import local

ROOT = Path(__file__).resolve().parent.parent
STEPS = 200


# -- what every contender runs -----------------------------------------------------------------
def trivial() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def synced() -> int:
    """``trivial`` with a barrier before the group is destroyed (scenarios 5-7): ranks forked
    warm are so quick that rank 0 could close the group while rank 1 still connects to it
    (gloo: "Connection closed by peer")."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return rank


def training(steps: int = STEPS) -> float:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    loss = torch.zeros(())
    for step in tqdm(range(steps), mininterval=0.1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    value = float(loss.item())
    del model, opt
    dist.destroy_process_group()
    return value


def _spawned(index: int, fn: Callable[[], Any], port: int) -> None:
    os.environ.update(RANK=str(index), WORLD_SIZE="2", LOCAL_RANK=str(index),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn()


# -- contenders --------------------------------------------------------------------------------
def nbdist_cold(fn: Callable[[], Any], zygote: bool = True) -> None:
    local.pool.clear()
    with zygotes(zygote):
        nbdist.run(fn, np=2, backend="local", gpu=False).result()
    local.pool.clear()  # the next contender must not pay for our warm-up in the background


@contextlib.contextmanager
def zygotes(on: bool) -> Iterator[None]:
    """With ranks forked from a zygote (the default), or all fresh (``NBDIST_ZYGOTE=0``)."""
    saved, local.ZYGOTE = local.ZYGOTE, on and local.ZYGOTE
    try:
        yield
    finally:
        local.ZYGOTE = saved


def spawn(fn: Callable[[], Any]) -> None:
    from nbdist.channel import free_port

    mp.spawn(_spawned, args=(fn, free_port()), nprocs=2)  # type: ignore[attr-defined]


def torch_distributor(local_mode: bool) -> Callable[[Callable[[], Any]], None]:
    def go(fn: Callable[[], Any]) -> None:
        from pyspark.ml.torch.distributor import TorchDistributor

        TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(fn)

    return go


def notebook_launcher(fn: Callable[[], Any]) -> None:
    from accelerate import notebook_launcher as launch

    from nbdist.channel import free_port

    launch(fn, num_processes=2, use_port=str(free_port()))


def nbdist_spark(fn: Callable[[], Any]) -> None:
    nbdist.run(fn, np=2, backend="spark", gpu=False).result()


# -- measuring ---------------------------------------------------------------------------------
def timed(run: Callable[[Callable[[], Any]], None], fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run(fn)
    return time.perf_counter() - start


def scenario(
    name: str, contenders: dict[str, Callable[[], float]], baseline: str, reps: int
) -> dict[str, Any]:
    times: dict[str, list[float]] = {c: [] for c in contenders}
    errors: dict[str, str] = {}
    for _ in range(reps):
        for label, measure in contenders.items():
            if label in errors:
                continue
            try:
                times[label].append(measure())
            except Exception as exc:  # a contender that cannot run here is reported
                errors[label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                traceback.print_exc()
    medians = {c: statistics.median(t) for c, t in times.items() if t}
    base = medians.get(baseline)
    rows = []
    for label in contenders:
        if label in medians:
            ratio = f"{medians[label] / base:.2f}×" if base else "n/a"
            rows.append((label, f"{medians[label]:.2f} s", ratio, len(times[label])))
        else:
            rows.append((label, "could not run", errors.get(label, ""), 0))
    return {"scenario": name, "baseline": baseline, "rows": rows, "samples": times,
            "errors": errors}


def second_run(fn: Callable[[], Any], pause: float = 0.0, zygote: bool = True) -> float:
    """The same job run again ``pause`` s after a first run: what a user iterating waits for.

    The pause (not timed) stands for reading the result and editing the cell. A zygote is
    warm when the first run ends; warm interpreters (``zygote=False``) are started then and
    need about one ``import torch`` to be ready.
    """
    local.pool.clear()
    with zygotes(zygote):
        nbdist.run(fn, np=2, backend="local", gpu=False).result()
        local.pool.wait_ready(timeout=pause)
        start = time.perf_counter()
        nbdist.run(fn, np=2, backend="local", gpu=False).result()
        elapsed = time.perf_counter() - start
    local.pool.clear()
    return elapsed


# -- warm everywhere (scenarios 5-7) -----------------------------------------------------------
@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fresh_kernel(warm: bool) -> dict[str, Any]:
    """Scenario 5, in a process of its own (``--fresh-kernel``): its figures as JSON."""
    import subprocess

    env = {**os.environ, "NBDIST_WARM_AT_LOAD": "1" if warm else "0"}
    proc = subprocess.run([sys.executable, __file__, "--fresh-kernel"], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the fresh kernel failed: {proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _fresh_kernel_child() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    start = time.perf_counter()
    shell.run_line_magic("load_ext", "nbdist")
    load_s = time.perf_counter() - start
    latencies = []
    end = time.monotonic() + 5.0
    while time.monotonic() < end:  # the user reads data meanwhile: the kernel must answer
        t = time.perf_counter()
        shell.run_cell("_x = sum(range(20000))", silent=True)
        latencies.append(time.perf_counter() - t)
        time.sleep(0.02)
    memory = {}
    for pid in local.pool.pids():
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("Rss", "Pss"):
                    memory[name] = int(rest.split()[0]) / 1024  # MB
    ready = local.pool.wait_ready(0) and bool(local.pool.pids())
    start = time.perf_counter()
    nbdist.run(synced, np=2, backend="local", gpu=False).result()
    first = time.perf_counter() - start
    latencies.sort()
    print(json.dumps({"first": first, "load_s": load_s, "memory_mb": memory, "ready": ready,
                      "cell_ms_median": 1000 * statistics.median(latencies),
                      "cell_ms_p99": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
                      "cell_ms_max": 1000 * latencies[-1]}))
    local.pool.clear()


def executor_zygotes() -> list[int]:
    import psutil

    from nbdist.rank import executor_zygote

    found = []
    for proc in psutil.process_iter():
        try:
            if executor_zygote.COMMAND in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            pass
    return found


def kill_executor_zygotes() -> None:
    """As if the application had just started on its executors: no zygote there yet."""
    import psutil

    procs = []
    for pid in executor_zygotes():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
    psutil.wait_procs(procs, timeout=30)


def spark_first(zygote: bool) -> float:
    kill_executor_zygotes()
    with environ(NBDIST_ZYGOTE="1" if zygote else "0"):
        elapsed = timed(nbdist_spark, synced)
    kill_executor_zygotes()  # its imports must not run beside the next contender
    return elapsed


FORKED: list[bool] = []  # whether every rank of a "later run" was forked from the zygote


def spark_later(zygote: bool) -> float:
    from nbdist import timeline

    with environ(NBDIST_ZYGOTE="1" if zygote else "0"):
        start = time.perf_counter()
        job = nbdist.run(synced, np=2, backend="spark", gpu=False)
        job.result()
        elapsed = time.perf_counter() - start
    if zygote:
        FORKED.append(all(timeline.FORKED in r.marks for r in job.state.ranks))
    return elapsed


def warm_scenarios(spark: Any, reps: int) -> list[dict[str, Any]]:
    side: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}

    def kernel(warm: bool) -> float:
        figures = fresh_kernel(warm)
        side["warm" if warm else "cold"].append(figures)
        return float(figures["first"])

    results = [scenario(
        "5. first cell of a fresh kernel, nbdist loaded 5 s earlier, np=2",
        {"mp.spawn": lambda: timed(spawn, synced),
         "nbdist, zygote started at load (default)": lambda: kernel(True),
         "nbdist, NBDIST_WARM_AT_LOAD=0": lambda: kernel(False)},
        "mp.spawn", reps,
    )]
    results[0]["kernel"] = side
    for name, figures in side.items():
        if figures:
            keys = ("cell_ms_median", "cell_ms_p99", "cell_ms_max", "load_s")
            med: dict[str, Any] = {k: round(statistics.median(f[k] for f in figures), 3)
                                   for k in keys}
            med["zygote_ready_at_cell"] = sum(bool(f.get("ready")) for f in figures)
            mem = [f["memory_mb"] for f in figures if f["memory_mb"]]
            if mem:
                med.update({f"zygote_{k}_mb": round(statistics.median(m[k] for m in mem))
                            for k in ("Rss", "Pss")})
            results[0]["rows"].append((f"(kernel while loading, {name})", json.dumps(med), "",
                                       len(figures)))
    if spark is None:
        return results
    nbdist_spark(synced)  # the application's executor zygote, for the later runs
    nbdist_spark(synced)
    results.append(scenario(
        "6. Spark local[2], later runs of the application, np=2",
        {"TorchDistributor local_mode=False": lambda: timed(torch_distributor(False), synced),
         "nbdist spark, ranks forked from the executor's zygote": lambda: spark_later(True),
         "nbdist spark, NBDIST_ZYGOTE=0 (fresh ranks: the old path)":
             lambda: spark_later(False)},
        "TorchDistributor local_mode=False", reps,
    ))
    results[-1]["rows"].append(("(later runs with every rank forked)",
                                f"{sum(FORKED)} of {len(FORKED)}", "", len(FORKED)))
    results.append(scenario(
        "7. Spark local[2], first run (no executor zygote yet), np=2",
        {"nbdist spark, NBDIST_ZYGOTE=0 (the old path)": lambda: spark_first(False),
         "nbdist spark, leaving a zygote behind": lambda: spark_first(True)},
        "nbdist spark, NBDIST_ZYGOTE=0 (the old path)", reps,
    ))
    return results


def save(name: str, results: list[dict[str, Any]]) -> None:
    """Print the tables; write them to ``benchmarks/results/<name>.md`` and ``.json``."""
    text = markdown(results)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=str))


def markdown(results: list[dict[str, Any]]) -> str:
    out = []
    for res in results:
        out.append(f"### {res['scenario']} (baseline: {res['baseline']})\n")
        out.append("| contender | median | vs baseline | runs |")
        out.append("| --- | --- | --- | --- |")
        out.extend(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in res["rows"])
        out.append("")
    return "\n".join(out)


def start_spark() -> Any:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("nbdist-bench")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.parallelize([1, 2], 2).count()  # warm
    return spark


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repetitions, fewer contenders")
    parser.add_argument("--no-spark", action="store_true", help="skip Spark and TorchDistributor")
    parser.add_argument("--only", help="comma-separated scenarios: 1-4 (the classic set), "
                        "5,6,7 (warm everywhere); default: all")
    parser.add_argument("--fresh-kernel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fresh_kernel:
        _fresh_kernel_child()
        return 0
    reps = 2 if args.quick else args.reps
    only = set((args.only or "1,2,3,4,5,6,7").replace("1-4", "1,2,3,4").split(","))
    spark = None if args.no_spark else start_spark()
    if not only & {"1", "2", "3", "4"}:
        results = warm_scenarios(spark, reps)
        if spark is not None:
            spark.stop()
        save("launch-warm", results)
        return 0

    def use(run: Callable[[Callable[[], Any]], None], fn: Callable[[], Any]) -> Callable[[], float]:
        return lambda: timed(run, fn)

    launch = {"mp.spawn": use(spawn, trivial), "nbdist local (cold)": use(nbdist_cold, trivial),
              "nbdist local (cold), NBDIST_ZYGOTE=0": use(partial(nbdist_cold, zygote=False),
                                                          trivial)}
    if spark is not None:
        launch["TorchDistributor local_mode=True"] = use(torch_distributor(True), trivial)
    if not args.quick:
        launch["accelerate notebook_launcher"] = use(notebook_launcher, trivial)
    results = [scenario("1. launch overhead, local, np=2", launch, "mp.spawn", reps)]
    if spark is not None:
        results.append(scenario(
            "2. launch overhead, Spark local[2], np=2",
            {"TorchDistributor local_mode=False": use(torch_distributor(False), trivial),
             "nbdist spark": use(nbdist_spark, trivial)},
            "TorchDistributor local_mode=False", reps,
        ))
    results.append(scenario(
        "3. second run of the same cell, local, np=2",
        {"nbdist local (cold)": use(nbdist_cold, trivial),
         "nbdist local, second run at once": lambda: second_run(trivial),
         "nbdist local, second run once warm (≤ 5 s later)": lambda: second_run(trivial, 5.0),
         "NBDIST_ZYGOTE=0: second run at once": lambda: second_run(trivial, zygote=False),
         "NBDIST_ZYGOTE=0: second run once warm (≤ 5 s later)":
             lambda: second_run(trivial, 5.0, zygote=False),
         "mp.spawn": use(spawn, trivial)},
        "nbdist local (cold)", reps,
    ))
    results.append(scenario(
        f"4. DDP training, {STEPS} steps with a print and a tqdm bar each, np=2",
        {"mp.spawn": use(spawn, training), "nbdist local (cold)": use(nbdist_cold, training),
         "nbdist local, second run at once": lambda: second_run(training),
         "nbdist local, second run once warm (≤ 5 s later)": lambda: second_run(training, 5.0)},
        "mp.spawn", reps,
    ))
    if only & {"5", "6", "7"}:
        results.extend(warm_scenarios(spark, reps))
    if spark is not None:
        spark.stop()
    save("launch", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU benchmark: nbdist's warm path on a CUDA machine, against torchrun and a plain process.

Every figure is a median with its ratio to a baseline measured in the same run, contenders
interleaved; the card, its driver, torch and CUDA are recorded with the results. The process
running this plays the notebook's kernel: it never initialises CUDA itself (the card is read
with ``nvidia-smi``).

1. **first CUDA cell** — a new IPython shell in a process of its own loads nbdist, waits 5 s,
   then runs one CUDA op on one rank (``%%distributed -np 1 --gpu``); against the same op under
   ``torchrun --nproc-per-node 1`` (baseline) and a plain ``python`` process. Goal ≤ 0.3×
   torchrun. How the rank started (forked from the zygote or not, and why) is recorded.
2. **back-to-back CUDA jobs** — ``nbdist.run(op, np=1, gpu=True)`` ``--chain`` times in a row,
   each the moment the last one returned, then once more after a 4 s pause; against a plain
   process doing the op (baseline). Goal ≤ 0.7 s every time (the H100 run before this work:
   10.2 s, 3.9 s, 0.62 s after a pause, 4.47 s).
3. **NCCL DDP job** — ``init_process_group("nccl")`` on every GPU (at most 8), DDP over a small
   model, 50 steps; nbdist against torchrun (baseline). Where its time goes: inside the rank
   (``import torch``, CUDA context, ``init_process_group``, DDP's first broadcast, which builds
   NCCL's communicator, the steps, ``destroy_process_group``) for both, and nbdist's launch
   timeline phases (``%dist_status JOB --timeline``).
4. **training throughput** — bf16, 4 × Linear(4096), batch 2048, ``--steps`` steps with a
   ``print`` and a tqdm bar every step (``--print-every`` to change), steps/s measured inside
   the loop after 20 warm-up steps: a plain process (baseline for nbdist.run on one GPU) and
   ``nbdist.run``; DDP (NCCL) under torchrun (baseline) and under nbdist. Goal ≥ 0.99×.

Usage::

    .venv/bin/python benchmarks/bench_gpu.py [--reps 3] [--quick] [--only 1,2,3,4] [--out DIR]

Without a GPU (``nvidia-smi`` lists none) it says so and exits 0 with nothing measured. Results:
``<out>/gpu.json`` and ``gpu.md`` (default ``benchmarks/results``). The module imports only the
standard library at its top: ``--worker NAME`` runs one job function in a plain process or under
torchrun without nbdist.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()
#: The model of scenario 4: the issue's measurement (bf16, 4 × Linear(4096), batch 2048).
WIDTH, LAYERS, BATCH = 4096, 4, 2048
#: Where the jobs run: "cuda", or "cpu" for ``--smoke`` (the same code paths on CPU ranks, gloo
#: and a small model: this script checked on a machine without a GPU).
KIND = "cuda"


# -- the card --------------------------------------------------------------------------------------
def card() -> dict[str, Any]:
    """The GPUs, their driver, torch and CUDA as this machine has them; no CUDA is started."""
    smi = shutil.which("nvidia-smi")
    info: dict[str, Any] = {"gpus": [], "driver": None, "python": sys.version.split()[0],
                            "cores": os.cpu_count()}
    try:
        import torch

        info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    if smi is None:
        return info
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total,pci.bus_id",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return info
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4:
            info["gpus"].append({"name": fields[0], "memory": fields[2], "bus": fields[3]})
            info["driver"] = fields[1]
    return info


# -- the jobs (imports inside: each runs in a rank, a plain process or under torchrun) ------------
def cuda_op(kind: str = "cuda") -> float:
    """One CUDA op on this process's GPU (LOCAL_RANK): what a first cell on a GPU does.
    (``kind`` "cpu": the same on the CPU, for ``--smoke``.)"""
    import os

    import torch

    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", "0"))) if kind == "cuda" \
        else torch.device("cpu")
    return float((torch.ones(1024, device=device) * 2).sum().item())


def ddp_job(steps: int = 50, kind: str = "cuda") -> dict[str, float]:
    """A small NCCL DDP training; the seconds each part took inside the rank."""
    import time

    t0 = time.perf_counter()
    import os

    import torch
    import torch.distributed as dist

    parts: dict[str, float] = {}
    clock = [t0]

    def lap(name: str) -> None:
        now = time.perf_counter()
        parts[name] = now - clock[0]
        clock[0] = now

    lap("import torch")
    cuda = kind == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.ones(1, device="cuda").sum().item()
    lap("CUDA context")
    dist.init_process_group("nccl" if cuda else "gloo")  # NCCL's communicator comes later
    lap("init_process_group")
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(kind),
        device_ids=[local_rank] if cuda else None)
    if cuda:
        torch.cuda.synchronize()
    lap("DDP (NCCL communicator, broadcast)")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 1024, device=kind)
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize()
    lap("steps")
    dist.destroy_process_group()
    lap("destroy_process_group")
    parts["rank function"] = time.perf_counter() - t0
    return parts


def train(steps: int, print_every: int, ddp: bool, kind: str = "cuda",
          width: int = WIDTH) -> dict[str, float]:
    """The issue's loop: bf16, 4 × Linear(4096), batch 2048; a print and a tqdm bar every
    ``print_every`` steps; steps/s after 20 warm-up steps."""
    import os
    import time

    import torch
    from tqdm import tqdm

    cuda = kind == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    model: Any = torch.nn.Sequential(
        *[torch.nn.Linear(width, width) for _ in range(LAYERS)]).to(kind).to(torch.bfloat16)
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo")
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH if cuda else 64, width, device=kind, dtype=torch.bfloat16)
    warm = 20
    start = 0.0
    bar = tqdm(range(warm + steps), mininterval=0.1)
    for step in bar:
        if step == warm:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        opt.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        if step % print_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    rate = steps / (time.perf_counter() - start)
    if ddp:
        torch.distributed.destroy_process_group()
    return {"steps_per_s": rate}


WORKERS: dict[str, Callable[..., Any]] = {"cuda_op": cuda_op, "ddp_job": ddp_job, "train": train}


def worker(name: str, args: list[str]) -> None:
    """``--worker NAME [JSON args]``: run a job function here (a plain process, or a rank of
    torchrun); rank 0 prints its value as the last line, as JSON."""
    value = WORKERS[name](*json.loads(args[0] if args else "[]"))
    if os.environ.get("RANK", "0") == "0":
        print("RESULT " + json.dumps(value), flush=True)


# -- contenders --------------------------------------------------------------------------------
def _result(out: str) -> Any:
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"no result in its output: {out[-2000:]}")


def plain(name: str, *args: Any) -> tuple[float, Any]:
    """The job in a fresh ``python`` process: (wall seconds, its value)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE), "--worker", name, json.dumps(args)],
                          capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"plain {name} failed: {proc.stderr[-2000:]}")
    return elapsed, _result(proc.stdout)


def torchrun(name: str, np: int, *args: Any) -> tuple[float, Any]:
    """The job under ``torchrun --standalone --nproc-per-node np``: (wall seconds, rank 0's
    value)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={np}", str(HERE), "--worker", name, json.dumps(args)],
        capture_output=True, text=True, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"torchrun {name} failed: {proc.stderr[-2000:]}")
    return elapsed, _result(proc.stdout)


def under_nbdist(fn: Callable[..., Any], np: int, *args: Any) -> tuple[float, Any, Any]:
    """The job as ``nbdist.run(fn, *args, np=np, gpu=True)``: (wall seconds, rank 0's value,
    the job)."""
    import nbdist

    start = time.perf_counter()
    job = nbdist.run(fn, *args, np=np, gpu=KIND == "cuda", backend="local")
    value = job.result(timeout=600)
    return time.perf_counter() - start, value, job


def starts(job: Any) -> list[str]:
    """How each rank of ``job`` started, and why not from the zygote."""
    from nbdist.views.status import start_lines

    return start_lines(job.state, forked=True)


def phases(job: Any) -> dict[str, float]:
    """nbdist's launch timeline of ``job``: the median of each phase over its ranks."""
    from nbdist.views.timeline import TimelineReport

    return dict(TimelineReport(job.state).medians())


# -- scenarios -----------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def first_cell_child() -> None:
    """Scenario 1 in a fresh shell (``--first-cell``): its figures as JSON on the last line."""
    from IPython.core.interactiveshell import InteractiveShell

    from nbdist import job as jobs

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    time.sleep(5.0)  # the user reads the data meanwhile; the zygote warms at nice 19
    start = time.perf_counter()
    gpu = "--gpu" if KIND == "cuda" else "--no-gpu"
    result = shell.run_cell(f"%%distributed -np 1 {gpu} --quiet\nimport os, torch\n"
                            f"float((torch.ones(1024, device='{KIND}') * 2).sum().item())")
    elapsed = time.perf_counter() - start
    if not result.success:
        raise SystemExit(f"the cell failed: {result.error_in_exec!r}")
    job = jobs.get_job()
    print(json.dumps({"seconds": elapsed, "value": result.result,
                      "starts": starts(job), "phases": phases(job)}))


def first_cell(reps: int) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"torchrun": [], "plain python": [], "nbdist": []}
    notes: list[Any] = []
    for _ in range(reps):
        samples["torchrun"].append(torchrun("cuda_op", 1, KIND)[0])
        samples["plain python"].append(plain("cuda_op", KIND)[0])
        smoke = ["--smoke"] if KIND != "cuda" else []
        proc = subprocess.run([sys.executable, str(HERE), "--first-cell", *smoke],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise RuntimeError(f"the fresh kernel failed: {proc.stderr[-2000:]}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        samples["nbdist"].append(child["seconds"])
        notes.append({"starts": child["starts"], "phases": child["phases"]})
    base = _med(samples["torchrun"])
    return {"scenario": "1. first CUDA cell, 5 s after %load_ext", "baseline": "torchrun",
            "rows": [(k, _med(v), _med(v) / base, len(v)) for k, v in samples.items()],
            "samples": samples, "notes": notes,
            "goal": "nbdist ≤ 0.3× torchrun", "met": _med(samples["nbdist"]) <= 0.3 * base}


def back_to_back(reps: int, chain: int) -> dict[str, Any]:
    from nbdist.launch import local

    samples: dict[str, list[float]] = {"plain python": [], "nbdist, first of the chain": [],
                                       "nbdist, back to back": [], "nbdist, after a 4 s pause": []}
    runs: list[list[float]] = []
    notes: list[Any] = []
    for _ in range(reps):
        samples["plain python"].append(plain("cuda_op", KIND)[0])
        local.pool.clear()  # each chain starts as a fresh kernel's first GPU job would
        chain_times = []
        for i in range(chain):
            elapsed, _, job = under_nbdist(cuda_op, 1, KIND)
            chain_times.append(elapsed)
            notes.append(starts(job))
            samples["nbdist, first of the chain" if i == 0 else "nbdist, back to back"].append(
                elapsed)
        time.sleep(4.0)
        elapsed, _, job = under_nbdist(cuda_op, 1, KIND)
        chain_times.append(elapsed)
        notes.append(starts(job))
        samples["nbdist, after a 4 s pause"].append(elapsed)
        runs.append(chain_times)
        local.pool.clear()
    base = _med(samples["plain python"])
    later = samples["nbdist, back to back"] + samples["nbdist, after a 4 s pause"]
    return {"scenario": f"2. back-to-back CUDA jobs, np=1 ({chain} in a row, then a pause)",
            "baseline": "plain python",
            "rows": [(k, _med(v), _med(v) / base, len(v)) for k, v in samples.items()],
            "samples": samples, "chains": runs, "notes": notes,
            "goal": "every job after the first ≤ 0.7 s",
            "met": bool(later) and max(later) <= 0.7}


def ddp(reps: int, np: int) -> dict[str, Any]:
    steps = 50 if KIND == "cuda" else 3
    samples: dict[str, list[float]] = {"torchrun": [], "nbdist": []}
    inside: dict[str, list[dict[str, float]]] = {"torchrun": [], "nbdist": []}
    timelines: list[dict[str, float]] = []
    notes: list[Any] = []
    for _ in range(reps):
        elapsed, parts = torchrun("ddp_job", np, steps, KIND)
        samples["torchrun"].append(elapsed)
        inside["torchrun"].append(parts)
        elapsed, parts, job = under_nbdist(ddp_job, np, steps, KIND)
        samples["nbdist"].append(elapsed)
        inside["nbdist"].append(parts)
        timelines.append(phases(job))
        notes.append(starts(job))
    base = _med(samples["torchrun"])
    where = {who: {k: _med([p[k] for p in ps]) for k in ps[0]} for who, ps in inside.items()
             if ps}
    names = list(dict.fromkeys(k for t in timelines for k in t))  # in the phases' order
    return {"scenario": f"3. NCCL DDP job, {np} rank(s), {steps} steps", "baseline": "torchrun",
            "rows": [(k, _med(v), _med(v) / base, len(v)) for k, v in samples.items()],
            "samples": samples, "inside": where, "notes": notes,
            "timeline": {k: _med([t[k] for t in timelines if k in t]) for k in names}}


def training(reps: int, steps: int, print_every: int, np: int) -> dict[str, Any]:
    width = WIDTH if KIND == "cuda" else 64
    one = (steps, print_every, False, KIND, width)
    many = (steps, print_every, True, KIND, width)
    samples: dict[str, list[float]] = {
        "plain python, 1 GPU": [], "nbdist.run, 1 GPU": [],
        f"torchrun, DDP (NCCL), {np} rank(s)": [], f"nbdist.run, DDP (NCCL), {np} rank(s)": []}
    for _ in range(reps):
        samples["plain python, 1 GPU"].append(plain("train", *one)[1]["steps_per_s"])
        samples["nbdist.run, 1 GPU"].append(under_nbdist(train, 1, *one)[1]["steps_per_s"])
        samples[f"torchrun, DDP (NCCL), {np} rank(s)"].append(
            torchrun("train", np, *many)[1]["steps_per_s"])
        samples[f"nbdist.run, DDP (NCCL), {np} rank(s)"].append(
            under_nbdist(train, np, *many)[1]["steps_per_s"])
    keys = list(samples)
    meds = {k: _med(v) for k, v in samples.items()}
    base = {keys[0]: meds[keys[0]], keys[1]: meds[keys[0]], keys[2]: meds[keys[2]],
            keys[3]: meds[keys[2]]}
    return {"scenario": f"4. training, {steps} steps, a print and a bar every {print_every}",
            "baseline": f"{keys[0]} (for {keys[1]}); {keys[2]} (for {keys[3]})",
            "rows": [(k, meds[k], meds[k] / base[k], len(samples[k])) for k in keys],
            "samples": samples, "unit": "steps/s", "goal": "nbdist ≥ 0.99× its baseline",
            "met": meds[keys[3]] >= 0.99 * meds[keys[2]]}


# -- report --------------------------------------------------------------------------------------
def markdown(info: dict[str, Any], results: list[dict[str, Any]]) -> str:
    gpus = info["gpus"]
    names = ", ".join(sorted({g["name"] for g in gpus}))
    lines = [f"{len(gpus)} × {names} ({gpus[0]['memory']}), driver {info['driver']}, torch "
             f"{info.get('torch')} (CUDA {info.get('cuda')}), Python {info['python']}, "
             f"{info['cores']} cores\n"]
    for r in results:
        unit = r.get("unit", "s")
        lines += [f"### {r['scenario']} (baseline: {r['baseline']})\n",
                  "| contender | median | vs baseline | runs |", "| --- | --- | --- | --- |"]
        lines += [f"| {label} | {value:.2f} {unit} | {ratio:.2f}× | {n} |"
                  for label, value, ratio, n in r["rows"]]
        if "goal" in r:
            lines.append(f"\nGoal: {r['goal']}: {'met' if r['met'] else 'MISSED'}.")
        if "chains" in r:
            lines.append("Each chain (s): " + "; ".join(
                ", ".join(f"{t:.2f}" for t in chain) for chain in r["chains"]) + ".")
        if "inside" in r:
            for who, parts in r["inside"].items():
                lines.append(f"Inside the rank, {who}: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in parts.items()) + ".")
        if r.get("timeline"):
            lines.append("nbdist's launch timeline (medians): " + ", ".join(
                f"{k} {v:.3f} s" for k, v in r["timeline"].items()) + ".")
        notes = {line for n in r.get("notes", []) for line in
                 (n["starts"] if isinstance(n, dict) else n)}
        if notes:
            lines.append("How the ranks started: " + "; ".join(sorted(notes)) + ".")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a smoke test")
    parser.add_argument("--only", default="1,2,3,4")
    parser.add_argument("--chain", type=int, default=4, help="back-to-back jobs per chain")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--print-every", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU: run every scenario on CPU ranks (gloo, a small model) "
                        "to check the script; its figures say nothing about GPUs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--first-cell", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    global KIND
    KIND = "cpu" if args.smoke else "cuda"
    if args.worker:
        worker(args.worker, rest)
        return 0
    if args.first_cell:
        first_cell_child()
        return 0
    info = card()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        info["gpus"] = [{"name": "none: --smoke, CPU ranks", "memory": "-", "bus": "-"}] * 2
    if not info["gpus"]:
        text = "no GPU here (nvidia-smi lists none): nothing measured\n"
        print(text, end="")
        (out / "gpu.md").write_text(text)
        (out / "gpu.json").write_text(json.dumps({"card": info, "results": []}, indent=2))
        return 0
    reps = args.reps or (1 if args.quick else 3)
    steps = 100 if args.quick else args.steps
    np = min(len(info["gpus"]), 8)
    only = set(args.only.split(","))
    plan: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("1", lambda: first_cell(reps)), ("2", lambda: back_to_back(reps, args.chain)),
        ("3", lambda: ddp(reps, np)), ("4", lambda: training(reps, steps, args.print_every, np)),
    ]
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    text = ""
    for key, run in plan:
        if key not in only:
            continue
        print(f"== scenario {key}", flush=True)
        try:
            results.append(run())
        except Exception:  # a scenario that cannot run is reported, the others still run
            failed.append(key)
            traceback.print_exc()
        # Written after each scenario: a run cut short by its time limit keeps what it measured.
        (out / "gpu.json").write_text(json.dumps({"card": info, "results": results,
                                                  "failed": failed}, indent=2, default=str))
        text = markdown(info, results) + (f"\nscenarios that failed: {failed}\n"
                                          if failed else "")
        (out / "gpu.md").write_text(text)
    print("\n" + text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

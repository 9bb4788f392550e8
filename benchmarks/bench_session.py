"""Session benchmark: cells on live ranks (``%dist_session``) against the same cells launched fresh.

1. A trivial cell on a live 4-rank local session, from the cell's start (capture included) to
   its result in the notebook, against the same cell as a fresh ``-np 4`` job (cold: no warm
   interpreters) in the same run. Goal from issue 8: median under 100 ms. Issue 30: under
   10 ms on 4 ranks and 20 ms on 16 (``--np 4,16``), against a baseline: the same session
   with a cell's end paced like any event (before issue 30: ``channel.PROMPT`` empty) or,
   with ``--against DIR``, the nbdist of another checkout (``DIR``: the repository's root,
   e.g. ``git archive c1086ad | tar -x -C /tmp/before``). Each session runs in a process of
   its own with the same measuring code, cell by cell in turn.
2. A training cell (DDP, ``STEPS`` steps, a print and a tqdm bar each) run again on a live
   2-rank session whose first cell built the model and the process group, against the whole
   cell launched fresh. Reported: time to the first step's output line at the driver (the
   "start") and end to end. Issue 8 expects a start at least 10× faster.

Usage::

    .venv/bin/python benchmarks/bench_session.py [--quick] [--only-trivial] [--against DIR]

Results: ``benchmarks/results/session.md`` and ``.json``. Goals are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nbdist import events
from nbdist import job as jobs
from nbdist import session as sessions
from nbdist.capture import capture_cell
from nbdist.channel import PROMPT
from nbdist.launch import local
from nbdist.options import JobOptions
from nbdist.rank import client

ROOT = Path(__file__).resolve().parent.parent
STEPS = 50
#: CPU ranks (gloo) also on a machine with GPUs, where a local job would give each rank one.
CPU = JobOptions(gpu=False)

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


def paced(on: bool) -> None:
    """A cell's end paced like any event (the path before issue 30), or not (as shipped).

    Local ranks' supervisors are threads of this process, so this switches both ends."""
    kinds: frozenset[str] = frozenset() if on else PROMPT
    for module in (client, events):
        setattr(module, "PROMPT", kinds)  # noqa: B010 - the name each module imported


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
    times = _timed(jobs.start(payload, -np, CPU), start)
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


def serve(np_: int, old_pace: bool) -> int:
    """``--serve NP``: a live session of ``np_`` ranks that runs the trivial cell once for each
    ``go`` line on stdin and answers its seconds (``old_pace``: a cell's end paced)."""
    paced(old_pace)
    live = sessions.start(-np_, CPU)
    try:
        live.wait_ready(120)
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() != "go":
                break
            print(on_session(live, TRIVIAL)[1], flush=True)
    finally:
        live.stop()
    return 0


class Served:
    """A live session in a process of its own (``serve``), of this checkout's nbdist or of
    the one at ``root``: every contender of scenario 1b runs so, none in the process that
    orchestrates (which also runs the cold jobs), so that they are measured alike."""

    def __init__(self, np_: int, root: Path | None = None, old_pace: bool = False) -> None:
        if root is not None and not (root / "nbdist" / "__init__.py").is_file():
            raise SystemExit(f"--against {root}: no nbdist/__init__.py there; give the root "
                             f"of a checkout (git archive REV | tar -x -C DIR)")
        # Alike but for the nbdist they import: the same working directory (the notebook's
        # folder, which a cell's capture looks through) and the checkout first on the path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(root or ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        argv = [sys.executable, __file__, "--serve", str(np_)]
        self.proc = subprocess.Popen(argv + (["--old-pace"] if old_pace else []),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        if self._answer() != "ready":
            raise SystemExit(f"the session of {root or ROOT} did not start")

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def cell(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._answer())

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.proc.stdout.close()


#: np -> the trivial cell's seconds: (the baseline, as shipped)
Sized = dict[int, tuple[list[float], list[float]]]


def trivial_cells(sizes: list[int], reps: int, against: Path | None
                  ) -> tuple[Sized, list[float], list[float]]:
    """Scenarios 1 and 1b: (the sessions' cells, the fresh 4-rank jobs', the load averages).

    The baseline: the session of ``against``'s nbdist, or (without it) this nbdist with a
    cell's end paced like any event. Each round runs one cell on each, in turn, the first
    one alternating."""
    trivial_fresh: list[float] = []
    sized: Sized = {}
    loads: list[float] = []
    for np_ in sizes:
        base = Served(np_, against.resolve()) if against else Served(np_, old_pace=True)
        try:
            now = Served(np_)
        except BaseException:
            base.close()
            raise
        before: list[float] = []
        after: list[float] = []
        try:
            for i in range(reps):
                if i % 2:
                    after.append(now.cell())
                    before.append(base.cell())
                else:
                    before.append(base.cell())
                    after.append(now.cell())
                if np_ == 4 and i % 8 == 0:  # a cold launch costs seconds: fewer, interleaved
                    trivial_fresh.append(fresh(TRIVIAL, 4)[1])
                if i % 8 == 0:
                    loads.append(os.getloadavg()[0])
        finally:
            base.close()
            now.close()
        sized[np_] = (before, after)
    return sized, trivial_fresh, loads


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--np", default="4,16", help="session sizes of the trivial cell")
    parser.add_argument("--only-trivial", action="store_true", help="skip the training cell")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="also run the trivial cell on the nbdist of this checkout")
    parser.add_argument("--serve", type=int, metavar="NP", help=argparse.SUPPRESS)
    parser.add_argument("--old-pace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.old_pace)
    reps_trivial, reps_train = (10, 2) if args.quick else (40, 5)

    sized, trivial_fresh, loads = trivial_cells(
        [int(n) for n in args.np.split(",")], reps_trivial, args.against)
    trivial_session = sized[4][1] if 4 in sized else []

    start_session: list[float] = []
    total_session: list[float] = []
    start_fresh: list[float] = []
    total_fresh: list[float] = []
    for _ in range(0 if args.only_trivial else reps_train):
        first, total = fresh(SETUP + LOOP, 2)
        start_fresh.append(first)
        total_fresh.append(total)
        live = sessions.start(-2, CPU)
        try:
            on_session(live, SETUP)
            first, total = on_session(live, LOOP)
            start_session.append(first)
            total_session.append(total)
        finally:
            live.stop()

    def ratio(a: list[float], b: list[float]) -> str:
        if not a or not b:
            return "-"
        return f"{statistics.median(a) / statistics.median(b):.3f}×"

    def median_or_dash(values: list[float]) -> str:
        return median_ms(values) if values else "-"

    rows = []
    if trivial_fresh:
        rows += [
            ("1. trivial cell, 4 ranks", "fresh job, cold (baseline)",
             median_ms(trivial_fresh), "1.000×", len(trivial_fresh)),
            ("", "live session", median_ms(trivial_session),
             ratio(trivial_session, trivial_fresh), len(trivial_session)),
        ]
    for np_, (before, now) in sized.items():
        baseline = (f"nbdist of {args.against}" if args.against else
                    "a cell's end paced like any event, as before issue 30")
        rows += [
            (f"1b. trivial cell, live {np_}-rank session", f"{baseline} (baseline)",
             median_ms(before), "1.000×", len(before)),
            ("", "this nbdist (as shipped)", median_ms(now), ratio(now, before), len(now)),
        ]
    rows += [
        (f"2. DDP training, {STEPS} steps, 2 ranks: start (first line)",
         "fresh job, cold (baseline)", median_or_dash(start_fresh), "1.000×", len(start_fresh)),
        ("", "second cell on a live session", median_or_dash(start_session),
         ratio(start_session, start_fresh), len(start_session)),
        ("2. same, end to end", "fresh job, cold (baseline)", median_or_dash(total_fresh),
         "1.000×", len(total_fresh)),
        ("", "second cell on a live session", median_or_dash(total_session),
         ratio(total_session, total_fresh), len(total_session)),
    ]
    lines = ["| scenario | contender | median | vs baseline | runs |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    lines.append("")
    if loads:
        lines.append(f"Load average (1 min) during the trivial cells: {min(loads):.1f} to "
                     f"{max(loads):.1f}.")
    for np_, goal in ((4, 10.0), (16, 20.0)):
        if np_ in sized:
            ms = statistics.median(sized[np_][1]) * 1000
            lines.append(f"Goal (issue 30): a trivial cell on a live {np_}-rank session under "
                         f"{goal:g} ms: {ms:.1f} ms ({'met' if ms < goal else 'missed'}).")
    if start_session:
        speedup = statistics.median(start_fresh) / statistics.median(start_session)
        lines.append(f"Second training cell starts {speedup:.0f}× sooner than a fresh launch "
                     f"(issue 8 expects at least 10×: {'met' if speedup >= 10 else 'missed'}).")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.md").write_text(text)
    samples: dict[str, Any] = {
        "trivial_session": trivial_session, "trivial_fresh": trivial_fresh,
        "sized": {str(k): {"baseline": v[0], "as shipped": v[1]} for k, v in sized.items()},
        "against": str(args.against or ""), "loads": loads,
        "start_session": start_session, "start_fresh": start_fresh,
        "total_session": total_session, "total_fresh": total_fresh,
    }
    (out / "session.json").write_text(json.dumps({"rows": rows, "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

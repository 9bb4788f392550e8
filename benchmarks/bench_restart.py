"""What a restart costs (``--max-restarts``, docs/elastic.md): a DDP training with a rank
SIGKILLed mid-run against the same training uninterrupted, on the local backend.

    .venv/bin/python benchmarks/bench_restart.py [--quick]

The training (2 ranks, gloo, CPU) checkpoints every 5 of 30 steps; in the killed run, rank 1
writes its pid at step 17 of the first attempt and waits, and the bench SIGKILLs it; the job
resumes from step 15. Reported: the whole job's wall time against the uninterrupted baseline
(measured in the same run, interleaved), and the time from the kill to the job's end.

Results: ``benchmarks/results/restart.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nbdist

ROOT = Path(__file__).resolve().parent.parent
STEPS, EVERY, STOP_AT = 30, 5, 17


def train(steps: int, every: int, stop_at: int | None, ready: str) -> float:
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import nbdist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ddp = DistributedDataParallel(model)
    path = os.path.join(nbdist.checkpoint_dir(), "ckpt.pt")
    first = 0
    if os.path.exists(path):
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        first = saved["step"]
    for step in range(first, steps):
        if step == stop_at and rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            with open(ready + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(ready + ".tmp", ready)
            while True:
                time.sleep(0.05)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
    dist.destroy_process_group()
    return float(loss.item())


def once(where: Path, kill: bool) -> tuple[float, float | None]:
    """(the job's wall time, seconds from the kill to its end or None)."""
    ready = where / "ready"
    started = time.monotonic()
    job = nbdist.run(train, STEPS, EVERY, STOP_AT if kill else None, str(ready), np=2,
                     backend="local", max_restarts=1 if kill else 0,
                     checkpoint_dir=str(where / "ckpt"))
    killed = None
    if kill:
        deadline = time.monotonic() + 300
        while not ready.exists():  # the rank says where it is: no sleep races a timer
            if time.monotonic() > deadline:
                raise RuntimeError("rank 1 never reached the step where it is killed")
            time.sleep(0.01)
        os.kill(int(ready.read_text()), signal.SIGKILL)
        killed = time.monotonic()
    job.result(timeout=300)
    ended = time.monotonic()
    if kill:
        assert len(job.attempts) == 2, job.attempts
    return ended - started, None if killed is None else ended - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    reps = 2 if args.quick else 5
    plain: list[float] = []
    restarted: list[float] = []
    after_kill: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        once(Path(tmp) / "warm", kill=False)  # the first job pays for the zygote's imports
        for i in range(reps):
            plain.append(once(Path(tmp) / f"p{i}", kill=False)[0])
            total, since = once(Path(tmp) / f"k{i}", kill=True)
            restarted.append(total)
            assert since is not None
            after_kill.append(since)

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s"

    ratio = statistics.median(restarted) / statistics.median(plain)
    rows = [
        (f"DDP training, {STEPS} steps, 2 local ranks", "uninterrupted (baseline)", med(plain),
         "1.00×", len(plain)),
        ("", f"rank 1 SIGKILLed at step {STOP_AT}, --max-restarts 1, resumed from step 15",
         med(restarted), f"{ratio:.2f}×", len(restarted)),
        ("", "of which: from the kill to the job's end", med(after_kill), "-", len(after_kill)),
    ]
    lines = ["| scenario | contender | median | vs baseline | runs |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "restart.md").write_text(text)
    samples: dict[str, Any] = {"plain": plain, "restarted": restarted, "after_kill": after_kill}
    (out / "restart.json").write_text(json.dumps({"rows": rows, "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

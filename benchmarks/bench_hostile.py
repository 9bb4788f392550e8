"""Hostile-input benchmark: what strangers on the kernel's event server cost it.

All on loopback, every loop bounded; the kernel is this process, the strangers a child process.

1. **Memory under a flood.** 8000 connections, each sending 64 KB without a newline (never a
   hello): the kernel's peak resident memory above where it started (psutil, sampled every
   10 ms), and how many connections the server closed and counted.
2. **A job among strangers.** A 2-rank local job (print a line, return) while 1000 strangers
   hold idle connections (replaced as the server cuts them), against the same job with none,
   interleaved; median of ``--reps``.
3. **Slowloris.** A connection sending one byte every 0.5 s: seconds until the server cuts it
   (``events.AUTH_DEADLINE_S``).
4. **The Spark executor zygote's socket** (a zygote started here as a task starts one, in a
   private folder): the time to have a rank forked and ended before and after the malformed
   packets of ``tests/hostile.py`` (each on its own connection; medians of ``--reps``, the
   baseline in the same run), whether the zygote lived through them, and the seconds until a
   silent connection is cut (``executor_zygote.AUTH_DEADLINE_S``).

Usage::

    .venv/bin/python benchmarks/bench_hostile.py [--quick]

Results: ``benchmarks/results/hostile.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbdist
from nbdist import events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import hostile  # noqa: E402  (the strangers the tests use, after the path)
from tests.test_executor_zygote import fork_a_rank, start  # noqa: E402


def _job() -> int:
    import os

    print("up", flush=True)
    return int(os.environ["RANK"])


def timed_job() -> float:
    start = time.perf_counter()
    job = nbdist.run(_job, np=2, backend="local")
    assert job.results == [0, 1] and job.lost_output is None
    return time.perf_counter() - start


def executor_zygote(reps: int) -> dict[str, Any]:
    """Section 4: a zygote's fork before and after the attack, and a silent peer's cut."""
    from nbdist.rank import executor_zygote as ez

    directory = tempfile.mkdtemp(prefix="nbz", dir="/tmp")
    os.chmod(directory, 0o700)
    z = start(directory)
    try:
        def timed_fork() -> float:
            t = time.perf_counter()
            fork_a_rank(z)
            return time.perf_counter() - t

        timed_fork()
        before = [timed_fork() for _ in range(reps)]
        cases = hostile.zygote_malformed(z.secret)
        t = time.perf_counter()
        kept = hostile.zygote_send_each(z.path, cases)
        attack_s = time.perf_counter() - t
        after = [timed_fork() for _ in range(reps)]
        rejected = hostile.zygote_rejected(z.path, z.secret)
        silent, _ = hostile.zygote_greet(z.path, timeout=4 * ez.AUTH_DEADLINE_S)
        t = time.perf_counter()
        with silent:
            cut = hostile.closed_on_us(silent)
        cut_s = time.perf_counter() - t
        return {"cases": len(cases), "kept_open": kept, "attack_s": attack_s,
                "rejected": rejected, "alive": z.alive(), "before": before, "after": after,
                "silent_cut": cut, "silent_cut_s": cut_s}
    finally:
        if z.alive():
            z.proc.terminate()
            z.proc.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    server = events.shared_server("127.0.0.1")  # the one the local jobs use

    flooded = hostile.flood(server, 8000, 64 * 1024)
    timed_job()  # warm interpreters for both contenders
    alone: list[float] = []
    among: list[float] = []
    for _ in range(reps):
        alone.append(timed_job())
        with hostile.IdleStrangers(server.address, 1000):
            among.append(timed_job())
    cut_after = hostile.slowloris(server.address, every=0.5, limit_s=120)
    zyg = executor_zygote(reps)
    fork_before = statistics.median(zyg["before"])
    fork_after = statistics.median(zyg["after"])

    med_alone, med_among = statistics.median(alone), statistics.median(among)
    lines = [
        "| attack | measured |", "| --- | --- |",
        f"| 8000 connections x 64 KB, no hello | kernel's peak RSS +"
        f"{flooded.peak_growth / 2**20:.1f} MiB; {flooded.rejected} of 8000 closed and "
        f"counted in {flooded.seconds:.1f} s |",
        f"| 2-rank job, no strangers (baseline) | {med_alone * 1000:.0f} ms (1.00x) |",
        f"| same job while 1000 idle strangers are connected | {med_among * 1000:.0f} ms "
        f"({med_among / med_alone:.2f}x) |",
        f"| slowloris, a byte every 0.5 s | cut after {cut_after or float('nan'):.1f} s "
        f"(AUTH_DEADLINE_S = {events.AUTH_DEADLINE_S:g} s) |",
        f"| executor zygote: fork and end a rank (baseline) | {fork_before * 1000:.1f} ms "
        f"(1.00x) |",
        f"| the same after {zyg['cases']} malformed packets ({zyg['rejected']} closed and "
        f"counted, {len(zyg['kept_open'])} left open; zygote "
        f"{'alive' if zyg['alive'] else 'DEAD'}) | {fork_after * 1000:.1f} ms "
        f"({fork_after / fork_before:.2f}x) |",
        f"| executor zygote: a connection that never says hello | cut after "
        f"{zyg['silent_cut_s']:.1f} s |",
        "", f"Medians of {reps} jobs (and of {reps} forks) each; jobs interleaved.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "hostile.md").write_text(text)
    samples = {"flood": dataclasses.asdict(flooded), "alone": alone, "among": among,
               "slowloris_s": cut_after, "executor_zygote": zyg}
    (out / "hostile.json").write_text(json.dumps(samples, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The bad hour's costs (issue 29): stacks on demand, and the per-rank log files.

1. **Stacks on 8 local ranks.** Eight real ranks wait in a lock (C code); the time from
   ``job.stacks()`` to the grouped answer (each supervisor signals its rank, ``faulthandler``
   writes, the text comes back over the event channel, the driver groups it). Median of
   ``--reps``; goal < 1 s. Baseline in the same run: the time the same job took from
   ``nbdist.run`` to every rank's first line.
2. **Stacks on 64 simulated ranks.** 64 of the supervisor's own ``EventClient`` in one other
   process, connected to a real ``EventServer``, answer each ``stacks`` request with a
   realistic dump (the cell's thread 20 frames deep, three other threads; 60 ranks alike, 4
   elsewhere); the driver sends, waits and groups as ``Job.stacks`` does. Median time to the
   grouped answer.
3. **The log files' cost on streaming.** ``bench_streaming``'s flood (4 ranks print as fast as
   they can) with the per-rank log files written (as always) against the same with the file
   writes turned off in this process, interleaved, median of ``--reps``. Goal: ≥ 0.95×.

    .venv/bin/python benchmarks/bench_bad_hour.py [--quick]

Results: ``benchmarks/results/bad_hour.json`` and ``.md``. Goals are reported, not asserted.
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

import nbdist
from nbdist import channel, events, logfiles
from nbdist.stacks import Stacks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_streaming  # noqa: E402  (its flood, beside this file)

ROOT = Path(__file__).resolve().parent.parent


def _stuck(gate: str) -> None:
    import os
    import threading

    lock = threading.Lock()
    lock.acquire()
    print("waiting", flush=True)
    while not os.path.exists(gate):
        lock.acquire(timeout=0.05)


def stacks_local(np: int, reps: int, tmp: Path) -> dict[str, Any]:
    gate = tmp / "gate-stacks"
    t0 = time.perf_counter()
    job = nbdist.run(_stuck, str(gate), np=np, backend="local")
    while sum(r.lines >= 1 for r in job.state.ranks) < np:
        time.sleep(0.005)
    started = time.perf_counter() - t0
    times, groups, missing = [], 0, 0
    for _ in range(reps):
        t = time.perf_counter()
        got = job.stacks()
        times.append(time.perf_counter() - t)
        groups, missing = len(got.groups), len(got.missing)
    gate.touch()
    job.result(timeout=60)
    med = statistics.median(times)
    return {"ranks": np, "median_s": med, "all_s": times, "groups": groups, "missing": missing,
            "job_start_s": started, "ratio_to_start": med / started}


CLIENTS = textwrap.dedent("""
    import sys, time
    from concurrent.futures import ThreadPoolExecutor
    from nbdist.rank.client import EventClient
    host, port, job, secret, ranks, same, other = sys.argv[1:8]
    dumps = [open(same).read(), open(other).read()]
    clients = {}
    def answer(r):
        def on_message(msg):
            if msg.get("t") == "stacks":
                text = dumps[0] if r % 16 else dumps[1]
                clients[r].send({"t": "stacks", "id": msg["id"], "text": text})
        return on_message
    def connect(r):
        clients[r] = None
        c = EventClient((host, int(port)), job, r, secret, {"host": "sim"}, answer(r))
        clients[r] = c
        return c
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(connect, range(int(ranks))))
    print("connected", flush=True)
    sys.stdin.read()  # until the driver is done
    for c in clients.values():
        c.close()
""")


def _fake_dump(inner: str, depth: int = 20) -> str:
    """A faulthandler dump: the cell's thread ``depth`` frames deep, three other threads."""
    lines = ["Thread 0x00007f1c2a7fc700 (most recent call first):"]
    lines += [f'  File "/usr/lib/python3.11/threading.py", line {n} in wait' for n in (320, 622)]
    lines += ['  File "/site/torch/utils/data/_utils/pin_memory.py", line 54 in _pin_memory_loop']
    lines += ['  File "/usr/lib/python3.11/threading.py", line 975 in run', ""]
    lines.append("Thread 0x00007f1c2b7fd700 (most recent call first):")
    lines += ['  File "/site-packages/nbdist/protocol.py", line 129 in read_frame',
              '  File "/site-packages/nbdist/rank/runtime.py", line 640 in watch',
              '  File "/usr/lib/python3.11/threading.py", line 975 in run', ""]
    lines.append("Current thread 0x00007f1c2c21b740 (most recent call first):")
    lines.append(f'  File "/site/torch/distributed/distributed_c10d.py", line 2501 in {inner}')
    lines += [f'  File "/site/model/layer{i}.py", line {10 + i} in forward' for i in range(depth)]
    lines += ['  File "<cell In[7]>", line 41 in <module>',
              '  File "/site-packages/nbdist/rank/runtime.py", line 137 in _run_cell',
              '  File "/site-packages/nbdist/rank/runtime.py", line 520 in _serve',
              '  File "/site-packages/nbdist/rank/runtime.py", line 660 in main',
              '  File "<string>", line 1 in <module>', ""]
    return "\n".join(lines)


class _Answers:
    """The job's side of the channel, as ``Job`` has it for stacks answers."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.answers: dict[int, dict[int, str]] = {}

    def on_connect(self, rank: int, hello: dict[str, object]) -> None:
        pass

    def on_event(self, rank: int, event: dict[str, Any]) -> None:
        if event.get("t") == "stacks":
            with self.cond:
                self.answers.setdefault(event["id"], {})[rank] = event["text"]  # same dict
                self.cond.notify_all()

    def on_disconnect(self, rank: int) -> None:
        pass


def stacks_simulated(ranks: int, reps: int, tmp: Path) -> dict[str, Any]:
    server = events.EventServer()
    secret = channel.new_secret()
    answers = _Answers()
    server.add_job("jsim", secret, answers)
    same, other = tmp / "same.txt", tmp / "other.txt"
    same.write_text(_fake_dump("all_reduce"))
    other.write_text(_fake_dump("broadcast"))
    host, port = server.address
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, host, str(port), "jsim", secret, str(ranks), str(same),
         str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
        times: list[float] = []
        groups = 0
        for req in range(1, reps + 1):
            t = time.perf_counter()
            for r in range(ranks):
                server.send("jsim", r, {"t": "stacks", "id": req})
            with answers.cond:
                got_req = answers.answers.setdefault(req, {})
                answers.cond.wait_for(lambda: len(got_req) >= ranks, 30)  # noqa: B023  (used now)
            got = Stacks.from_dumps("jsim", got_req)
            got.text()
            times.append(time.perf_counter() - t)
            groups = len(got.groups)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
        server.remove_job("jsim")
        server.close()
    return {"ranks": ranks, "median_s": statistics.median(times), "all_s": times,
            "groups": groups}


def log_cost(total: int, np: int, reps: int, tmp: Path) -> dict[str, Any]:
    n = total // np
    runs: dict[str, list[float]] = {"with logs": [], "without": []}
    real_write = logfiles.RankLogs.write
    lost = 0
    try:
        for rep in range(reps):  # interleaved, so a change in the machine's load hits both
            for key in runs:
                logfiles.RankLogs.write = (  # type: ignore[method-assign]
                    real_write if key == "with logs" else (lambda self, rank, text: None))
                rate, missing = bench_streaming._flood_once(
                    n, np, False, tmp / f"gate-logs-{rep}-{key.replace(' ', '-')}")
                runs[key].append(rate)
                lost += missing
    finally:
        logfiles.RankLogs.write = real_write  # type: ignore[method-assign]
    with_logs, without = statistics.median(runs["with logs"]), statistics.median(runs["without"])
    return {"ranks": np, "lines": n * np, "with_logs_lines_per_s": with_logs,
            "without_lines_per_s": without, "ratio": with_logs / without, "lost": lost,
            "all": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small numbers, for a smoke test")
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    lines = 80_000 if args.quick else 400_000
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        local = stacks_local(8, reps, tmp)
        print(f"stacks, 8 local ranks: {local['median_s']:.3f} s", flush=True)
        sim = stacks_simulated(64, reps, tmp)
        print(f"stacks, 64 simulated ranks: {sim['median_s']:.3f} s", flush=True)
        logs = log_cost(lines, 4, max(3, reps // 2), tmp)
        print(f"log files: {logs['ratio']:.3f}×", flush=True)
    goals = {"stacks of 8 local ranks < 1 s": local["median_s"] < 1.0,
             "log files keep >= 0.95x of the lines/s": logs["ratio"] >= 0.95,
             "no line lost": logs["lost"] == 0}
    text = "\n".join([
        "| measurement | result | baseline (same run) | ratio |",
        "| --- | --- | --- | --- |",
        f"| `stacks()`, 8 local ranks in a lock ({local['groups']} group, "
        f"{local['missing']} missing) | {local['median_s'] * 1000:.0f} ms | the job's start: "
        f"{local['job_start_s']:.2f} s | {local['ratio_to_start']:.2f}× |",
        f"| stacks, 64 simulated ranks ({sim['groups']} groups) | "
        f"{sim['median_s'] * 1000:.0f} ms | - | - |",
        f"| streaming, 4 ranks, with per-rank log files | "
        f"{logs['with_logs_lines_per_s']:,.0f} lines/s | without: "
        f"{logs['without_lines_per_s']:,.0f} lines/s | {logs['ratio']:.3f}× |",
    ]) + "\n\n" + "".join(f"- [{'met' if ok else 'MISSED'}] {g}\n" for g, ok in goals.items())
    text += (f"\nmedian of {reps} (stacks) and {max(3, reps // 2)} (streaming, {lines:,} lines "
             f"per run); {os.cpu_count()} cores.\n")
    print("\n" + text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "bad_hour.json").write_text(json.dumps(
        {"cpus": os.cpu_count(), "stacks_local": local, "stacks_simulated": sim,
         "log_cost": logs, "goals": goals}, indent=2))
    (results / "bad_hour.md").write_text(text)


if __name__ == "__main__":
    main()

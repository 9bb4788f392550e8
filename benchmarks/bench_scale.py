"""Scale on paper: what 256 ranks cost the driver's event server.

256 simulated ranks (cheap clients in one separate process, not rank processes) connect to a
real :class:`nbdist.events.EventServer`, authenticate, and each sends ``--rate`` events per
second (an output batch, a progress update and a metrics update in turn) for ``--seconds``.
Measured in the driver process, which runs only the server and a real ``JobState``: CPU time
per second of wall time (as % of one core) and resident memory per rank, against the same
process idle for the same time (the baseline).

    .venv/bin/python benchmarks/bench_scale.py [--ranks 256] [--rate 10] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from nbdist import events
from nbdist.state import JobState

ROOT = Path(__file__).resolve().parent.parent

CLIENTS = textwrap.dedent("""
    import json, socket, sys, time
    from nbdist import events
    host, port, job, secret, ranks, rate, seconds = sys.argv[1:8]
    ranks, rate, seconds = int(ranks), float(rate), float(seconds)
    socks = []
    for r in range(ranks):
        s = socket.create_connection((host, int(port)))
        f = s.makefile("rb")
        nonce = json.loads(f.readline())["nonce"]
        s.sendall(events.encode({"t": "hello", "job": job, "rank": r,
                                 "mac": events.sign(secret, nonce, job, r)}))
        socks.append((s, f))
    kinds = [
        lambda i: {"t": "out", "s": "o", "text": f"step {i} loss 0.123\\n"},
        lambda i: {"t": "progress", "id": 1, "n": i, "total": 1000, "desc": "train"},
        lambda i: {"t": "metrics", "values": {"loss": 0.1, "step": i}},
    ]
    print("connected", flush=True)
    start = time.monotonic(); i = 0
    while time.monotonic() - start < seconds:
        for s, _ in socks:
            s.sendall(events.encode(kinds[i % 3](i)))
        i += 1
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
    print(i * len(socks), flush=True)
    for s, f in socks:
        f.close(); s.close()
""")


class Channel:
    def __init__(self, job: JobState) -> None:
        self.job = job

    def on_connect(self, rank: int, hello: dict[str, object]) -> None:
        pass

    def on_event(self, rank: int, event: dict[str, object]) -> None:
        self.job.apply(rank, event)

    def on_disconnect(self, rank: int) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--rate", type=float, default=10.0, help="events per second per rank")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="5 seconds")
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds
    me = psutil.Process()
    server = events.EventServer("127.0.0.1")
    job = JobState("bench", "local", args.ranks)
    secret = events.new_secret()
    server.add_job("bench", secret, Channel(job))

    cpu0, t0 = me.cpu_times(), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = me.cpu_times(), time.monotonic()
    idle_pct = 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
    rss_idle = me.memory_info().rss

    clients = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, *map(str, server.address), "bench", secret,
         str(args.ranks), str(args.rate), str(seconds)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert clients.stdout is not None
    assert clients.stdout.readline().strip() == "connected"
    cpu0, t0 = me.cpu_times(), time.monotonic()
    sent = int(clients.stdout.readline())
    cpu1, t1 = me.cpu_times(), time.monotonic()
    clients.wait()
    clients.stdout.close()
    busy_pct = 100 * ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
    rss_busy = me.memory_info().rss
    server.close()
    received = job.version
    per_rank_kb = (rss_busy - rss_idle) / 1024 / args.ranks
    result = {
        "ranks": args.ranks, "events_per_rank_per_s": args.rate, "seconds": seconds,
        "events_sent": sent, "events_applied": received,
        "driver_cpu_pct_of_one_core": round(busy_pct, 2),
        "idle_baseline_cpu_pct": round(idle_pct, 2),
        "driver_cpu_pct_per_rank": round((busy_pct - idle_pct) / args.ranks, 4),
        "driver_memory_kb_per_rank": round(per_rank_kb, 1),
    }
    text = (
        f"| ranks | events/s each | driver CPU (% of a core) | idle baseline | per rank | "
        f"memory per rank | events sent / applied |\n| --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {args.ranks} | {args.rate:g} | {busy_pct:.2f} % | {idle_pct:.2f} % | "
        f"{(busy_pct - idle_pct) / args.ranks:.4f} % | {per_rank_kb:.1f} KB | "
        f"{sent} / {received} |\n"
    )
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(result, indent=2))
    (out / "scale.md").write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())

"""``%dist_pull`` benchmark: a large value from a session's rank into the notebook.

Each measurement runs in a fresh Python process standing for the kernel, so that its peak
memory (``ru_maxrss``, the kernel's high-water mark) is the pull's own:

1. a local session of one rank whose cell builds the value: a numpy array of ``--mb``, then
   ``bytes`` of the same size (which pickle cannot keep out of band), then a torch tensor
   (which torch pickles itself, in band);
2. ``%dist_pull``'s own path (``Session.run_cell({"kind": "pull"})``), timed from the request
   to the value in the notebook, and checked;
3. the baseline, in the same run: the same number of bytes sent by a child process over a
   loopback TCP socket into one buffer (the floor of moving them between processes here).

Reported: seconds, MB/s, the ratio to the baseline, and the kernel's peak resident memory
during the pull above what it held before, as a multiple of the value's size. Goals (issue
12): a 500 MB pull under 5 s, peaking under 2x the value's size.

Usage::

    .venv/bin/python benchmarks/bench_pull.py [--quick] [--mb 500]

Results: ``benchmarks/results/pull.md`` and ``.json``. Goals are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

MAKE = {
    "numpy": "import numpy as np\nx = np.tile(np.arange(251, dtype=np.uint8), {n} // 251)\nNone",
    "bytes": "x = bytes(range(251)) * ({n} // 251)\nNone",
    "torch": "import torch\nx = torch.arange({n} // 4, dtype=torch.int32) % 251\nNone",
}


def one_pull(kind: str, mb: int) -> dict[str, Any]:
    """In this (fresh) process: start a session, build the value on the rank, pull it."""
    import psutil

    from nbdist import session as sessions
    from nbdist.capture import capture_cell

    n = mb * 10**6 // 251 * 251
    live = sessions.start(-1)
    try:
        live.run_cell(capture_cell(MAKE[kind].format(n=n), {}).payload()).result()
        if kind == "torch":
            import torch  # noqa: F401  (a notebook pulling tensors has it; not the pull's cost)
        before = psutil.Process().memory_info().rss
        start = time.perf_counter()
        value = live.run_cell({"kind": "pull", "name": "x", "rank": 0}).results[0].value
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if kind == "torch":
            import torch

            want = torch.arange(n // 4, dtype=torch.int32) % 251
            intact = bool(torch.equal(value, want))
            n = n // 4 * 4
        else:
            size = len(value) if kind == "bytes" else int(value.nbytes)
            pattern = bytes(value[:502]) == bytes(range(251)) * 2
            intact = size == n and pattern and bytes(value[-251:]) == bytes(range(251))
    finally:
        live.stop()
    return {"kind": kind, "bytes": n, "seconds": seconds, "peak_growth": peak - before,
            "intact": intact}


SENDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
data = bytes(range(251)) * (n // 251)
with socket.create_connection(("127.0.0.1", port)) as s:
    s.sendall(data)
"""


def one_baseline(mb: int) -> dict[str, Any]:
    """The same bytes from a child process over loopback TCP into one buffer."""
    n = mb * 10**6 // 251 * 251
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", SENDER, str(n), str(port)])
        conn, _ = server.accept()
        with conn:
            buf = bytearray(n)
            view = memoryview(buf)
            start = time.perf_counter()  # from the first byte the sender could write
            got = 0
            while got < n:
                got += conn.recv_into(view[got:])
            seconds = time.perf_counter() - start
        child.wait()
    return {"kind": "baseline", "bytes": n, "seconds": seconds}


def run_child(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run each, 100 MB")
    parser.add_argument("--mb", type=int, default=None, help="value size in MB (default 500)")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        kind, mb = args.one[0], int(args.one[1])
        print(json.dumps(one_baseline(mb) if kind == "baseline" else one_pull(kind, mb)))
        return 0
    mb = args.mb or (100 if args.quick else 500)
    reps = 1 if args.quick else 3
    runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "numpy": [], "bytes": [],
                                             "torch": []}
    for _ in range(reps):  # interleaved, so that a busy spell of the machine hits all alike
        for kind in runs:
            runs[kind].append(run_child("--one", kind, str(mb)))

    base = statistics.median(r["seconds"] for r in runs["baseline"])
    lines = [f"Pulling a {mb} MB value from a local session's rank (`%dist_pull`), each run in "
             f"a fresh process; medians of {reps}.", "",
             "| value | seconds | MB/s | vs baseline | kernel's peak growth | x value size "
             "| intact |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines.append(f"| loopback TCP into one buffer (baseline) | {base:.2f} | "
                 f"{mb / base:.0f} | 1.00x | - | - | - |")
    goals = []
    for kind in ("numpy", "bytes", "torch"):
        secs = statistics.median(r["seconds"] for r in runs[kind])
        growth = statistics.median(r["peak_growth"] for r in runs[kind])
        times = growth / (mb * 10**6)
        intact = all(r["intact"] for r in runs[kind])
        lines.append(f"| {kind} | {secs:.2f} | {mb / secs:.0f} | {secs / base:.2f}x | "
                     f"{growth / 2**20:.0f} MiB | {times:.2f}x | {'yes' if intact else 'NO'} |")
        goals.append(f"{kind}: {secs:.2f} s ({'met' if secs < 5 else 'missed'} < 5 s), peak "
                     f"{times:.2f}x ({'met' if times < 2 else 'missed'} < 2x)")
    lines += ["", "Goals (issue 12, for 500 MB): " + "; ".join(goals) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "pull.md").write_text(text)
    (out / "pull.json").write_text(json.dumps({"mb": mb, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

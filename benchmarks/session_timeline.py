"""Where a trivial session cell's time goes: marks on the monotonic clock of the kernel.

Local ranks' supervisors are threads of the kernel, so one clock serves them and the
notebook's side. The marks are taken by wrapping nbdist's own functions in this process (a
measuring tool, not an API): when each supervisor got the cell and wrote it to its rank, got
the rank's value and its end, the client wrote the end, the driver got it, the cell completed.
Printed: the median over the cells of the first and the last rank's time of each mark, in ms
from the cell's start, with the kernel's and the ranks' context switches per cell
(``/proc/PID/task/*/status``). The wrappers cost time of their own: totals run above
``bench_session.py``'s.

Usage::

    .venv/bin/python benchmarks/session_timeline.py [--np 16] [--cells 40]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil

from nbdist import session as sessions
from nbdist.capture import capture_cell
from nbdist.rank import cells, client

TRIVIAL = "import os\nint(os.environ['RANK'])"

marks: list[tuple[str, float]] = []


def mark(label: str) -> None:
    marks.append((label, time.monotonic()))


def wrap(owner: Any, name: str, before: str, after: str = "",
         when: Callable[..., bool] = lambda *a, **k: True) -> None:
    """Mark ``before`` and ``after`` a call of ``owner.name`` (when ``when`` says so)."""
    real = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hit = when(*args, **kwargs)
        if hit and before:
            mark(before)
        try:
            return real(*args, **kwargs)
        finally:
            if hit and after:
                mark(after)

    setattr(owner, name, wrapped)


def instrument() -> None:
    wrap(cells.SessionCells, "on_message", "supervisor got the cell",
         "supervisor wrote it to the rank", when=lambda self, msg, rank: msg.get("t") == "cell")
    wrap(cells.SessionCells, "value", "supervisor got the rank's value")
    wrap(cells.SessionCells, "ended", "supervisor got the rank's end", "supervisor sent the end")
    wrap(client, "_lines", "client writes the end",
         when=lambda batch: any(e.get("t") in ("cell_result", "cell_error") for e in batch))
    wrap(sessions.SessionCell, "on_rank_end", "driver got the end",
         when=lambda self, rank, event, secret: event.get("t") in ("cell_result", "cell_error"))
    wrap(sessions.SessionCell, "_complete", "cell complete")


def switches(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for path in glob.glob(f"/proc/{pid}/task/*/status"):
            try:
                with open(path) as f:
                    total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
            except OSError:
                pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=16)
    parser.add_argument("--cells", type=int, default=40)
    args = parser.parse_args()
    instrument()
    live = sessions.start(-args.np)
    try:
        live.wait_ready(120)
        ranks = [r.pid for r in live.state.ranks if r.pid is not None]
        ranks += [c.pid for p in ranks for c in psutil.Process(p).children(recursive=True)]
        spans: dict[str, tuple[list[float], list[float]]] = collections.defaultdict(
            lambda: ([], []))
        totals: list[float] = []
        kernel: list[int] = []
        rank_switches: list[int] = []
        for i in range(args.cells + 3):
            marks.clear()
            k0, r0 = switches([os.getpid()]), switches(ranks)
            start = time.monotonic()
            payload = capture_cell(TRIVIAL, {}, remote_names=live.defined_names()).payload()
            mark("captured")
            cell = live.run_cell(payload)
            mark("sent to every rank")
            cell.result()
            total = time.monotonic() - start
            if i < 3:
                continue  # the first cells import and warm what later ones find ready
            kernel.append(switches([os.getpid()]) - k0)
            rank_switches.append(switches(ranks) - r0)
            totals.append(total * 1000)
            seen: dict[str, list[float]] = collections.defaultdict(list)
            for label, at in marks:
                seen[label].append((at - start) * 1000)
            for label, times in seen.items():
                spans[label][0].append(min(times))
                spans[label][1].append(max(times))
    finally:
        live.stop()
    print(f"{args.np} ranks, {args.cells} cells, load average {os.getloadavg()[0]:.1f}: "
          f"median {statistics.median(totals):.1f} ms; context switches per cell: kernel "
          f"{statistics.median(kernel):.0f}, ranks {statistics.median(rank_switches):.0f}")
    print("| mark | first rank (ms) | last rank (ms) |\n| --- | --- | --- |")
    for label, (first, last) in sorted(spans.items(), key=lambda kv: statistics.median(kv[1][0])):
        print(f"| {label} | {statistics.median(first):.1f} | {statistics.median(last):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

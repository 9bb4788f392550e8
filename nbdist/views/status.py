"""``%dist_status`` as text: the kernel's jobs, one job's ranks, the backend's capacity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nbdist.state import JobState


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = [[("" if c is None else str(c)) for c in r] for r in rows]
    cells = [[str(c) for c in header], *body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def jobs_table(jobs: Sequence[JobState]) -> str:
    if not jobs:
        return "no nbdist jobs in this kernel yet"
    rows = [
        (j.id, j.backend, j.np, j.state, f"{j.elapsed:.1f} s",
         ",".join(map(str, j.failed_ranks)) or "-")
        for j in jobs
    ]
    return _table(("job", "backend", "np", "state", "elapsed", "failed ranks"), rows)


def ranks_table(job: JobState) -> str:
    rows = []
    for r in job.ranks:
        last = r.last_line or r.status_line
        rows.append((r.rank, r.state, r.host, r.pid, r.gpu or "-", r.exit_code,
                     (last[:60] + "...") if len(last) > 60 else last))
    head = f"job {job.id}: {job.np} ranks on {job.backend}, {job.state}, {job.elapsed:.1f} s"
    if job.reason:
        head += f"\n{job.reason.splitlines()[0]}"
    table = _table(("rank", "state", "host", "pid", "gpu", "exit", "last line"), rows)
    return head + "\n" + table

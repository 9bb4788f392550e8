"""The text view: rank-labelled output lines while the job runs, then a one-line summary.

Works everywhere (terminal IPython, nbconvert, a saved notebook). It is called from the
thread that waits for the job, about ten times a second, and prints only what is new.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from nbdist.state import JobState

#: A rank's self-drawn progress line (``\r``) is reprinted at most this often.
STATUS_EVERY_S = 2.0


class TextView:
    def __init__(self, job: JobState, stream: TextIO | None = None) -> None:
        self.job = job
        self.stream = stream
        self._seq = 0
        self._status: dict[int, tuple[str, float]] = {}
        self._width = len(str(max(job.np - 1, 0)))

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def update(self) -> None:
        lines, skipped = self.job.lines_since(self._seq)
        out = self._out()
        if skipped:
            out.write(f"[nbdist] ... {skipped} lines not shown (output faster than the view; "
                      f"each rank's last lines are kept)\n")
        for line in lines:
            out.write(f"[rank {line.rank:>{self._width}}] {line.text}\n")
            self._seq = line.seq
        now = time.monotonic()
        for r in self.job.ranks:
            text = r.status_line
            shown, when = self._status.get(r.rank, ("", 0.0))
            if text and text != shown and now - when >= STATUS_EVERY_S:
                out.write(f"[rank {r.rank:>{self._width}}] {text}\n")
                self._status[r.rank] = (text, now)
        if lines or skipped:
            out.flush()

    def close(self) -> None:
        self.update()
        self._out().write(summary(self.job) + "\n")
        self._out().flush()


def summary(job: JobState) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(job.counts().items()))
    return f"[nbdist] job {job.id}: {job.state} in {job.elapsed:.1f} s on {job.backend} ({counts})"

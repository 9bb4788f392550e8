"""The text view: rank-labelled output lines while the job runs, then a one-line summary.

Works everywhere (terminal IPython, nbconvert, a saved notebook). ``update`` prints only what
is new; call it from the thread that waits for the job (about ten times a second), or let
``start`` call it from a thread of its own (``--bg``). Progress bars and metrics, which have
no line of their own, are printed when they changed, at most every ``STATUS_EVERY_S``.
"""

from __future__ import annotations

import html
import sys
import threading
import time
from typing import TextIO

from nbdist.state import FINAL, JobState, RankState
from nbdist.views import status
from nbdist.views._background import BackgroundRenderer

#: A rank's progress, metrics or self-drawn (``\r``) line is reprinted at most this often.
STATUS_EVERY_S = 2.0
#: Updates per second when the view runs on its own thread.
RATE_HZ = 10.0
#: A job of more than ``status.GROUP_ABOVE`` ranks prints one summary line (states, progress
#: spread, the ranks worth a look) at most this often, instead of a line per rank.
SUMMARY_EVERY_S = 10.0


class TextView(BackgroundRenderer):
    """Prints a job's output as ``[rank N] line``; see the module docstring.

    Parameters
    ----------
    job : JobState
        The state to render; the view only reads it.
    stream : file, optional
        Where to print; default: ``sys.stdout`` at the time of each write.
    """

    #: Rendered by the thread that waits for the job (``views.LiveView``).
    ticks = True

    def __init__(self, job: JobState, stream: TextIO | None = None) -> None:
        self.job = job
        self.stream = stream
        self._seq = 0
        self._status: dict[int, tuple[str, float]] = {}
        self._silent: set[int] = set()
        self._note = ""  # the last note written
        self._note_at = 0.0
        self._notes_seen = 0  # of the job's notes (JobState.notes_set)
        self._pending = ""  # a countdown not written yet (written STATUS_EVERY_S apart)
        self._log_error_said = False  # JobState.log_error, written once
        self._summary = ""
        self._summary_at = 0.0
        self._width = len(str(max(job.np - 1, 0)))
        self._lock = threading.Lock()
        self._closed = False
        super().__init__(f"nbdist-text-{job.id}")

    def _out(self) -> TextIO:
        return self.stream or sys.stdout

    def update(self) -> None:
        with self._lock:
            if not self._closed:
                self._update()

    def _say_log_error(self, out: TextIO) -> bool:
        """Write the job's log error (``JobState.log_error``) once; whether it wrote."""
        if not self.job.log_error or self._log_error_said:
            return False
        out.write(f"[nbdist] {self.job.log_error}\n")
        self._log_error_said = True
        return True

    def _update(self, *, final: bool = False) -> None:
        lines, skipped = self.job.lines_since(self._seq)
        out = self._out()
        if skipped:
            out.write(f"[nbdist] ... {skipped} lines not shown (output faster than the view; "
                      f"each rank's last lines are kept)\n")
        for line in lines:
            out.write(f"[rank {line.rank:>{self._width}}] {line.text}\n")
            self._seq = line.seq
        now = time.monotonic()
        wrote = bool(lines or skipped)
        # Every note, even one replaced before this view looked (an attempt that started and
        # ended between two ticks); a capacity wait's countdown at a slower pace, its newest.
        fresh, self._notes_seen = self.job.notes_since(self._notes_seen)
        if fresh:
            self._pending = ""
        for i, note in enumerate(fresh):
            if note == self._note:
                continue
            if _countdown(note, self._note) and not final and (
                    i < len(fresh) - 1 or now - self._note_at < STATUS_EVERY_S):
                self._pending = note if i == len(fresh) - 1 else ""
                continue
            out.write(f"[nbdist] {note}\n")
            self._note, self._note_at = note, now
            wrote = True
        wrote = self._say_log_error(out) or wrote
        if self._pending and (final or now - self._note_at >= STATUS_EVERY_S):
            out.write(f"[nbdist] {self._pending}\n")
            self._note, self._note_at, self._pending = self._pending, now, ""
            wrote = True
        if self.job.np > status.GROUP_ABOVE:
            return self._update_many(out, now, wrote, final)
        with self.job.lock:
            states = [(r.rank, _status_of(r)) for r in self.job.ranks]
        for rank, text in states:
            shown, when = self._status.get(rank, ("", 0.0))
            if text and text != shown and (final or now - when >= STATUS_EVERY_S):
                out.write(f"[rank {rank:>{self._width}}] {text}\n")
                self._status[rank] = (text, now)
                wrote = True
        silent = set(self.job.silent_ranks())
        for rank in sorted(silent ^ self._silent):
            r = self.job.ranks[rank]
            if rank in silent:
                what = status.silent_since(r)
            elif r.status in FINAL:
                continue  # it ended (its state says how), which is not being heard from
            else:
                what = "heard from again"
            out.write(f"[rank {rank:>{self._width}}] {what}\n")
            wrote = True
        self._silent = silent
        if wrote:
            out.flush()

    def _update_many(self, out: TextIO, now: float, wrote: bool, final: bool) -> None:
        """A large job: one summary line when it changed (at most every ``SUMMARY_EVERY_S``),
        and the ranks that fall silent or are heard from again, as ranges, in one line each."""
        summary = self.job.summary()
        line = status.summary_line(summary)
        if line != self._summary and (final or now - self._summary_at >= SUMMARY_EVERY_S):
            out.write(f"[nbdist] {line}\n")
            self._summary, self._summary_at = line, now
            wrote = True
        silent = set(summary.silent)
        gone = [r for r in self._silent - silent if self.job.ranks[r].status not in FINAL]
        if silent - self._silent:
            out.write(f"[nbdist] {status.SILENT} since now: ranks "
                      f"{status.rank_ranges(sorted(silent - self._silent))} (no heartbeat from "
                      f"their supervisors)\n")
            wrote = True
        if gone:
            out.write(f"[nbdist] heard from again: ranks {status.rank_ranges(gone)}\n")
            wrote = True
        self._silent = silent
        if wrote:
            out.flush()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.update()
            if self.job.status in FINAL and self.job.ended is not None:
                break
            self._stop.wait(1.0 / RATE_HZ)
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._update(final=True)
            self._closed = True
            self._out().write(summary(self.job) + "\n")
            self._out().flush()



def _countdown(note: str, shown: str) -> bool:
    """Whether ``note`` only updates the capacity wait ``shown`` (printed at a slower pace)."""
    return "waiting for" in note and "waiting for" in shown


def _status_of(r: RankState) -> str:
    """A rank's progress, metrics and self-drawn line, as one line of text."""
    parts = []
    bar = r.current_bar
    if bar:
        parts.append(html.unescape(status.progress_text(bar)))
    if r.metrics:
        parts.append(html.unescape(status.metrics_text(r.metrics)))
    if r.status_line:
        parts.append(r.status_line)
    return " · ".join(parts)


def summary(job: JobState) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in sorted(job.counts().items()))
    text = f"[nbdist] job {job.id}: {job.status} in {job.elapsed:.1f} s on {job.backend} ({counts})"
    if job.failed_ranks:
        text += f"; failed ranks: {', '.join(map(str, job.failed_ranks))}"
    return text

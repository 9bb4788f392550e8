"""``%dist_status JOB --timeline`` and ``--trace PATH``: where a job's launch time went.

The marks and phases are ``nbdist.timeline``'s; this renders them as a table of marks, a bar
per rank (text in a terminal, HTML in a notebook) and a line of medians, and writes the Chrome
trace file.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import stat
import statistics
import tempfile

from nbdist import timeline
from nbdist.state import JobState
from nbdist.views.status import MAX_TABLE_ROWS, Report, html_table, start_lines, text_table

#: Characters of a rank's bar in the text view.
BAR_CHARS = 60
#: One letter per phase in the text bars, one colour per phase in the HTML bars.
LETTERS = {
    "schedule": "s", "zygote imports": "z", "rendezvous": "r", "spawn": "p",
    "interpreter": "i", "imports": "m", "first output": "o", "cell": "c", "result": "v",
    "exit": "x", "deliver": "d",
}
COLORS = {
    "schedule": "#bdbdbd", "zygote imports": "#8d6e63", "rendezvous": "#ffb300",
    "spawn": "#7e57c2", "interpreter": "#5c6bc0", "imports": "#26a69a",
    "first output": "#90caf9", "cell": "#1e88e5", "result": "#43a047", "exit": "#e57373",
    "deliver": "#757575",
}


def rank_marks(job: JobState) -> list[tuple[int, str, dict[str, float]]]:
    """``(rank, host, marks)`` of every rank, with the job's ``submitted`` mark added."""
    with job.lock:
        return [(r.rank, r.host or "?", {timeline.SUBMITTED: job.created, **r.marks})
                for r in job.ranks]


class TraceTargetError(ValueError):
    """A path :func:`export_trace` will not write: the message says why."""


def trace_target_problem(path: str) -> str | None:
    """Why a trace file cannot be written at ``path`` (None: it can). Only a regular file, or
    a name not taken yet in an existing folder: the path is never opened nor followed (a
    FIFO nobody reads would block the kernel for ever; a symbolic link would have its target
    overwritten)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            return f"there is no folder {folder!r} to write it in"
        return None
    except OSError as exc:
        return f"cannot look at it: {exc.strerror or exc}"
    kinds = [(stat.S_ISLNK, "a symbolic link (nbdist does not write through links: name the "
                            "file itself)"),
             (stat.S_ISDIR, "a folder (name a file in it, e.g. "
                            f"{os.path.join(path, 'trace.json')})"),
             (stat.S_ISFIFO, "a named pipe (FIFO); nbdist writes only regular files"),
             (stat.S_ISSOCK, "a socket; nbdist writes only regular files"),
             (stat.S_ISCHR, "a device; nbdist writes only regular files"),
             (stat.S_ISBLK, "a device; nbdist writes only regular files")]
    for test, what in kinds:
        if test(st.st_mode):
            return f"it is {what}"
    return None


def export_trace(job: JobState, path: str) -> str:
    """Write the job's launch as a Chrome trace file (``timeline.chrome_trace``); a line
    saying what was written.

    Written to a new file beside it, then renamed over it: ``path`` itself is never opened, so
    a reader sees the old file or the new one, and a FIFO, a device or a link put there in
    the meantime is replaced, never written to. Raises :class:`TraceTargetError` for a path
    that is not a regular file (:func:`trace_target_problem`) or a folder it cannot write in.
    """
    problem = trace_target_problem(path)
    if problem is not None:
        raise TraceTargetError(problem)
    trace = timeline.chrome_trace(rank_marks(job), job.id)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, staging = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                       dir=folder)
    except OSError as exc:
        raise TraceTargetError(f"cannot write a file in {folder}: "
                               f"{exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)  # what open() would make, not mkstemp's 0600
            json.dump(trace, f, separators=(",", ":"))
        os.replace(staging, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise TraceTargetError(f"cannot write it: {exc.strerror or exc}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staging)
        raise
    n = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    return (f"wrote {path}: {n} phases of {job.np} ranks of job {job.id} (open it in "
            f"https://ui.perfetto.dev or chrome://tracing)")


def _seconds(t: float | None, t0: float) -> str:
    return "-" if t is None else f"{t - t0:.3f}"


class TimelineReport(Report):
    """A job's launch timeline: marks per rank, a bar per rank, and the median phases."""

    def __init__(self, job: JobState) -> None:
        self.job = job
        self.ranks = rank_marks(job)[:MAX_TABLE_ROWS]
        self.more = max(0, job.np - MAX_TABLE_ROWS)
        self.t0 = job.created
        present = {m for _, _, marks in self.ranks for m in marks}
        self.columns = [m for m in timeline.MARKS if m in present]
        self.phases = {rank: timeline.phases(rank, marks) for rank, _, marks in self.ranks}
        ends = [p.end for ps in self.phases.values() for p in ps]
        self.span = max(ends) - self.t0 if ends else 0.0

    def head(self) -> str:
        return (f"job {self.job.id}: launch timeline of {self.job.np} ranks on "
                f"{self.job.backend}; seconds after the job was submitted (each host's clock)")

    def rows(self) -> list[list[str]]:
        return [[str(rank), host, *(_seconds(marks.get(m), self.t0) for m in self.columns)]
                for rank, host, marks in self.ranks]

    def medians(self) -> list[tuple[str, float]]:
        """Each phase's median duration over the ranks that went through it, in order."""
        by: dict[str, list[float]] = {}
        for ps in self.phases.values():
            for p in ps:
                by.setdefault(p.name, []).append(p.duration)
        order = list(timeline.PHASES.values())
        return [(name, statistics.median(by[name])) for name in order if name in by]

    def _bar(self, rank: int) -> str:
        cells = [" "] * BAR_CHARS
        if self.span <= 0:
            return "".join(cells)
        scale = BAR_CHARS / self.span
        for p in self.phases[rank]:
            a = int((p.start - self.t0) * scale)
            b = max(a + 1, int((p.end - self.t0) * scale)) if p.duration > 0 else a
            for i in range(max(0, a), min(BAR_CHARS, b)):
                cells[i] = LETTERS[p.name]
        return "".join(cells)

    def _text(self) -> str:
        parts = [self.head(), *start_lines(self.job, forked=True),
                 text_table(["rank", "host", *self.columns], self.rows())]
        if self.more:
            parts.append(f"... and {self.more} more ranks (the trace file has them all)")
        width = len(str(max(self.job.np - 1, 0)))
        parts.append(f"\n{'':>{width + 5}} 0 s{'':{BAR_CHARS - 10}}{self.span:>7.2f} s")
        parts += [f"rank {rank:>{width}} |{self._bar(rank)}|" for rank, _, _ in self.ranks]
        parts.append("legend: " + "  ".join(f"{c} {name}" for name, c in LETTERS.items()))
        medians = self.medians()
        if medians:
            parts.append("median per rank: " + ", ".join(f"{name} {d:.3f} s"
                                                         for name, d in medians))
        return "\n".join(parts)

    def _bar_html(self, rank: int) -> str:
        if self.span <= 0:
            return ""
        segs = []
        for p in self.phases[rank]:
            if p.duration <= 0:
                continue
            left = 100 * (p.start - self.t0) / self.span
            width = max(0.2, 100 * p.duration / self.span)
            segs.append(
                f"<div title='{html.escape(p.name)}: {p.duration:.3f} s' style='position:"
                f"absolute;left:{left:.2f}%;width:{width:.2f}%;top:0;bottom:0;"
                f"background:{COLORS[p.name]}'></div>")
        return ("<div class='nbdist-timeline-bar' style='position:relative;height:14px;"
                "min-width:30em;background:#f5f5f5'>" + "".join(segs) + "</div>")

    def _repr_html_(self) -> str:
        header = ["rank", "host", *self.columns, "timeline"]
        fields = [f"c{i}" for i in range(len(header))]
        rows = [[*row, self._bar_html(rank)]
                for row, (rank, _, _) in zip(self.rows(), self.ranks, strict=True)]
        table = html_table(header, fields, rows, raw=frozenset({fields[-1]}))
        legend = " ".join(
            f"<span style='white-space:nowrap'><span style='display:inline-block;width:10px;"
            f"height:10px;background:{color}'></span> {html.escape(name)}</span>"
            for name, color in COLORS.items())
        medians = ", ".join(f"{html.escape(n)} {d:.3f} s" for n, d in self.medians())
        more = f"<div>… and {self.more} more ranks</div>" if self.more else ""
        starts = "".join(f"<div>{html.escape(line)}</div>"
                         for line in start_lines(self.job, forked=True))
        return (f"<div class='nbdist-timeline'><div>{html.escape(self.head())} · "
                f"{self.span:.2f} s in all</div>{starts}{table}{more}<div>{legend}</div>"
                f"<div>median per rank: {medians}</div></div>")


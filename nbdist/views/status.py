"""``%dist_status`` and the pieces of text and HTML every view shares.

Each report renders as plain text (terminal IPython, ``print``) and as HTML (notebooks, through
``_repr_html_``). Everything user-controlled (output lines, hosts, metric names) is escaped.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from nbdist.resources import size_text
from nbdist.state import (
    CANCELLED,
    DONE,
    FAILED,
    FINAL,
    HEARTBEAT_S,
    PENDING,
    RUNNING,
    SILENT_AFTER_S,
    STARTING,
    ElasticState,
    JobState,
    RankState,
)

if TYPE_CHECKING:
    from nbdist.launch import Capacity
    from nbdist.protocol import ProgressEvent

STATE_COLORS = {
    PENDING: "#9e9e9e", STARTING: "#5c6bc0", RUNNING: "#1e88e5",
    DONE: "#2e7d32", FAILED: "#c62828", CANCELLED: "#ef6c00",
}
#: The badge of a rank that should be talking but was not heard of (``RankState.silent``).
SILENT = "silent"
SILENT_COLOR = "#8e24aa"
#: Rows of a static summary or a ranks report before the rest is summed up in one line.
MAX_TABLE_ROWS = 64
#: Lines of output (all ranks, merged) kept in the static summary of a finished job.
SUMMARY_LOG_LINES = 200
LAST_LINE_CHARS = 60


# -- small formatters -----------------------------------------------------------------------------
def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_text(bar: ProgressEvent) -> str:
    """``desc: n/total · rate · ETA`` for one progress bar (plain text, already safe as HTML)."""
    n, total, rate = bar.get("n") or 0, bar.get("total"), bar.get("rate")
    text = f"{n}/{_num(total)}" if total else f"{n} it"
    if isinstance(rate, (int, float)) and rate > 0:
        text += f" · {rate:.3g} it/s" if rate >= 1 else f" · {1 / rate:.3g} s/it"
        if isinstance(total, (int, float)) and total > n:
            text += f" · ETA {_duration((total - n) / rate)}"
    desc = bar.get("desc")
    return html.escape(f"{desc}: {text}" if desc else text)


def metrics_text(metrics: dict[str, Any]) -> str:
    """``loss=0.3121 acc=0.91`` (escaped)."""
    return html.escape(" ".join(f"{k}={_num(v)}" for k, v in metrics.items()))


def _counts(job: JobState) -> str:
    order = (PENDING, STARTING, RUNNING, DONE, FAILED, CANCELLED)
    counts = job.counts()
    text = ", ".join(f"{counts[s]} {s}" for s in order if counts.get(s))
    silent = job.silent_ranks()
    if silent:
        text += f" ({len(silent)} {SILENT}: {_ranks(silent)})"
    return text


def silent_since(r: RankState) -> str:
    """``silent since 12:03:05``: when a silent rank was last heard of (a value that does not
    change while it stays silent, so views do not re-render it every second)."""
    when = time.strftime("%H:%M:%S", time.localtime(r.last_seen or 0))
    return f"{SILENT} since {when}: no heartbeat from its supervisor"


def _last(r: RankState, limit: int = LAST_LINE_CHARS) -> str:
    last = r.status_line or r.last_line
    return (last[:limit] + "...") if len(last) > limit else last


def state_color(state: str) -> str:
    return SILENT_COLOR if state == SILENT else STATE_COLORS.get(state, "#777")


def _badge(state: str) -> str:
    color = state_color(state)
    return (f'<span style="background:{color};color:white;padding:0 4px;border-radius:3px">'
            f"{html.escape(state)}</span>")


def _elapsed(job: JobState) -> str:
    # While running, whole seconds: the header is re-rendered every tick, and a value that
    # does not change sends no message.
    return f"{job.elapsed:.1f} s" if job.status in FINAL else f"{job.elapsed:.0f} s"


def header_html(job: JobState) -> str:
    """The panel's header: job, backend, np, state, elapsed, failed ranks, and why it ended."""
    parts = [f"<b>nbdist job {html.escape(job.id)}</b>", html.escape(job.backend),
             f"{job.np} ranks", _badge(job.status), _elapsed(job), html.escape(_counts(job))]
    failed = job.failed_ranks
    if failed:
        parts.append(f"<b style='color:#c62828'>failed ranks: {_ranks(failed)}</b>")
    text = " · ".join(parts)
    if job.note:  # a job that restarts: its attempt, and why the one before ended
        text += f"<br><b class='nbdist-note'>{html.escape(job.note)}</b>"
    if job.status in FINAL and job.reason:
        text += f"<br><span style='color:#555'>{html.escape(job.reason.splitlines()[0])}</span>"
    return text


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:20]))
    return shown + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


def collapsed_summary(job: JobState) -> str:
    """One line for a job with too many ranks to show each: states and progress spread."""
    fractions = []
    for r in job.ranks:
        bar = r.current_bar
        if bar and isinstance(bar.get("total"), (int, float)) and bar["total"]:
            fractions.append(min(1.0, (bar.get("n") or 0) / bar["total"]))
    text = f"{job.np} ranks: {_counts(job)}"
    if fractions:
        text += (f" · progress min {min(fractions):.0%}, median "
                 f"{statistics.median(fractions):.0%}, max {max(fractions):.0%} "
                 f"({len(fractions)} ranks reporting)")
    lines = sum(r.lines for r in job.ranks)
    text += f" · {lines} lines of output"
    return html.escape(text) + "<br><span style='color:#777'>rows below: rank 0, failed ranks, " \
        "then the slowest ranks</span>"


# -- tables ---------------------------------------------------------------------------------------
def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = [[("" if c is None else str(c)) for c in r] for r in rows]
    cells = [[str(c) for c in header], *body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def html_table(header: Sequence[str], fields: Sequence[str], rows: Sequence[Sequence[Any]],
                raw: frozenset[str] = frozenset()) -> str:
    """An HTML table of rows (named tuples of ``fields``); cells are escaped unless their
    field is in ``raw`` (HTML made here, such as a state badge)."""
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(
            f"<td style='text-align:left'>"
            f"{c if name in raw else html.escape('' if c is None else str(c))}</td>"
            for name, c in zip(fields, row, strict=True)
        ) + "</tr>"
        for row in rows
    )
    return (f"<table class='nbdist-table'><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


class JobRow(NamedTuple):
    """One row of ``%dist_status``; views replace fields by name (``row._replace(state=...)``)."""

    job: str
    backend: str
    np: int
    state: str
    elapsed: str
    failed_ranks: str
    result_ready: str


_JOB_COLUMNS = ("job", "backend", "np", "state", "elapsed", "failed ranks", "result ready")


def _result_ready(job: JobState) -> str:
    if job.status == DONE:
        return "dropped" if job.values_dropped else "yes"
    return "no" if job.status in FINAL else "-"


def _job_state(j: JobState) -> str:
    silent = j.silent_ranks()
    text = f"{j.status} ({len(silent)} {SILENT})" if silent else j.status
    attempts = _attempt_rows(j)
    return f"{text}, attempt {attempts[-1][0]}" if len(attempts) > 1 else text


def _job_row(j: JobState) -> JobRow:
    return JobRow(j.id, j.backend, j.np, _job_state(j), f"{j.elapsed:.1f} s",
                  ",".join(map(str, j.failed_ranks)) or "-", _result_ready(j))


def jobs_table(jobs: Sequence[JobState]) -> str:
    if not jobs:
        return "no nbdist jobs in this kernel yet"
    return text_table(_JOB_COLUMNS, [_job_row(j) for j in jobs])


class RankRow(NamedTuple):
    """One rank's row in ``%dist_status JOB`` and the job summaries."""

    rank: int
    state: str
    host: str | None
    pid: int | None
    gpu: str
    exit: int | None
    seen: str
    resources: str
    progress: str
    last_line: str


_RANK_COLUMNS = (
    "rank", "state", "host", "pid", "gpu", "exit", "seen", "resources", "progress", "last line",
)


def _seen(r: RankState) -> str:
    """How long ago a running rank was last heard of (it sends a heartbeat every 5 s)."""
    if r.status in FINAL or r.last_seen is None:
        return "-"
    return f"{_duration(time.time() - r.last_seen)} ago"


def rank_state(r: RankState) -> str:
    """The rank's state, or ``silent`` for one that should be talking and is not."""
    return SILENT if r.silent() else r.status


def _rank_row(r: RankState) -> RankRow:
    bar = r.current_bar
    return RankRow(r.rank, rank_state(r), r.host, r.pid, r.gpu or "-", r.exit_code, _seen(r),
                   resources_text(r), html.unescape(progress_text(bar)) if bar else "", _last(r))


def resources_text(r: RankState) -> str:
    """What a running rank uses (``CPU 187% · RSS 1.2 GB · GPU0 93% ...``), once it ended the
    most it used (``peak RSS 1.2 GB · CPU 187%``); "" before its first sample
    (``nbdist.resources``)."""
    if r.status in FINAL:
        return peaks_text(r)
    if r.resources is None:
        return ""
    return r.resources.text()


def peaks_text(r: RankState) -> str:
    """The most a rank used: ``peak RSS 21.7 GB · CPU 187% · GPU 31.5 GB`` ("" unknown)."""
    parts = []
    if r.peak_rss:
        parts.append(f"peak RSS {size_text(r.peak_rss)}")
    if r.peak_cpu is not None:
        parts.append(f"CPU {r.peak_cpu:.0f}%")
    if r.peak_gpu_mem:
        parts.append(f"GPU {size_text(r.peak_gpu_mem)}")
    return " · ".join(parts)


def ends_lines(job: JobState) -> list[str]:
    """How each rank that did not finish ended (``rank 1: killed by the kernel's
    out-of-memory killer, peak RSS 21.7 GB``), then where every rank's complete log is."""
    with job.lock:
        lines = [f"rank {r.rank}: {r.end}" for r in job.ranks if r.end][:MAX_TABLE_ROWS]
    if job.forensics:
        lines.append("where the ranks were (stacks nbdist took):")
        lines += [f"  {line}" for line in job.forensics.splitlines()]
    if job.log_dir:
        lines.append(f"logs: every line of rank R in {job.log_dir}/rank-R.log "
                     f"(%dist_status {job.id} --rank R --lines N shows its end)")
    return lines


def _rank_rows(job: JobState) -> tuple[list[RankRow], int]:
    rows = [_rank_row(r) for r in job.ranks[:MAX_TABLE_ROWS]]
    return rows, max(0, job.np - MAX_TABLE_ROWS)


def _job_head(job: JobState) -> str:
    return (f"job {job.id}: {job.np} ranks on {job.backend}, {_job_state(job)}, "
            f"{job.elapsed:.1f} s")


def silent_note(job: JobState) -> str:
    """What silent ranks mean and what to do, or "" when there are none."""
    silent = job.silent_ranks()
    if not silent:
        return ""
    return (f"{SILENT} ranks: {_ranks(silent)}: nothing heard for over {SILENT_AFTER_S:g} s "
            f"although each rank's supervisor sends a heartbeat every {HEARTBEAT_S:g} s. Its "
            f"process, host or network to the driver may be stuck; %dist_cancel {job.id} "
            f"stops the job.")


def _ranks_block(job: JobState, head: str) -> str:
    """``head``, the reason the job ended (if any), and the table of its ranks."""
    if job.reason:
        head += f"\n{job.reason.splitlines()[0]}"
    rows, more = _rank_rows(job)
    table = text_table(_RANK_COLUMNS, rows)
    if more:
        table += f"\n... and {more} more ranks ({_counts(job)})"
    note = silent_note(job)
    ends = "".join(f"\n{line}" for line in ends_lines(job))
    return head + "\n" + table + (f"\n{note}" if note else "") + ends


def ranks_table(job: JobState) -> str:
    attempts = attempts_table(job)
    return _ranks_block(job, _job_head(job)) + (f"\n{attempts}" if attempts else "")


def _attempt_rows(job: JobState) -> list[tuple[str, ...]]:
    if not isinstance(job, ElasticState):  # a job that restarts (--max-restarts)
        return []
    with job.lock:
        return [(f"{a.number} of {job.total}", a.job_id, f"{a.duration:.1f} s",
                 a.cause or "running", a.verdict or "-") for a in job.attempts]


_ATTEMPT_COLUMNS = ("attempt", "ran as", "duration", "how it ended", "then")


def attempts_table(job: JobState) -> str:
    """The attempts of a job that restarts, with how each ended ("" for any other job)."""
    rows = _attempt_rows(job)
    return f"attempts:\n{text_table(_ATTEMPT_COLUMNS, rows)}" if rows else ""


def _log_tail(job: JobState) -> tuple[list[str], int]:
    """The last lines of all ranks as ``[rank N] text``, and how many earlier ones are left out."""
    with job.lock:
        merged = list(job.merged)[-SUMMARY_LOG_LINES:]
        total = job.seq
    width = len(str(max(job.np - 1, 0)))
    return [f"[rank {ln.rank:>{width}}] {ln.text}" for ln in merged], total - len(merged)


def summary_text(job: JobState) -> str:
    """A job at its end, as plain text: its last lines of output, a summary line, its ranks.

    This is what a notebook keeps for renderers without widgets (a saved notebook reopened
    without widget state, nbconvert to text), so it reads like the text view.
    """
    lines, skipped = _log_tail(job)
    head = [f"[nbdist] ... {skipped} earlier lines not kept here"] if skipped else []
    counts = _counts(job)
    line = f"[nbdist] job {job.id}: {job.status} in {job.elapsed:.1f} s on {job.backend} ({counts})"
    return "\n".join([*head, *lines, _ranks_block(job, line)])


def summary_html(job: JobState) -> str:
    """The same as :func:`summary_text` as HTML, for the notebook once the job ended."""
    rows, more = _rank_rows(job)
    rows = [row._replace(state=_badge(row.state)) for row in rows]
    table = html_table(_RANK_COLUMNS, RankRow._fields, rows, raw=frozenset({"state"}))
    if more:
        table += f"<div>… and {more} more ranks</div>"
    lines, skipped = _log_tail(job)
    note = f"last {len(lines)} of {len(lines) + skipped} lines" if skipped else \
        f"{len(lines)} lines"
    log = html.escape("\n".join(lines))
    return (f"<div class='nbdist-summary-static'>{header_html(job)}"
            f"<details><summary>ranks</summary>{table}</details>"
            f"<details><summary>output ({note})</summary>"
            f"<pre style='max-height:20em;overflow:auto'>{log}</pre></details>"
            f"{_forensics_html(job)}</div>")


def _forensics_html(job: JobState) -> str:
    if not job.forensics:
        return ""
    return ("<details open><summary>where the ranks were (stacks nbdist took)</summary>"
            f"<pre style='max-height:20em;overflow:auto'>{html.escape(job.forensics)}</pre>"
            "</details>")


# -- %dist_status ---------------------------------------------------------------------------------
class Report:
    def _text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self._text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self._text())


class JobsReport(Report):
    """``%dist_status``: this kernel's jobs and the capacity of the backends in use.

    Parameters
    ----------
    jobs : sequence of JobState
    capacities : sequence of (backend name, Capacity)
    rejected : int
        Connections the event server refused (bad secret or malformed).
    """

    def __init__(self, jobs: Sequence[JobState], capacities: Sequence[tuple[str, Capacity]],
                 rejected: int = 0) -> None:
        self.jobs = list(jobs)
        self.capacities = list(capacities)
        self.rejected = rejected

    def _capacity_lines(self) -> list[str]:
        lines = [f"capacity ({name}): {c.slots} ranks at once, {c.gpus} GPUs — {c.detail}"
                 for name, c in self.capacities]
        if self.rejected:
            lines.append(f"event channel: {self.rejected} connections rejected (bad secret or "
                         f"malformed)")
        return lines

    def _text(self) -> str:
        return "\n".join([jobs_table(self.jobs), "", *self._capacity_lines()])

    def _repr_html_(self) -> str:
        if self.jobs:
            rows = [
                _job_row(j)._replace(
                    state=_badge(j.status) + (f" {_badge(SILENT)}" if j.silent_ranks() else ""))
                for j in self.jobs
            ]
            table = html_table(_JOB_COLUMNS, JobRow._fields, rows, raw=frozenset({"state"}))
        else:
            table = "<p>no nbdist jobs in this kernel yet</p>"
        caps = "".join(f"<div>{html.escape(line)}</div>" for line in self._capacity_lines())
        return f"<div class='nbdist-status'>{table}{caps}</div>"


class RanksReport(Report):
    """``%dist_status JOB``: one job's ranks (state, host, pid, GPU, exit code, last lines)."""

    def __init__(self, job: JobState) -> None:
        self.job = job

    def _text(self) -> str:
        return ranks_table(self.job)

    def _repr_html_(self) -> str:
        job = self.job
        with job.lock:
            rows, more = _rank_rows(job)
            # The last lines, and the line being redrawn (a bar the rank draws) after them.
            tails = {r.rank: ([ln.text for ln in list(r.log)[-5:]]
                              + ([r.status_line] if r.status_line else []))[-5:]
                     for r in job.ranks[:len(rows)]}
        rows = [
            row._replace(
                state=_badge(row.state),
                last_line="<pre style='margin:0'>"
                + html.escape("\n".join(tails[row.rank] or [row.last_line])) + "</pre>",
            )
            for row in rows
        ]
        table = html_table((*_RANK_COLUMNS[:-1], "last lines"), RankRow._fields, rows,
                            raw=frozenset({"state", "last_line"}))
        more_html = f"<div>… and {more} more ranks</div>" if more else ""
        note = silent_note(job)
        note_html = f"<div style='color:{SILENT_COLOR}'>{html.escape(note)}</div>" if note else ""
        attempts = _attempt_rows(job)
        attempts_html = html_table(_ATTEMPT_COLUMNS, _ATTEMPT_COLUMNS, attempts) \
            if attempts else ""
        ends_html = "".join(f"<div>{html.escape(line)}</div>" for line in ends_lines(job))
        return (f"<div class='nbdist-status'>{header_html(job)}{table}{more_html}"
                f"{note_html}{ends_html}{attempts_html}</div>")

"""``%dist_status`` and the pieces of text and HTML every view shares.

Each report renders as plain text (terminal IPython, ``print``) and as HTML (notebooks, through
``_repr_html_``). Everything user-controlled (output lines, hosts, metric names) is escaped.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from nbdist.protocol import size_text
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
    Group,
    JobState,
    RankState,
    Summary,
    select_ranks,
)

if TYPE_CHECKING:
    from nbdist.protocol import ProgressEvent



class Capacity(Protocol):
    """What ``%dist_status`` shows of a backend's capacity (``launch.Capacity`` is one): the
    views read it by shape, never import the launchers."""

    @property
    def slots(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    @property
    def detail(self) -> str: ...


STATE_COLORS = {
    PENDING: "#9e9e9e", STARTING: "#5c6bc0", RUNNING: "#1e88e5",
    DONE: "#2e7d32", FAILED: "#c62828", CANCELLED: "#ef6c00",
}
#: The badge of a rank that should be talking but was not heard of (``RankState.silent``).
SILENT = "silent"
SILENT_COLOR = "#8e24aa"
#: Rows of a static summary or a ranks report before the rest is summed up in one line.
MAX_TABLE_ROWS = 64
#: Above this many ranks, reports lead with a summary line and a row per host, and list only
#: the ranks worth a look (failed, silent, outliers, rank 0), up to this many rows.
GROUP_ABOVE = 16
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
    if job.log_error:
        text += f"<br><span class='nbdist-log-error' style='color:#c62828'>" \
                f"{html.escape(job.log_error)}</span>"
    return text


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:20]))
    return shown + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")


def rank_ranges(ranks: Sequence[int]) -> str:
    """``0-7, 9, 12-15``: ranks in order, runs as ranges."""
    parts: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if parts and parts[-1][1] == r - 1:
            parts[-1] = (parts[-1][0], r)
        else:
            parts.append((r, r))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def group_states(g: Group) -> str:
    """``6 running, 1 done, 1 failed (1 silent)``."""
    counts = ((g.starting, "starting"), (g.running, RUNNING), (g.done, DONE),
              (g.failed, FAILED), (g.cancelled, CANCELLED))
    text = ", ".join(f"{n} {word}" for n, word in counts if n)
    return text + (f" ({len(g.silent)} {SILENT})" if g.silent else "")


def group_progress(g: Group) -> str:
    """``slowest rank 5 at 12%, median 70%, fastest rank 33 at 91%`` ("" without bars)."""
    if g.slowest is None or g.fastest is None or g.median is None:
        return ""
    if len(g.ranks) == 1:
        return f"{g.slowest[1]:.0%}"
    return (f"slowest rank {g.slowest[0]} at {g.slowest[1]:.0%}, median {g.median:.0%}, "
            f"fastest rank {g.fastest[0]} at {g.fastest[1]:.0%}")


def summary_line(s: Summary) -> str:
    """One line for many ranks: states, the progress spread, the ranks worth a look."""
    text = f"{len(s.ranks)} ranks on {len(s.hosts)} hosts: {group_states(s)}"
    progress = group_progress(s)
    if progress:
        text += f" · {progress}"
        if s.reporting < len(s.ranks):
            text += f" ({s.reporting} ranks report progress)"
    if s.failed_ranks:
        text += f" · failed: {_ranks(list(s.failed_ranks))}"
    if s.silent:
        text += f" · {SILENT}: {_ranks(list(s.silent))}"
    if s.outliers:
        text += f" · behind the rest: {_ranks(list(s.outliers))}"
    return text


class HostRow(NamedTuple):
    """One host's row in the reports of a large job."""

    host: str
    ranks: str
    states: str
    progress: str


_HOST_COLUMNS = ("host", "ranks", "states", "progress")


def host_rows(s: Summary) -> list[HostRow]:
    """A row per host: its ranks, their states and the spread of their progress."""
    return [HostRow(g.name, rank_ranges(g.ranks), group_states(g), group_progress(g))
            for g in s.hosts]


def worth_a_look(s: Summary, limit: int) -> list[int]:
    """Up to ``limit`` ranks to list one by one: failed, silent, outliers, rank 0, then the
    slowest of the rest (rank order for ranks without a bar)."""
    chosen = dict.fromkeys([*s.attention, 0])
    return list(chosen)[:limit]


def collapsed_summary(job: JobState, s: Summary | None = None) -> str:
    """The panel's summary of a job with too many ranks to show each (HTML)."""
    s = job.summary() if s is None else s
    lines = sum(r.lines for r in job.ranks)
    return (html.escape(f"{summary_line(s)} · {lines} lines of output")
            + "<br><span style='color:#777'>rows below: failed, silent and lagging ranks, "
            "rank 0, then the slowest; every rank by host further down</span>")


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


def _rank_rows(job: JobState, ranks: Sequence[int] | None = None,
               limit: int | None = MAX_TABLE_ROWS) -> tuple[list[RankRow], int]:
    """Rows of ``ranks`` (default: all) up to ``limit`` (None: no limit), and how many more."""
    chosen = list(range(job.np)) if ranks is None else list(ranks)
    shown = chosen if limit is None else chosen[:limit]
    return [_rank_row(job.ranks[r]) for r in shown], len(chosen) - len(shown)


def _grouped(job: JobState) -> bool:
    return job.np > GROUP_ABOVE


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
    if job.log_dir and job.log_error:
        lines.append(f"logs: {job.log_error}")
    elif job.log_dir:
        lines.append(f"logs: every line of rank R in {job.log_dir}/rank-R.log "
                     f"(%dist_status {job.id} --rank R --lines N shows its end)")
    return lines


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


#: How a rank's interpreter was obtained (``RankState.start``), in words.
STARTS = {
    "forked": ("forked from a zygote", "forked from a zygote"),
    "warm": ("started in a warm interpreter, not forked",
             "started in warm interpreters, not forked"),
    "fresh": ("started as a fresh interpreter", "started as fresh interpreters"),
}


def start_lines(job: JobState, forked: bool = False) -> list[str]:
    """How the job's ranks started and why not from a zygote, one line per way and reason:
    ``ranks 0, 1 started as fresh interpreters: the zygote cannot fork: thread ...``. Ranks
    forked from a zygote are left out unless ``forked``."""
    groups: dict[tuple[str, str], list[int]] = {}
    with job.lock:
        for r in job.ranks:
            if r.start in STARTS and (forked or r.start != "forked"):
                groups.setdefault((r.start, r.start_why), []).append(r.rank)
    lines = []
    for (how, why), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
        words = STARTS[how][len(ranks) > 1]
        lines.append(f"{who} {words}" + (f": {why}" if why and how != "forked" else ""))
    return lines


def _ranks_block(job: JobState, head: str, ranks: str | None = None) -> str:
    """``head``, the reason the job ended (if any), and the table of its ranks: every rank
    of a small job; of a large one a summary line, a row per host and the ranks worth a look;
    the ranks ``ranks`` names (``state.select_ranks``) when given."""
    if job.reason:
        head += f"\n{job.reason.splitlines()[0]}"
    notes = [*start_lines(job), silent_note(job), *ends_lines(job)]
    with job.lock:
        if ranks is not None:
            chosen = select_ranks(ranks, job.ranks)
            rows, more = _rank_rows(job, chosen, None)
            table = text_table(_RANK_COLUMNS, rows) if rows else f"no rank matches {ranks!r}"
        elif _grouped(job):
            s = job.summary()
            rows, more = _rank_rows(job, worth_a_look(s, GROUP_ABOVE), None)
            table = (f"{summary_line(s)}\n{text_table(_HOST_COLUMNS, host_rows(s))}\n"
                     f"ranks worth a look:\n{text_table(_RANK_COLUMNS, rows)}\n"
                     f"(%dist_status {job.id} --ranks all lists every rank; or --ranks 8-15, "
                     f"failed, silent, outliers, host=NAME)")
        else:
            rows, more = _rank_rows(job)
            table = text_table(_RANK_COLUMNS, rows)
            if more:
                table += f"\n... and {more} more ranks ({_counts(job)})"
    return head + "\n" + table + "".join(f"\n{note}" for note in notes if note)


def ranks_table(job: JobState, ranks: str | None = None) -> str:
    attempts = attempts_table(job)
    return _ranks_block(job, _job_head(job), ranks) + (f"\n{attempts}" if attempts else "")


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
    """The same as :func:`summary_text` as HTML, for the notebook once the job ended.

    A large job keeps its summary line, a row per host and the ranks worth a look, so that
    the notebook file stays small whatever the number of ranks."""
    with job.lock:
        if _grouped(job):
            s = job.summary()
            rows, more = _rank_rows(job, worth_a_look(s, GROUP_ABOVE), None)
            more = job.np - len(rows)
            hosts = (f"<div>{html.escape(summary_line(s))}</div>"
                     + html_table(_HOST_COLUMNS, HostRow._fields, host_rows(s)))
        else:
            rows, more = _rank_rows(job)
            hosts = ""
    rows = [row._replace(state=_badge(row.state)) for row in rows]
    table = hosts + html_table(_RANK_COLUMNS, RankRow._fields, rows, raw=frozenset({"state"}))
    if more:
        table += f"<div>… and {more} more ranks (%dist_status {html.escape(job.id)} " \
                 f"--ranks all lists them)</div>"
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
        lines = [f"capacity ({name}): {c.slots} ranks at once, {c.gpus} "
                 f"GPU{'' if c.gpus == 1 else 's'} — {c.detail}"
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
    """``%dist_status JOB``: one job's ranks (state, host, pid, GPU, exit code, last lines).

    ``ranks``: a filter (``state.select_ranks``: ``"8-15"``, ``"failed"``, ``"all"``...) to
    list those ranks; without one, a large job shows a summary, its hosts and the ranks worth
    a look. A filter that does not parse raises ``ValueError`` here, before anything shows."""

    def __init__(self, job: JobState, ranks: str | None = None) -> None:
        self.job = job
        self.ranks = ranks
        if ranks is not None:
            select_ranks(ranks, job.ranks)

    def _text(self) -> str:
        return ranks_table(self.job, self.ranks)

    def _repr_html_(self) -> str:
        job = self.job
        hosts = ""
        with job.lock:
            if self.ranks is not None:
                rows, more = _rank_rows(job, select_ranks(self.ranks, job.ranks), None)
            elif _grouped(job):
                s = job.summary()
                rows, _ = _rank_rows(job, worth_a_look(s, GROUP_ABOVE), None)
                more = job.np - len(rows)
                hosts = (f"<div>{html.escape(summary_line(s))}</div>"
                         + html_table(_HOST_COLUMNS, HostRow._fields, host_rows(s))
                         + "<div>ranks worth a look:</div>")
            else:
                rows, more = _rank_rows(job)
            # The last lines, and the line being redrawn (a bar the rank draws) after them.
            tails = {row.rank: ([ln.text for ln in list(job.ranks[row.rank].log)[-5:]]
                                + ([job.ranks[row.rank].status_line]
                                   if job.ranks[row.rank].status_line else []))[-5:]
                     for row in rows}
        rows = [
            row._replace(
                state=_badge(row.state),
                last_line="<pre style='margin:0'>"
                + html.escape("\n".join(tails[row.rank] or [row.last_line])) + "</pre>",
            )
            for row in rows
        ]
        table = hosts + html_table((*_RANK_COLUMNS[:-1], "last lines"), RankRow._fields, rows,
                                    raw=frozenset({"state", "last_line"}))
        more_html = (f"<div>… and {more} more ranks (%dist_status {html.escape(job.id)} --ranks "
                     f"all lists them; or --ranks 8-15, failed, silent, host=NAME)</div>"
                     if more else "")
        note = silent_note(job)
        note_html = "".join(f"<div>{html.escape(line)}</div>" for line in start_lines(job))
        note_html += f"<div style='color:{SILENT_COLOR}'>{html.escape(note)}</div>" if note else ""
        attempts = _attempt_rows(job)
        attempts_html = html_table(_ATTEMPT_COLUMNS, _ATTEMPT_COLUMNS, attempts) \
            if attempts else ""
        ends_html = "".join(f"<div>{html.escape(line)}</div>" for line in ends_lines(job))
        return (f"<div class='nbdist-status'>{header_html(job)}{table}{more_html}"
                f"{note_html}{ends_html}{attempts_html}</div>")

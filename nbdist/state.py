"""The driver's model of jobs and ranks, fed by events. Pure Python, no I/O.

Memory is bounded whatever the ranks print: each rank keeps its last ``LOG_LINES`` lines, the
job keeps the last ``MERGED_LINES`` lines of all ranks in order, and an unfinished line is cut
at ``MAX_PARTIAL`` characters. What falls out of view is counted, never silently lost.
"""

from __future__ import annotations

import collections
import operator
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from nbdist import timeline
from nbdist.lines import split_lines
from nbdist.protocol import HEARTBEAT_S as HEARTBEAT_S
from nbdist.protocol import SILENT_AFTER_S as SILENT_AFTER_S
from nbdist.protocol import ProgressEvent, RankStatus
from nbdist.resources import Resources
from nbdist.series import MetricSeries

LOG_LINES = 1000
MERGED_LINES = 5000
#: Notes (``JobState.note``) kept for the views that print each one.
NOTES_KEPT = 50
MAX_PARTIAL = 64 * 1024
#: Rich displays (``DisplayEvent``: ``display()``, figures) a job keeps for its views, of all
#: ranks, newest last, in number and in bytes: what falls out was shown already (the panel's
#: panes keep what they showed) or is counted (``JobState.displays_seen``).
DISPLAYS_KEPT = 64
DISPLAY_BYTES_KEPT = 64 * 1024 * 1024

#: Rank and job statuses, in the order a rank goes through them (``protocol.RankStatus``).
PENDING, STARTING, RUNNING, DONE, FAILED, CANCELLED = (s.value for s in RankStatus)
FINAL = frozenset({DONE, FAILED, CANCELLED})
_TALKING = frozenset({STARTING, RUNNING})  # a rank that should be heard of (RankState.silent)
_ORDER = {s.value: s.order for s in RankStatus}


class Display(NamedTuple):
    """A rank's rich output: a Jupyter mime bundle, as the rank sent it (``DisplayEvent``)."""

    seq: int  # the job's displays counted from 1
    rank: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    note: str  # what was left out to bound it, in words ("" for nothing)
    size: int

    @property
    def text(self) -> str:
        """Its text form: ``text/plain``, else the kinds it has."""
        plain = self.data.get("text/plain")
        if isinstance(plain, str) and plain:
            return plain
        return "[" + ", ".join(sorted(self.data)) + "]"


class Line(NamedTuple):
    # A NamedTuple, not a dataclass: one is built per output line, on the event server's
    # thread, and this is twice as fast (a flood of 200k lines/s passes through here).
    seq: int
    rank: int
    stream: str  # "o" stdout, "e" stderr
    text: str
    end: str  # "\n", "\r", or "" for a line flushed before its end


@dataclass
class RankState:
    rank: int
    status: str = PENDING  # a RankStatus word
    host: str | None = None
    pid: int | None = None
    gpu: str | None = None
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    last_seen: float | None = None  # wall time of the rank's last event (heartbeats included)
    last_output: float | None = None  # wall time of the rank's last output
    log: collections.deque[Line] = field(
        default_factory=lambda: collections.deque(maxlen=LOG_LINES)
    )
    lines: int = 0  # lines received in all
    # The line being redrawn with \r (a progress bar the rank draws itself), or an unfinished
    # line: only its latest form is kept, and it is cleared once a line of its stream ends.
    status_line: str = ""
    status_stream: str = ""  # the stream ("o"/"e") status_line came from
    progress: dict[int, ProgressEvent] = field(default_factory=dict)
    bar: int | None = None  # id of the progress bar updated last (the one views show)
    metrics: dict[str, Any] = field(default_factory=dict)
    resources: Resources | None = None  # the latest sample of its supervisor (resources.py)
    #: The most it used while it ran (kept after it ended): resident memory, memory on its
    #: GPUs (summed over them), CPU (percent of one core).
    peak_rss: int | None = None
    peak_gpu_mem: int | None = None
    peak_cpu: float | None = None
    #: How a rank that did not finish ended, in words ("killed by the kernel's out-of-memory
    #: killer, peak RSS 21.7 GB"; "killed by SIGSEGV"); "" otherwise.
    end: str = ""
    marks: dict[str, float] = field(default_factory=dict)  # its launch's marks (timeline.py)
    #: How its interpreter was obtained (``forked`` from a zygote, ``warm``, ``fresh``; "" not
    #: yet known) and why it was not forked, in words (``rank.supervisor.Taken``).
    start: str = ""
    start_why: str = ""

    @property
    def dropped(self) -> int:
        """Lines received that no longer fit in ``log``."""
        return self.lines - len(self.log)

    @property
    def current_bar(self) -> ProgressEvent | None:
        """The progress bar the rank updated last: the one every view shows for it."""
        return self.progress.get(self.bar) if self.bar is not None else None

    @property
    def last_line(self) -> str:
        return self.log[-1].text if self.log else ""

    def silent(self, now: float | None = None) -> bool:
        """Whether the rank should be talking (starting, running) but has not for a while."""
        if self.status not in _TALKING or self.last_seen is None:
            return False
        return (time.time() if now is None else now) - self.last_seen >= SILENT_AFTER_S


class JobState:
    """One job as the driver sees it; every method is safe to call from any thread."""

    def __init__(self, job_id: str, backend: str, np: int) -> None:
        self.id = job_id
        self.backend = backend
        self.np = np
        self.status = PENDING  # a RankStatus word: the job's, from its ranks'
        self.created = time.time()
        self.ended: float | None = None
        self.reason = ""  # why it failed / was cancelled, in words
        #: One line the views show under the header while it changes (a job that restarts:
        #: "attempt 2 of 4 ...", "waiting for 4 slots, 2 free"); "" for none.
        self.note = ""
        #: Every note set, newest last (a text view prints each, even one replaced before it
        #: looked), and how many were ever set.
        self.notes: collections.deque[str] = collections.deque(maxlen=NOTES_KEPT)
        self.notes_set = 0
        self.ranks = [RankState(r) for r in range(np)]
        self.merged: collections.deque[Line] = collections.deque(maxlen=MERGED_LINES)
        self.seq = 0
        self.version = 0  # bumped on every change; views re-render when it moved
        self.rejected = 0
        #: Where every line of every rank is written (``nbdist.logfiles``), or None.
        self.log_dir: str | None = None
        #: Why the log files could not be written (or stopped being written), or None.
        self.log_error: str | None = None
        #: Where its ranks were when nbdist stopped the job (a timeout, a cancel): their
        #: stacks, grouped (``nbdist.stacks``); "" when none were taken.
        self.forensics = ""
        self.values_dropped = False  # its values were let go to bound memory (settings.history_mb)
        self._partial: dict[tuple[int, str], str] = {}
        self.lock = threading.RLock()
        self.series = MetricSeries(np, self.created)  # every rank's metrics, for the charts
        self.displays: collections.deque[Display] = collections.deque(maxlen=DISPLAYS_KEPT)
        self.displays_seen = 0  # displays received in all (``Display.seq`` of the newest)
        self._display_bytes = 0

    # -- events ---------------------------------------------------------------------------------
    def apply(self, rank: int, event: Mapping[str, Any]) -> None:
        """Fold one rank event into the state.

        ``event`` is a ``protocol.RankEvent`` as it came off the network: every field is
        checked here before it is used, and what does not fit is ignored."""
        if not 0 <= rank < self.np:
            return
        with self.lock:
            self._fold(self.ranks[rank], event, time.time())

    def apply_many(self, rank: int, events: Iterable[Mapping[str, Any]],
                   folded: list[Mapping[str, Any]] | None = None) -> None:
        """Fold the events of one rank's write, in order, as :meth:`apply` does each: under
        one hold of the lock and one reading of the clock (the driver of 1024 ranks folds
        about 250 writes a second). An event that raises does not keep the others out; the
        first error is raised once all are in. ``folded``: gets the events that folded (what
        else they feed, rank 0's metrics to MLflow, takes those, even when one raised)."""
        if not 0 <= rank < self.np:
            return
        error: Exception | None = None
        with self.lock:
            r, now = self.ranks[rank], time.time()
            for event in events:
                try:
                    self._fold(r, event, now)
                except Exception as exc:  # a field of a type no check foresaw
                    error = error or exc
                else:
                    if folded is not None:
                        folded.append(event)
        if error is not None:
            raise error

    def _fold(self, r: RankState, event: Mapping[str, Any], now: float) -> None:
        """One event of rank ``r`` at wall time ``now``; the caller holds the lock."""
        kind = event.get("t")
        r.last_seen = now
        if kind == "hb":
            return  # a heartbeat only says the rank's supervisor is alive
        if kind == "out":
            r.last_output = now
            text = event.get("text")
            if isinstance(text, str):
                self._output_text(r, str(event.get("s", "o")), text)
        elif kind == "progress":
            # The event itself is the bar (n, total, desc, rate, elapsed): no copy.
            bar_id = event.get("id", 0)
            r.bar = bar_id if isinstance(bar_id, int) else 0
            r.progress[r.bar] = cast(ProgressEvent, event)  # as the rank sent it
            postfix = event.get("postfix")  # tqdm's set_postfix: metrics at step n
            if isinstance(postfix, dict):
                r.metrics.update(postfix)
                step = event.get("step", event.get("n"))  # n, counted on across resets
                self.series.add(r.rank, postfix, step, now)
        elif kind == "metrics":
            values = event.get("values")
            if isinstance(values, dict):
                r.metrics.update(values)
                self.series.add(r.rank, values, event.get("step"), now)
        elif kind == "state":
            self._rank_state(r, event)
        elif kind == "res":
            r.resources = res = Resources.from_event(event, now)
            r.peak_rss = _max(r.peak_rss, res.peak, res.rss)
            r.peak_cpu = _max(r.peak_cpu, res.cpu)
            if res.gpus:
                r.peak_gpu_mem = _max(r.peak_gpu_mem, sum(g.mem or 0 for g in res.gpus))
        elif kind == "marks":
            at = event.get("at")
            if isinstance(at, dict):
                r.marks.update(timeline.clean(at))
        elif kind == "display":
            self._display(r, event)
        elif kind == "hello":
            r.host = event.get("host")
            gpus = event.get("gpus") or []
            r.gpu = ",".join(map(str, gpus)) or None
        self.version += 1

    def _display(self, r: RankState, event: Mapping[str, Any]) -> None:
        """Keep a rank's display (bounded), and put its text form in the rank's log."""
        data, metadata = event.get("data"), event.get("metadata")
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            return
        note = event.get("note")
        size = event.get("size")
        size = size if type(size) is int and size >= 0 else sum(
            len(v) if isinstance(v, str) else 1024 for v in data.values())
        self.displays_seen += 1
        shown = Display(self.displays_seen, r.rank, data,
                        metadata if isinstance(metadata, dict) else {},
                        note if isinstance(note, str) else "", size)
        if len(self.displays) == self.displays.maxlen:
            self._display_bytes -= self.displays[0].size
        self.displays.append(shown)
        self._display_bytes += size
        while len(self.displays) > 1 and self._display_bytes > DISPLAY_BYTES_KEPT:
            self._display_bytes -= self.displays.popleft().size
        r.last_output = time.time()
        self._output_text(r, "o", shown.text + "\n")

    def displays_since(self, seq: int, rank: int | None = None) -> list[Display]:
        """The displays kept that came after display ``seq`` (of ``rank``, or of every rank)."""
        with self.lock:
            return [d for d in self.displays
                    if d.seq > seq and (rank is None or d.rank == rank)]

    def _rank_state(self, r: RankState, event: Mapping[str, Any]) -> None:
        new = event.get("state")
        if new == "ready":
            return
        if isinstance(event.get("pid"), int) and new == STARTING:
            r.pid = event["pid"]
        if new == STARTING and isinstance(event.get("start"), str):
            r.start = event["start"]
            why = event.get("why")
            r.start_why = why if isinstance(why, str) else ""
        if event.get("host"):
            r.host = event["host"]
        if new in _ORDER and _ORDER[new] > _ORDER[r.status]:
            # Only forward: "running" comes from the rank's interpreter and "starting" from its
            # supervisor, on two threads, so a warm interpreter's "running" may come first.
            r.status = str(new)
            if new in (STARTING, RUNNING) and r.started is None:
                r.started = time.time()
            if new in FINAL:
                r.ended = time.time()
                r.exit_code = event.get("exit")
            if self.status == PENDING:
                self.status = RUNNING

    def _output_text(self, r: RankState, stream: str, text: str) -> None:
        """Fold a chunk of output: lines ended by \n, \r\n or \r, then an unfinished rest."""
        if "\r" in text:
            segs, rest = split_lines(text)
            self._output(r, stream, [*segs, [rest, ""]] if rest else segs)
            return
        # The fast path: whole lines only, built in bulk (a flood passes through here).
        parts = text.split("\n")
        rest = parts.pop()
        if parts:
            if self._partial:
                key = (r.rank, stream)
                if key in self._partial:
                    parts[0] = self._partial.pop(key) + parts[0]
            seq, rank, n = self.seq, r.rank, len(parts)
            if n == 1:  # the usual event of a rank that is not flooding
                lines: list[Line] = [Line(seq + 1, rank, stream, parts[0], "\n")]
            else:
                lines = [Line(seq + i, rank, stream, p, "\n") for i, p in enumerate(parts, 1)]
            self.seq = seq + n
            r.log.extend(lines)
            r.lines += n
            self.merged.extend(lines)
            if r.status_line and r.status_stream == stream:
                r.status_line = ""  # the line it showed has ended (and is in the log now)
        if rest:
            self._output(r, stream, [[rest, ""]])

    def _output(self, r: RankState, stream: str, segs: list[list[str]]) -> None:
        key = (r.rank, stream)
        for text, end in segs:
            text = self._partial.pop(key, "") + text
            if end == "\r":
                # A redraw: what follows replaces this line, which never reaches the log (the
                # rank flushed it before, as "step 1/5", and now starts over: "\rstep 2/5").
                if text:
                    r.status_line, r.status_stream = text, stream
                continue
            if end == "" and len(text) < MAX_PARTIAL:
                # Flushed before its newline: keep it open, but show it already.
                self._partial[key] = text
                r.status_line, r.status_stream = text, stream
                continue
            if r.status_stream == stream:
                r.status_line = ""  # its line has ended: the log shows it from now on
            self.seq += 1
            line = Line(self.seq, r.rank, stream, text, end)
            r.log.append(line)
            r.lines += 1
            self.merged.append(line)

    # -- transitions the job makes itself -------------------------------------------------------
    def set_rank(self, rank: int, status: str, exit_code: int | None = None) -> None:
        with self.lock:
            r = self.ranks[rank]
            if r.status not in FINAL:
                r.status = status
                r.ended = time.time() if status in FINAL else r.ended
                r.exit_code = exit_code if exit_code is not None else r.exit_code
            self.version += 1

    def set_end(self, rank: int, how: str, peak_rss: int | None = None) -> None:
        """How a rank that did not finish ended (``RankOutcome.how``), and its peak memory
        as its supervisor measured it."""
        with self.lock:
            r = self.ranks[rank]
            r.end = how
            r.peak_rss = _max(r.peak_rss, peak_rss)
            self.version += 1

    def set_note(self, note: str) -> None:
        """The line the views show under the header (see ``note``)."""
        with self.lock:
            if note != self.note:
                self._set_note(note)
                self.version += 1

    def set_forensics(self, text: str) -> None:
        """The ranks' grouped stacks, taken before nbdist stopped them."""
        with self.lock:
            self.forensics = text
            self.version += 1

    def set_log_error(self, error: str) -> None:
        """The ranks' log files cannot be written (``logfiles.RankLogs``): the views say so."""
        with self.lock:
            self.log_error = error
            self.version += 1

    def finish(self, status: str, reason: str = "") -> None:
        with self.lock:
            self.status = status
            self.reason = reason
            self.ended = time.time()
            self.series.flush(self.ended)
            for (rank, stream), text in list(self._partial.items()):
                if text:  # close lines that never got their newline
                    self._output(self.ranks[rank], stream, [["", "\n"]])
            self.version += 1

    # -- reading --------------------------------------------------------------------------------
    def notes_since(self, count: int) -> tuple[list[str], int]:
        """The notes set after the first ``count`` (those still kept), and how many were set."""
        with self.lock:
            fresh = min(self.notes_set - count, len(self.notes))
            return (list(self.notes)[len(self.notes) - fresh:] if fresh > 0 else []), \
                self.notes_set

    def _set_note(self, note: str) -> None:  # holding the lock
        self.note = note
        self.notes.append(note)
        self.notes_set += 1

    def lines_since(self, seq: int) -> tuple[list[Line], int]:
        """Merged lines after ``seq``, and how many of those already fell out of the buffer."""
        with self.lock:
            if not self.merged or self.merged[-1].seq <= seq:
                return [], 0
            first = self.merged[0].seq
            skipped = max(0, first - seq - 1)
            return [line for line in self.merged if line.seq > seq], skipped

    @property
    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.created

    @property
    def failed_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if r.status == FAILED]

    def counts(self) -> dict[str, int]:
        with self.lock:
            return dict(collections.Counter(r.status for r in self.ranks))

    def quiet_ranks(self, seconds: float, now: float | None = None) -> list[int]:
        """Running ranks that printed nothing for ``seconds`` (or since they started)."""
        now = time.time() if now is None else now
        with self.lock:
            return [r.rank for r in self.ranks if r.status == RUNNING
                    and now - (r.last_output or r.started or now) >= seconds]

    def silent_ranks(self, now: float | None = None) -> list[int]:
        """Ranks not heard of for ``SILENT_AFTER_S`` while they should be talking."""
        now = time.time() if now is None else now
        with self.lock:  # RankState.silent inlined: a panel of 1024 ranks asks on every tick
            return [r.rank for r in self.ranks if r.last_seen is not None
                    and now - r.last_seen >= SILENT_AFTER_S and r.status in _TALKING]

    def summary(self, now: float | None = None) -> Summary:
        """The numbers a view of many ranks leads with (:func:`summarize`), under the lock."""
        with self.lock:
            return summarize(self.ranks, time.time() if now is None else now)


# -- many ranks: the summary, the ranks worth a look, groups by host, a filter -------------------
#: A rank is an outlier when its progress is behind the median by more than this fraction of
#: the bar, or by more than ``OUTLIER_MADS`` median absolute deviations if that is wider.
OUTLIER_BEHIND = 0.05
OUTLIER_MADS = 3.0


def fraction(bar: ProgressEvent | Mapping[str, Any] | None) -> float | None:
    """How far a bar is (0..1), or None for none or one without a total."""
    if not bar:
        return None
    total = bar.get("total")
    if not isinstance(total, (int, float)) or total <= 0:
        return None
    n = bar.get("n") or 0
    return float(max(0.0, min(1.0, n / total))) if isinstance(n, (int, float)) else None


@dataclass(frozen=True)
class Group:
    """Ranks that share a host (or the ranks of a whole job): how many are in each state,
    and the spread of their progress."""

    name: str
    ranks: tuple[int, ...]
    starting: int = 0  # pending or starting
    running: int = 0
    done: int = 0
    failed: int = 0
    cancelled: int = 0
    silent: tuple[int, ...] = ()  # included in ``running`` / ``starting``
    failed_ranks: tuple[int, ...] = ()
    reporting: int = 0  # ranks with a progress bar that has a total
    slowest: tuple[int, float] | None = None  # (rank, fraction); the lowest rank on ties
    fastest: tuple[int, float] | None = None
    median: float | None = None


@dataclass(frozen=True)
class Summary(Group):
    """A whole job's :class:`Group`, the ranks worth a look first, and its groups by host."""

    outliers: tuple[int, ...] = ()  # running ranks far behind the median, slowest first
    hosts: tuple[Group, ...] = ()  # by their lowest rank (the order of NODE_RANK)
    #: Every rank: those still running before those that ended, each by progress then rank.
    slowest_first: tuple[int, ...] = ()

    @property
    def attention(self) -> tuple[int, ...]:
        """Failed, then silent, then outlier ranks: the ones a view shows first."""
        seen: dict[int, None] = dict.fromkeys(self.failed_ranks)
        seen.update(dict.fromkeys(self.silent))
        seen.update(dict.fromkeys(self.outliers))
        return tuple(seen)


#: What the summary needs of one rank, read once per summary: rank, status, fraction (or None),
#: silent, and the fraction or 0.0 (what the slowest-first order sorts by). A plain tuple, not
#: a NamedTuple: a panel of 1024 ranks builds 1024 of them per render.
_Seen = tuple[int, str, float | None, bool, float]


def _median(ordered: Sequence[float]) -> float:
    """``statistics.median`` of values already sorted, without its checks."""
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _group(name: str, seen: Sequence[_Seen]) -> tuple[Group, list[float]]:
    """A group's counts and progress spread, and its ranks' fractions (in rank order). One
    pass: a panel of 1024 ranks on 128 hosts calls this 129 times per render."""
    starting = running = done = failed = cancelled = 0
    ranks: list[int] = []
    silent: list[int] = []
    failed_ranks: list[int] = []
    reporting: list[int] = []  # ranks with a fraction, and their fractions
    fractions: list[float] = []
    for rank, status, frac, quiet, _ in seen:
        ranks.append(rank)
        if status == RUNNING:
            running += 1
        elif status == DONE:
            done += 1
        elif status == FAILED:
            failed += 1
            failed_ranks.append(rank)
        elif status == CANCELLED:
            cancelled += 1
        elif status == PENDING or status == STARTING:
            starting += 1
        if quiet:
            silent.append(rank)
        if frac is not None:
            reporting.append(rank)
            fractions.append(frac)
    slowest = fastest = None
    median = None
    if fractions:
        # Ties go to the lowest rank both ways (``seen`` is in rank order).
        low, high = min(fractions), max(fractions)
        slowest = (reporting[fractions.index(low)], low)
        fastest = (reporting[fractions.index(high)], high)
        median = _median(sorted(fractions))
    group = Group(
        name=name, ranks=tuple(ranks), starting=starting, running=running, done=done,
        failed=failed, cancelled=cancelled, silent=tuple(silent),
        failed_ranks=tuple(failed_ranks), reporting=len(fractions), slowest=slowest,
        fastest=fastest, median=median,
    )
    return group, fractions


def summarize(ranks: Sequence[RankState], now: float) -> Summary:
    """The job's counts and progress spread, its outliers, and the same per host.

    Pure: what ``ranks`` hold at ``now``. Ranks that have not said where they run yet are
    grouped under ``"?"``. One pass over the ranks: a panel of 1024 ranks calls this on
    every render."""
    seen: list[_Seen] = []
    by_host: dict[str, list[_Seen]] = {}
    silent_before = now - SILENT_AFTER_S
    for r in ranks:
        frac = None
        if r.bar is not None:
            bar = r.progress.get(r.bar)
            if bar:
                total, n = bar.get("total"), bar.get("n") or 0
                if isinstance(total, (int, float)) and total > 0 and isinstance(n, (int, float)):
                    frac = 0.0 if n <= 0 else 1.0 if n >= total else n / total
        status = r.status
        last = r.last_seen
        item = (r.rank, status, frac,
                (status == RUNNING or status == STARTING) and last is not None
                and last <= silent_before,
                frac or 0.0)
        seen.append(item)
        host = r.host or "?"
        members = by_host.get(host)
        if members is None:
            by_host[host] = [item]
        else:
            members.append(item)
    whole, fractions = _group("all", seen)
    # Running before ended, each by progress then rank (sorts are stable, ``seen`` in rank
    # order): two sorts on one C key, not a tuple key built per rank.
    ordered = [s for s in seen if s[1] not in FINAL]
    ordered.sort(key=_KEY)
    ended = [s for s in seen if s[1] in FINAL]
    ended.sort(key=_KEY)
    ordered += ended
    outliers: tuple[int, ...] = ()
    if whole.median is not None and len(fractions) >= 3:
        median = whole.median
        mad = _median(sorted([abs(f - median) for f in fractions]))
        behind = max(OUTLIER_BEHIND, OUTLIER_MADS * mad)
        outliers = tuple(s[0] for s in ordered if (s[1] == RUNNING or s[1] == STARTING)
                         and s[2] is not None and median - s[2] > behind)
    hosts = tuple(_group(host, members)[0] for host, members in by_host.items())
    return Summary(**{f: getattr(whole, f) for f in Group.__dataclass_fields__},
                   outliers=outliers, hosts=hosts,
                   slowest_first=tuple(s[0] for s in ordered))


_KEY = operator.itemgetter(4)  # a _Seen's fraction or 0.0


_STATES = frozenset({PENDING, STARTING, RUNNING, DONE, FAILED, CANCELLED, "silent", "outliers"})


def select_ranks(spec: str, ranks: Sequence[RankState], now: float | None = None) -> list[int]:
    """The ranks a filter names, in rank order: ``"3"``, ``"8-15"``, a state (``failed``,
    ``silent``, ``running``, ``outliers``...), ``host=NAME`` (or a host's name alone), or
    several of these separated by commas or spaces (any of them matches). ``"all"`` or ``""``
    is every rank.

    Raises ``ValueError`` naming the part of ``spec`` that is not understood."""
    now = time.time() if now is None else now
    chosen: set[int] = set()
    hosts = {r.host for r in ranks if r.host}
    summary: Summary | None = None
    np_ = len(ranks)
    for token in (t for t in re.split(r"[,\s]+", spec.strip()) if t):
        low = token.lower()
        if low == "all":
            chosen.update(range(np_))
        elif m := re.fullmatch(r"(\d+)(?:-(\d+))?", token):
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) else first
            if last < first or last >= np_:
                raise ValueError(f"ranks {token!r}: this job has ranks 0-{np_ - 1}")
            chosen.update(range(first, last + 1))
        elif low in _STATES:
            if low == "silent":
                chosen.update(r.rank for r in ranks if r.silent(now))
            elif low == "outliers":
                summary = summary or summarize(ranks, now)
                chosen.update(summary.outliers)
            else:
                chosen.update(r.rank for r in ranks if r.status == low)
        elif token.startswith("host=") or token in hosts:
            host = token.removeprefix("host=")
            if host not in hosts:
                raise ValueError(f"no rank runs on host {host!r} (hosts: {_names(hosts)})")
            chosen.update(r.rank for r in ranks if r.host == host)
        else:
            raise ValueError(
                f"{token!r} is not a rank, a range (8-15), a state ({', '.join(sorted(_STATES))})"
                f" or a host ({_names(hosts)})")
    return sorted(chosen) if spec.strip() else list(range(np_))


def _names(items: Iterable[str]) -> str:
    names = sorted(items)
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") \
        if names else "none known yet"


def _max(*values: float | None) -> Any:
    """The largest of the values that are known, or None (every ``res`` event asks)."""
    best = None
    for v in values:
        if v is not None and (best is None or v > best):
            best = v
    return best


# -- a job that restarts (--max-restarts, ``nbdist.elastic``) -----------------------------------
@dataclass
class Attempt:
    """One attempt of a job that restarts, as ``%dist_status JOB`` lists it."""

    number: int  # 1, 2, ...
    job_id: str  # the id of the attempt's own job (on the event channel, in Spark's UI)
    started: float  # wall time
    ended: float | None = None
    cause: str = ""  # why it ended, in words ("" while it runs; "done" when it succeeded)
    verdict: str = ""  # "restarted (rule 'signal')", ...

    @property
    def duration(self) -> float:
        return (self.ended or time.time()) - self.started


class ElasticState(JobState):
    """A :class:`~nbdist.JobState` that lives through several attempts.

    The attempts' jobs feed it as any job feeds its state; their ``finish`` only closes the
    attempt's unfinished lines, and the job's own end is :meth:`close`.
    """

    def __init__(self, job_id: str, backend: str, np: int, max_restarts: int) -> None:
        super().__init__(job_id, backend, np)
        self.max_restarts = max_restarts
        self.attempts: list[Attempt] = []
        #: Takes rank 0's reported metrics, whichever attempt sends them (``--mlflow``).
        self.metrics_sink: Callable[[dict[str, Any]], None] | None = None

    def apply(self, rank: int, event: Mapping[str, Any]) -> None:
        self.apply_many(rank, (event,))

    def apply_many(self, rank: int, events: Iterable[Mapping[str, Any]],
                   folded: list[Mapping[str, Any]] | None = None) -> None:
        sink = self.metrics_sink
        if sink is None or rank != 0:
            super().apply_many(rank, events, folded)
            return
        done: list[Mapping[str, Any]] = [] if folded is None else folded
        try:
            super().apply_many(rank, events, done)
        finally:  # the metrics of the events that folded, even if another one raised
            for event in done:
                if event.get("t") == "metrics":
                    sink(event.get("values") or {})

    @property
    def total(self) -> int:
        return self.max_restarts + 1

    def begin(self, number: int, job_id: str, why: str) -> None:
        """A new attempt: ranks start over (their logs go on), each marked in the log."""
        marker = f"── nbdist: attempt {number} of {self.total}{f': {why}' if why else ''} ──"
        with self.lock:
            self._close_lines()
            for i, old in enumerate(self.ranks):
                rank = RankState(i, log=old.log, lines=old.lines)
                self.ranks[i] = rank
                if self.max_restarts:  # a job that cannot restart has nothing to mark
                    self._output(rank, "o", [[marker, "\n"]])
            self.attempts.append(Attempt(number, job_id, time.time()))
            if self.max_restarts:
                self._set_note(f"attempt {number} of {self.total}" + (f" · {why}" if why else ""))
            self.version += 1

    def end_attempt(self, cause: str, verdict: str) -> None:
        with self.lock:
            if self.attempts:
                last = self.attempts[-1]
                last.ended, last.cause, last.verdict = time.time(), cause, verdict
            self.version += 1

    def finish(self, status: str, reason: str = "") -> None:
        """An attempt's end: the job goes on or ends by :meth:`close`."""
        with self.lock:
            self._close_lines()
            self.version += 1

    def close(self, final: str, reason: str = "") -> None:
        """The job's end, after its last attempt."""
        super().finish(final, reason)

    def _close_lines(self) -> None:
        for (rank, stream), text in list(self._partial.items()):
            if text:
                self._output(self.ranks[rank], stream, [["", "\n"]])

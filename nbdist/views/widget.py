"""The live panel (ipywidgets 8): one row per rank, per-rank and merged logs, a header.

Hazards this module is built around (measured in a real JupyterLab: docs/monitoring.md):

- Every widget update is a message through the kernel's IOPub channel, and Jupyter drops
  messages above about 100 updates/s per widget group. So nothing is rendered per event: one
  flusher thread renders the *latest* state about ten times a second, sets only values that
  changed (traitlets send nothing for an unchanged value) and pushes the final state once.
- Text widgets are resent whole on every change, so logs are rendered from the ring buffers
  of :mod:`nbdist.state`, cut to the last ``LOG_VIEW_LINES`` lines, and only the pane shown by
  default (rank 0) and the merged pane are refreshed on every tick; the other ranks' panes are
  refreshed in turn, one per tick.
- ``with out: print()`` from several threads mixes outputs between widgets; this module never
  captures output, it sets widget values, which is safe from any thread.
- While a cell runs in the foreground the kernel processes no message from the page, so
  nothing here depends on a click reaching the kernel while the job runs; the rank selector of
  a large job works once the kernel is idle (after the cell, or with ``--bg``).
- Widget state is not saved with the notebook by default, so when the job ends the panel
  also fills a static output (HTML and plain text) that a reopened notebook still shows.

Importing this module imports ipywidgets; the magics import it only when a panel is shown.
"""

from __future__ import annotations

import html
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as w

from nbdist.state import (
    CANCELLED,
    DONE,
    FAILED,
    FINAL,
    Display,
    JobState,
    RankState,
    Summary,
    select_ranks,
)
from nbdist.views import charts, status
from nbdist.views._background import BackgroundRenderer

if TYPE_CHECKING:
    from nbdist.protocol import ProgressEvent

#: Renders per second at most, whatever the event rate.
RATE_HZ = 10.0
#: Widget messages per second the panel allows itself; a render that sent more delays the
#: next one (16 busy ranks change ~40 widgets per tick). JupyterLab starts dropping messages
#: somewhere above 300 per second.
MESSAGES_PER_S = 200.0
#: Share of a core the panel's renders may take: after a render that took ``t`` of CPU, the
#: next waits at least ``t / RENDER_SHARE``. Renders of a few ranks take well under a
#: millisecond (so ``RATE_HZ`` decides); a render of 1024 ranks 2-5 ms, so such a panel
#: updates one to two times a second (its ranks write every 2.56 s, ``events``) and costs
#: half a percent of a core, of the 2 % that the driver may spend on 1024 ranks.
RENDER_SHARE = 0.005
#: ... but never waits longer than this (a first render that builds many widgets costs more;
#: a render of 1024 ranks on a loaded machine 8-12 ms, and such a panel's ranks each write
#: every 2.56 s, so waiting up to 2 s keeps it at its share without showing much less).
MAX_RENDER_WAIT_S = 2.0
#: ... and a panel of a few ranks (``MAX_ROWS`` or fewer: a row each, not collapsed) never
#: longer than this: its renders are cheap but for the log pane, and its user watches each bar.
SMALL_RENDER_WAIT_S = 0.5
#: Above this many ranks, rows collapse into a summary plus the ranks worth looking at, and
#: every rank is listed by host in groups that start closed.
MAX_ROWS = 16
#: Host groups of a collapsed panel re-rendered per tick besides the one open (in turn: the
#: titles, which carry each host's states and progress, are rendered on every tick).
HOST_GROUPS_PER_TICK = 2
#: Ranks a filter lists at most.
FILTER_ROWS = 64
#: Lines shown in a log pane (the state keeps more; ``%dist_status JOB`` shows the tail).
LOG_VIEW_LINES = 200
#: Characters of a rank's last line shown in its row.
LAST_LINE_CHARS = 120
#: Rich displays (``display()``, figures) a rank's pane keeps, newest last, and their bytes at
#: most: an output widget's outputs are resent whole at every change.
PANE_DISPLAYS = 8
PANE_DISPLAY_BYTES = 16 * 1024 * 1024
#: The panes' displays change at most this often (the final render shows the rest).
DISPLAY_EVERY_S = 1.0
#: Displays of rank 0 shown below the panel, at most; later ones are in its pane only (a rank
#: that draws in a loop must not flood the notebook).
BELOW_DISPLAYS = 50

# The log pane is a column-reverse flex box so that it stays scrolled to its newest line
# without any script; its <pre> must not shrink, or nothing overflows and the top shows.
_STYLE = """<style>
.nbdist-panel { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; }
.nbdist-panel .nbdist-badge { display: inline-block; min-width: 5.5em; padding: 0 4px;
  border-radius: 3px; color: white; text-align: center; font-size: 11px; }
.nbdist-panel .nbdist-log pre { margin: 0; font-size: 11px; line-height: 1.3;
  white-space: pre-wrap; word-break: break-all; flex-shrink: 0; }
.nbdist-panel .nbdist-log > .widget-html-content { display: flex; flex-direction: column-reverse;
  max-height: 22em; overflow-y: auto; }
.nbdist-panel .nbdist-muted { color: #777; }
.nbdist-panel.nbdist-final-done .nbdist-header { border-left: 4px solid #2e7d32; }
.nbdist-panel.nbdist-final-failed .nbdist-header { border-left: 4px solid #c62828; }
.nbdist-panel.nbdist-final-cancelled .nbdist-header { border-left: 4px solid #ef6c00; }
.nbdist-panel .nbdist-header { padding-left: 6px; }
</style>"""

_BAR_STYLE = {DONE: "success", FAILED: "danger", CANCELLED: "warning"}


def _badge(state: str) -> str:
    color = status.state_color(state)
    return f'<span class="nbdist-badge" style="background:{color}">{html.escape(state)}</span>'


#: ipywidgets 8 names the sections of an Accordion or a Tab by its ``titles`` trait; ipywidgets
#: 7 (classic Notebook 6, older managed notebooks) by ``_titles``, a dict from each section's
#: index (a string) to its title, which its ``set_title`` sets.
_TITLES_TRAIT = "titles" if w.Accordion.class_traits().get("titles") is not None else "_titles"


def titles(values: Sequence[str]) -> dict[str, Any]:
    """The traits that give an Accordion's or a Tab's sections these titles, on either
    ipywidgets (``w.Tab(..., **titles(names))``, ``_set(tab, **titles(names))``)."""
    if _TITLES_TRAIT == "titles":
        return {"titles": tuple(values)}
    return {"_titles": {str(i): title for i, title in enumerate(values)}}


def title(widget: w.Widget, index: int) -> str:
    """The title of section ``index`` of an Accordion or a Tab, on either ipywidgets."""
    if _TITLES_TRAIT == "titles":
        return str(widget.titles[index])
    return str(widget._titles.get(str(index), ""))


def _set(widget: w.Widget, **values: Any) -> int:
    """Set traits that differ, in one message; return the number of messages sent (0 or 1)."""
    changed = {k: v for k, v in values.items() if getattr(widget, k) != v}
    if not changed:
        return 0
    with widget.hold_sync():
        for k, v in changed.items():
            setattr(widget, k, v)
    return 1


def _fraction(bar: ProgressEvent | None) -> float:
    if not bar:
        return 0.0
    n, total = bar.get("n") or 0, bar.get("total")
    if not isinstance(total, (int, float)) or total <= 0:
        return 0.0
    return float(max(0.0, min(1.0, n / total)))


class _Row:
    """One rank's row: label (rank, state, host), bar, and a line of details."""

    def __init__(self, css: str) -> None:
        self.label = w.HTML(layout=w.Layout(width="15em"), _dom_classes=("nbdist-label",))
        self.bar = w.FloatProgress(
            value=0.0, min=0.0, max=1.0, layout=w.Layout(width="14em"),
            _dom_classes=("nbdist-bar",),
        )
        self.info = w.HTML(layout=w.Layout(flex="1 1 auto", overflow="hidden"),
                           _dom_classes=("nbdist-info",))
        self.box = w.HBox([self.label, self.bar, self.info], _dom_classes=("nbdist-row", css))

    def show(self, r: RankState) -> int:
        where = " · ".join(html.escape(x) for x in (r.host or "", f"GPU {r.gpu}" if r.gpu else "")
                           if x)
        sent = _set(self.label, value=(
            f"<b>rank {r.rank}</b> {_badge(status.rank_state(r))} "
            f"<span class='nbdist-muted'>{where}</span>"
        ))
        bar = r.current_bar
        sent += _set(self.bar, value=1.0 if r.status == DONE and bar is None else _fraction(bar),
                     bar_style=_BAR_STYLE.get(r.status, ""))
        return sent + _set(self.info, value=_details(r, bar))


def _details(r: RankState, bar: ProgressEvent | None) -> str:
    parts = []
    if r.silent():
        parts.append(f"<b style='color:{status.SILENT_COLOR}'>"
                     f"{html.escape(status.silent_since(r))}</b>")
    if bar is not None:
        parts.append(status.progress_text(bar))
    if r.metrics:
        parts.append(status.metrics_text(r.metrics))
    used = status.resources_text(r)
    if used:
        parts.append(f"<span class='nbdist-muted nbdist-res'>{html.escape(used)}</span>")
    last = r.status_line or r.last_line
    if last:
        if len(last) > LAST_LINE_CHARS:
            last = last[:LAST_LINE_CHARS] + "…"
        parts.append(f"<span class='nbdist-muted'>{html.escape(last)}</span>")
    if r.status == FAILED and r.exit_code is not None:
        parts.append(f"exit {r.exit_code}")
    return " · ".join(parts) if parts else "<span class='nbdist-muted'>…</span>"


def _log_html(lines: Sequence[tuple[str, str]], skipped: int, tail: str = "",
              log_dir: str | None = None) -> str:
    """A log pane: ``(prefix, text)`` lines, newest last; the pane sticks to its bottom."""
    body = "\n".join(f"{html.escape(p)}{html.escape(t)}" for p, t in lines)
    note = ""
    if skipped:
        where = (f"every line is in the ranks' log files in {log_dir}" if log_dir else
                 "the job's state keeps the last ones of each rank")
        note = (f"<span class='nbdist-muted'>… {skipped} earlier lines not shown here "
                f"({html.escape(where)})</span>\n")
    if tail:
        body += f"\n<i>{html.escape(tail)}</i>"
    if not body:
        body = "<span class='nbdist-muted'>(no output yet)</span>"
    return f"<pre>{note}{body}</pre>"


class Panel(BackgroundRenderer):
    """A live view of one job; renders from its own thread, at most ``RATE_HZ`` times a second.

    Parameters
    ----------
    job : JobState
        The state to render; the panel only reads it.
    max_rows : int
        Ranks shown as rows before the rows collapse into a summary.
    """

    def __init__(self, job: JobState, *, max_rows: int = MAX_ROWS) -> None:
        self.job = job
        self.collapsed = job.np > max_rows
        self.renders = 0  # how many times the panel re-rendered (not counting unchanged ticks)
        self._version: tuple[int, tuple[int, ...]] = (-1, ())  # state version, silent ranks
        self._log_turn = 0
        self._lock = threading.Lock()  # one render at a time: the flusher, or close()
        self._finalized = False
        super().__init__(f"nbdist-panel-{job.id}")
        self._handle: Any = None

        self.header = w.HTML(_dom_classes=("nbdist-header",))
        self.summary = w.HTML(_dom_classes=("nbdist-summary",))
        n_rows = min(job.np, max_rows)
        css = "nbdist-slot-{}" if self.collapsed else "nbdist-rank-{}"
        self.rows = [_Row(css.format(i)) for i in range(n_rows)]
        self.shown: list[int] = list(range(n_rows))  # rank shown by each row

        # Log panes: rank 0 (open by default) ... and all ranks merged. A large job gets one
        # pane with a rank selector instead of a pane per rank.
        if self.collapsed:
            self.pane_ranks: list[int | None] = [0, None]
            self.picker: w.Dropdown | None = w.Dropdown(
                options=[(f"rank {r}", r) for r in range(job.np)], value=0,
                description="rank", _dom_classes=("nbdist-picker",),
            )
            self.picker.observe(self._picked, names="value")
        else:
            self.pane_ranks = [*range(job.np), None]
            self.picker = None
        self.panes = [
            w.HTML(_dom_classes=("nbdist-log", "nbdist-log-all" if r is None
                                 else f"nbdist-log-{'picked' if self.collapsed else r}"))
            for r in self.pane_ranks
        ]
        names = [("all ranks" if r is None else f"rank {r}") for r in self.pane_ranks]
        # Each rank's rich displays, under its log (a large job's: the picked rank's).
        self.figures = [w.Output(_dom_classes=("nbdist-displays", f"nbdist-displays-{r}"))
                        for r in self.pane_ranks if r is not None]
        self._display_seq = 0  # the newest display taken from the state
        self._displays_at = 0.0  # when the panes' displays last changed (monotonic)
        self._below = 0  # rank 0's displays shown below the panel
        self._pane_bytes = [0] * len(self.figures)
        tabs: list[w.Widget] = [w.VBox([pane, out])
                                for pane, out in zip(self.panes, self.figures, strict=False)]
        tabs.append(self.panes[-1])
        if self.picker is not None:
            tabs[0] = w.VBox([self.picker, self.panes[0], self.figures[0]])
            names[0] = "one rank"
        self.tabs = w.Tab(children=tabs, **titles(names), selected_index=0,
                          _dom_classes=("nbdist-logs",))
        self.logs = w.Accordion(children=[self.tabs], **titles(["logs"]), selected_index=0)
        children: list[w.Widget] = [w.HTML(_STYLE), self.header]
        if self.collapsed:
            children.append(self.summary)
        children += [r.box for r in self.rows]
        # A large job: every rank, by host, in groups that start closed (the browser opens
        # them without the kernel), and a filter that lists the ranks it names.
        self.host_names: list[str] = []
        self._host_ranges: dict[tuple[int, ...], str] = {}  # a host's ranks, as ``0-7``
        self._host_turn = 0
        if self.collapsed:  # (a small job's panel opens no widget it does not show)
            self.hosts = w.Accordion(children=[], selected_index=None,
                                     _dom_classes=("nbdist-hosts",))
            self.filter = w.Text(value="", description="ranks", continuous_update=False,
                                 placeholder="8-15, failed, silent, outliers, host=NAME",
                                 _dom_classes=("nbdist-filter",))
            self.filtered = w.HTML(_dom_classes=("nbdist-filtered",))
            self.filter.observe(self._filtered, names="value")
            self.groups = w.Accordion(
                children=[w.VBox([self.filter, self.filtered, self.hosts])],
                **titles(["every rank, by host"]), selected_index=None,
                _dom_classes=("nbdist-groups",))
            children.append(self.groups)
        self.charts = charts.ChartsView(job.series)  # paced on its own (views/charts.py)
        children += [self.charts.widget, self.logs]
        self.widget = _PanelBox(children, _dom_classes=("nbdist-panel", f"nbdist-job-{job.id}"))
        self.widget.job_id = job.id
        self.render()

    #: Renders from a thread of its own once started (``views.LiveView``).
    ticks = False

    # -- life ---------------------------------------------------------------------------------
    def update(self) -> None:
        """Render now (``views.LiveView``); the panel's own thread does this when started."""
        self.render()

    def show(self) -> None:
        """Display the panel, and an output that the static summary will fill at the end."""
        from IPython import display as ipd

        display: Callable[..., Any] = ipd.display  # untyped in IPython
        display(self.widget)
        self._handle = display(_Static(""), display_id=True)

    def _loop(self) -> None:
        interval = 1.0 / RATE_HZ
        while not self._stop.is_set():
            cpu = time.thread_time()
            sent = self.render()
            cpu = time.thread_time() - cpu
            if self.job.status in FINAL and self.job.ended is not None:
                break
            longest = MAX_RENDER_WAIT_S if self.collapsed else SMALL_RENDER_WAIT_S
            self._stop.wait(max(interval, sent / MESSAGES_PER_S,
                                min(longest, cpu / RENDER_SHARE)))
        self._finish()

    # -- rendering ----------------------------------------------------------------------------
    def render(self) -> int:
        """Render the latest state if it changed since the last render; return messages sent."""
        with self._lock:
            if self._finalized:
                return 0
            return self._render(final=False)

    def _finish(self) -> None:
        with self._lock:
            if self._finalized:
                return
            self._render(final=True)
            self._finalized = True
        if self._handle is not None:
            self._handle.update(_Static(self.job))

    def _render(self, *, final: bool) -> int:
        job = self.job
        sent = self._render_displays(final) if job.displays_seen > self._display_seq else 0
        return sent + self._render_state(final=final)

    def _render_displays(self, final: bool) -> int:
        """New displays: in their rank's pane (at most every ``DISPLAY_EVERY_S``), and rank
        0's below the panel too, as the kernel would show them."""
        now = time.monotonic()
        if self._handle is None and not final:
            return 0  # not shown yet (the first render, before ``show``): rank 0's wait for it
        if not final and now - self._displays_at < DISPLAY_EVERY_S:
            return 0
        self._displays_at = now
        fresh = self.job.displays_since(self._display_seq)
        if not fresh:
            return 0
        self._display_seq = fresh[-1].seq
        sent = 0
        for i in range(len(self.figures)):
            rank = self.pane_ranks[i] if self.picker is None else self.picker.value
            mine = [d for d in fresh if d.rank == rank]
            if mine:
                sent += self._add_displays(i, mine)
        below = [d for d in fresh if d.rank == 0]
        if below and self._handle is not None:  # shown (a panel that was displayed)
            sent += self._show_below(below)
        return sent

    def _add_displays(self, i: int, shown: Sequence[Display], replace: bool = False) -> int:
        out = self.figures[i]
        outputs = [] if replace else list(out.outputs)
        outputs += [_output(d) for d in shown]
        outputs = outputs[-PANE_DISPLAYS:]
        sizes = [sum(len(v) if isinstance(v, str) else 1024 for v in o["data"].values())
                 for o in outputs]
        while len(outputs) > 1 and sum(sizes) > PANE_DISPLAY_BYTES:
            outputs.pop(0)
            sizes.pop(0)
        out.outputs = tuple(outputs)
        return 1

    def _show_below(self, shown: Sequence[Display]) -> int:
        from IPython import display as ipd

        display: Callable[..., Any] = ipd.display  # untyped in IPython

        sent = 0
        for d in shown:
            if self._below > BELOW_DISPLAYS:
                break
            self._below += 1
            if self._below > BELOW_DISPLAYS:
                display({"text/plain": (
                    f"[nbdist] rank 0 displayed more than {BELOW_DISPLAYS} times: the rest "
                    f"are in its pane of the panel only")}, raw=True)
            else:
                output = _output(d)
                display(output["data"], metadata=output["metadata"], raw=True)
            sent += 1
        return sent

    def _render_state(self, *, final: bool) -> int:
        job = self.job
        with job.lock:
            # A rank falling silent changes no state: it is the absence of events.
            version = (job.version, tuple(job.silent_ranks()))
            if version == self._version and not final:
                # The elapsed time moves on; charts held back by their pace catch up.
                return self._render_header() + self.charts.render()
            self._version = version
            self.renders += 1
            sent = self._render_header()
            if self.collapsed:
                summary = job.summary()
                sent += _set(self.summary, value=status.collapsed_summary(job, summary))
                self.shown = _worth_showing(summary, len(self.rows))
            for row, rank in zip(self.rows, self.shown, strict=False):
                sent += row.show(job.ranks[rank])
            if self.collapsed:
                sent += self._render_hosts(summary, final)
                if self.filter.value:
                    sent += _set(self.filtered, value=self._filter_html(self.filter.value))
            sent += self.charts.render(final=final)
            sent += self._render_logs(final)
        if final:
            state = job.status if job.status in FINAL else CANCELLED
            self.widget._dom_classes = (*self.widget._dom_classes, f"nbdist-final-{state}")
        return sent

    def _render_header(self) -> int:
        return _set(self.header, value=status.header_html(self.job))

    def _render_logs(self, final: bool) -> int:
        # Every pane on the final render; else the open pane, the merged pane and one more.
        count = len(self.panes)
        due = set(range(count)) if final else {0, count - 1, self._log_turn % count}
        if not final and self.tabs.selected_index is not None:
            due.add(self.tabs.selected_index)
        self._log_turn += 1
        sent = 0
        for i in sorted(due):
            rank = self.pane_ranks[i]
            if rank is not None and self.picker is not None:
                rank = self.picker.value
            sent += _set(self.panes[i], value=self._pane_html(rank))
        return sent

    def _pane_html(self, rank: int | None) -> str:
        job = self.job
        logs = None if job.log_error else job.log_dir  # never name files that were not written
        if rank is None:
            merged = list(job.merged)[-LOG_VIEW_LINES:]
            width = len(str(max(job.np - 1, 0)))
            skipped = max(0, job.seq - len(merged))
            return _log_html([(f"[{ln.rank:>{width}}] ", ln.text) for ln in merged], skipped,
                             log_dir=logs)
        r = job.ranks[rank]
        log = list(r.log)[-LOG_VIEW_LINES:]
        return _log_html([("", ln.text) for ln in log], r.lines - len(log), r.status_line,
                         logs)

    def _picked(self, change: dict[str, Any]) -> None:
        rank = int(change["new"])
        with self._lock:
            with self.job.lock:
                self.panes[0].value = self._pane_html(rank)
            self._add_displays(0, self.job.displays_since(0, rank), replace=True)

    def _render_hosts(self, summary: Summary, final: bool) -> int:
        """The host groups: every title each tick (one message), the tables in turn."""
        sent = 0
        names = [g.name for g in summary.hosts]
        if names != self.host_names:  # hosts come in with the ranks' hellos
            self.host_names = names
            self.hosts.children = [w.HTML(_dom_classes=("nbdist-host",)) for _ in names]
            self._host_ranges.clear()
            sent += 1
        ranges = self._host_ranges  # a host's ranks rarely change; its title's words do
        for g in summary.hosts:
            if g.ranks not in ranges:
                ranges[g.ranks] = status.rank_ranges(g.ranks)
        heads = [f"{g.name} · ranks {ranges[g.ranks]} · {status.group_states(g)}"
                 + (f" · {p}" if (p := status.group_progress(g)) else "")
                 for g in summary.hosts]
        sent += _set(self.hosts, **titles(heads))
        count = len(names)
        if not count:
            return sent
        due = set(range(count)) if final else {
            (self._host_turn + i) % count for i in range(HOST_GROUPS_PER_TICK)}
        if not final and self.hosts.selected_index is not None:
            due.add(self.hosts.selected_index)
        self._host_turn += HOST_GROUPS_PER_TICK
        for i in sorted(due):
            if i < count:
                sent += _set(self.hosts.children[i],
                             value=_ranks_html(self.job, summary.hosts[i].ranks))
        return sent

    def _filter_html(self, spec: str) -> str:
        try:
            ranks = select_ranks(spec, self.job.ranks)
        except ValueError as exc:
            return f"<span style='color:#c62828'>{html.escape(str(exc))}</span>"
        if not ranks:
            return f"<span class='nbdist-muted'>no rank matches {html.escape(spec)!r}</span>"
        more = len(ranks) - FILTER_ROWS
        tail = f"<div class='nbdist-muted'>… and {more} more</div>" if more > 0 else ""
        return _ranks_html(self.job, ranks[:FILTER_ROWS]) + tail

    def _filtered(self, change: dict[str, Any]) -> None:
        with self._lock, self.job.lock:
            self.filtered.value = self._filter_html(str(change["new"])) if change["new"] else ""


def _output(d: Display) -> dict[str, Any]:
    """A rank's display as an output of the notebook: its bundle, its text form labelled with
    its rank, and the rank in its metadata (``nbdist``)."""
    data = dict(d.data)
    plain = data.get("text/plain")
    data["text/plain"] = f"[rank {d.rank}] {plain if isinstance(plain, str) else d.text}"
    return {"output_type": "display_data", "data": data,
            "metadata": {**d.metadata, "nbdist": {"rank": d.rank}}}


def _ranks_html(job: JobState, ranks: Sequence[int]) -> str:
    """A compact table of ranks: state, progress, metrics, last line (a host group, a filter)."""
    rows = []
    for rank in ranks:
        r = job.ranks[rank]
        bar = r.current_bar
        last = r.status_line or r.last_line
        if len(last) > status.LAST_LINE_CHARS:
            last = last[:status.LAST_LINE_CHARS] + "…"
        rows.append(
            f"<tr><td>rank {rank}</td><td>{_badge(status.rank_state(r))}</td>"
            f"<td>{status.progress_text(bar) if bar else ''}</td>"
            f"<td>{status.metrics_text(r.metrics) if r.metrics else ''}</td>"
            f"<td class='nbdist-muted'>{html.escape(last)}</td></tr>")
    return f"<table class='nbdist-ranks'>{''.join(rows)}</table>"


def _worth_showing(summary: Summary, slots: int) -> list[int]:
    """Ranks to give the rows of a collapsed panel, in this order: failed, silent and lagging
    ranks, rank 0, then the slowest of the rest (running before ended ones)."""
    chosen = status.worth_a_look(summary, slots)
    picked = set(chosen)
    rest = (rank for rank in summary.slowest_first if rank not in picked)
    return [*chosen, *itertools.islice(rest, max(0, slots - len(chosen)))]


class _PanelBox(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
    """The panel's root; its plain-text form is what renderers without widgets show."""

    job_id = ""

    def __repr__(self) -> str:
        return f"[nbdist] live panel of job {self.job_id} (needs a widget frontend)"


class _Static:
    """The static summary shown in the notebook once the job ended (and kept when saved)."""

    def __init__(self, job: JobState | str) -> None:
        self.job = job

    def _repr_html_(self) -> str:
        if isinstance(self.job, str):
            return self.job
        with self.job.lock:
            curves = charts.static_html(self.job.series)
        return status.summary_html(self.job) + curves

    def __repr__(self) -> str:
        if isinstance(self.job, str):
            return self.job
        return status.summary_text(self.job)

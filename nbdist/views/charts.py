"""Live metric charts: one small SVG chart per metric, one line per rank, drawn by hand.

Why SVG written here, in an ``ipywidgets.HTML``, and not bqplot or an anywidget chart:

- **No new dependency, no front-end extension.** The panel already needs only ipywidgets;
  bqplot and anywidget-based charts need their JavaScript installed in the front end
  (JupyterLab, Notebook 7, VS Code, Databricks and Colab each load it their own way, some not
  at all), and a missing extension shows an error instead of a chart. An HTML widget's value is
  set as the element's HTML by every ipywidgets front end.
- **Small, bounded messages.** A redraw is one message with the whole picture; its size
  depends on the chart's pixels, not on the run's length: a line is thinned to
  ``MAX_DRAWN`` points with integer coordinates (about 7 bytes a point). Charts redraw at most
  every ``CHART_EVERY_S`` seconds and at most ``BYTES_PER_S`` bytes a second on average
  (a bigger redraw waits longer for the next), so 16 ranks × 12 metrics cannot flood IOPub.
  bqplot would send only the changed arrays, but as JSON lists of full floats, per mark.
- **The same picture in the saved notebook.** The static summary shown when the job ends
  embeds the same SVG, so a notebook reopened without widget state (or converted to HTML)
  still shows the curves. JupyterLab strips inline SVG from the HTML outputs of a notebook it
  does not trust (one it did not save itself); everything else is shown there.

Everything here is a pure function of :class:`nbdist.series.MetricSeries` except
:class:`ChartsView`, the panel's widget with its pacing.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

from nbdist.series import MetricSeries, Point

#: The chart's drawing, in SVG user units (also its size in CSS pixels).
WIDTH, HEIGHT = 300, 120
_LEFT, _RIGHT, _TOP, _BOTTOM = 40, 294, 6, 104  # the plot area inside it
#: Points drawn per line at most: about one per two pixels of the plot's width.
MAX_DRAWN = 128
#: Charts shown; further metrics are named under them.
MAX_CHARTS = 12
#: Seconds between two redraws of the charts, at least.
CHART_EVERY_S = 0.5
#: Average bytes a second the charts may send; a redraw of B bytes waits B / BYTES_PER_S.
BYTES_PER_S = 60_000

# Sixteen colours told apart on white (tab10, then six of tab20's darker shades).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
           "#7b4173", "#3182bd")
_OUTLIER_COLORS = ("#d62728", "#ff7f0e", "#9467bd")
_BAND_FILL = "#9ecae1"


class Line(NamedTuple):
    rank: int
    color: str
    points: list[Point]
    css: str  # "nbdist-line" (a rank) or "nbdist-outlier"


class Chart(NamedTuple):
    """What one chart draws: the lines, and (above 16 ranks) the band of all ranks."""

    name: str
    lines: list[Line]
    band: tuple[list[Point], list[Point], list[Point]] | None  # low, median, high
    outliers: list[int]


def chart_data(series: MetricSeries, name: str) -> Chart:
    """The lines to draw for ``name``: every rank, or rank 0, the band and the outliers."""
    if not series.banded:
        lines = [Line(rank, PALETTE[rank % len(PALETTE)], s.points(), "nbdist-line")
                 for rank, s in series.ranks(name)]
        return Chart(name, lines, None, [])
    by_rank = dict(series.ranks(name))
    lines = []
    if 0 in by_rank:
        lines.append(Line(0, PALETTE[0], by_rank[0].points(), "nbdist-line"))
    outliers = series.outliers(name, exclude=frozenset({0}))
    for color, rank in zip(_OUTLIER_COLORS, outliers, strict=False):
        lines.append(Line(rank, color, by_rank[rank].points(), "nbdist-outlier"))
    band = series.bands.get(name)
    spread = None
    if band is not None:
        spread = (band.low.points(), band.median.points(), band.high.points())
    return Chart(name, lines, spread, outliers)


def _thin(points: Sequence[Point], limit: int = MAX_DRAWN) -> list[Point]:
    """At most ``limit`` of ``points``, evenly spread, the first and the last included."""
    n = len(points)
    if n <= limit:
        return list(points)
    return [points[round(i * (n - 1) / (limit - 1))] for i in range(limit)]


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


class _Scale:
    def __init__(self, points: Sequence[Point]) -> None:
        xs = [p.step for p in points]
        ys = [p.value for p in points if math.isfinite(p.value)]
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        self.y0, self.y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if self.y1 <= self.y0:
            pad = abs(self.y0) * 0.05 or 1.0
            self.y0, self.y1 = self.y0 - pad, self.y1 + pad

    def xy(self, p: Point) -> tuple[int, int]:
        x = _LEFT + (p.step - self.x0) / (self.x1 - self.x0) * (_RIGHT - _LEFT)
        y = _BOTTOM - (p.value - self.y0) / (self.y1 - self.y0) * (_BOTTOM - _TOP)
        return round(x), round(y)


def _runs(points: Sequence[Point], scale: _Scale) -> list[str]:
    """``points`` attribute values of the polylines of one line: a NaN or infinity breaks the
    line; consecutive points on the same pixel are drawn once."""
    runs: list[str] = []
    current: list[str] = []
    last: tuple[int, int] | None = None
    for p in points:
        if not math.isfinite(p.value):
            if current:
                runs.append(" ".join(current))
            current, last = [], None
            continue
        xy = scale.xy(p)
        if xy != last:
            current.append(f"{xy[0]},{xy[1]}")
            last = xy
    if current:
        runs.append(" ".join(current))
    return runs


def chart_svg(chart: Chart) -> str:
    """One chart as an SVG element: axes' extremes as text, a polyline per line (a circle for
    a line of one point), the band as a polygon and its median dashed."""
    lines = [line._replace(points=_thin(line.points)) for line in chart.lines]
    band = tuple(_thin(b) for b in chart.band) if chart.band else None
    everything = [p for line in lines for p in line.points]
    if band:
        everything += band[0] + band[2]
    scale = _Scale(everything)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="nbdist-chart-svg" '
        f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'font-family="sans-serif" font-size="9">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{_RIGHT - _LEFT}" height="{_BOTTOM - _TOP}" '
        f'fill="none" stroke="#ccc" stroke-width="0.5"/>',
        f'<text x="{_LEFT - 3}" y="{_TOP + 8}" text-anchor="end" fill="#555">'
        f'{_fmt(scale.y1)}</text>',
        f'<text x="{_LEFT - 3}" y="{_BOTTOM}" text-anchor="end" fill="#555">'
        f'{_fmt(scale.y0)}</text>',
        f'<text x="{_LEFT}" y="{HEIGHT - 4}" fill="#555">{_fmt(scale.x0)}</text>',
        f'<text x="{_RIGHT}" y="{HEIGHT - 4}" text-anchor="end" fill="#555">'
        f'step {_fmt(scale.x1)}</text>',
    ]
    if band:
        low, median, high = band
        upper = [scale.xy(p) for p in high if math.isfinite(p.value)]
        lower = [scale.xy(p) for p in reversed(low) if math.isfinite(p.value)]
        if upper and lower:
            ring = " ".join(f"{x},{y}" for x, y in upper + lower)
            parts.append(f'<polygon class="nbdist-band" points="{ring}" fill="{_BAND_FILL}" '
                         f'fill-opacity="0.5" stroke="none"><title>min–max of all ranks'
                         f'</title></polygon>')
        for run in _runs(median, scale):
            parts.append(f'<polyline class="nbdist-median" points="{run}" fill="none" '
                         f'stroke="#3182bd" stroke-width="1" stroke-dasharray="3,2"/>')
    for line in lines:
        newest = line.points[-1] if line.points else None
        title = (f"<title>rank {line.rank}: {html.escape(chart.name)}={_fmt(newest.value)} "
                 f"at step {_fmt(newest.step)}</title>") if newest else ""
        attrs = (f'class="{line.css} nbdist-r{line.rank}" fill="none" stroke="{line.color}" '
                 f'stroke-width="{1.6 if line.css == "nbdist-outlier" or line.rank == 0 else 1.2}"')
        runs = _runs(line.points, scale)
        for run in runs:
            if " " in run:
                parts.append(f'<polyline {attrs} points="{run}">{title}</polyline>')
            else:
                x, y = run.split(",")
                parts.append(f'<circle class="{line.css} nbdist-r{line.rank}" cx="{x}" '
                             f'cy="{y}" r="1.5" fill="{line.color}">{title}</circle>')
    parts.append("</svg>")
    return "".join(parts)


def _caption(series: MetricSeries, chart: Chart) -> str:
    latest = series.latest(chart.name)
    bits = []
    if latest and not math.isnan(latest[0]):
        bits.append(f"rank 0: {_fmt(latest[0])}")
    finite = sorted(v for v in latest if math.isfinite(v))
    if series.banded and finite:
        bits.append(f"all: {_fmt(finite[0])} … {_fmt(finite[-1])}")
    if chart.outliers:
        bits.append("outliers: " + ", ".join(
            f"<span style='color:{c}'>rank {r} ({_fmt(latest[r])})</span>"
            for c, r in zip(_OUTLIER_COLORS, chart.outliers, strict=False)))
    return " · ".join(bits)


def _legend(series: MetricSeries) -> str:
    if series.banded:
        return (f"<span style='color:{PALETTE[0]}'>━ rank 0</span> · "
                f"<span style='color:{_BAND_FILL}'>█</span> min–max of all {series.np} ranks · "
                f"<span style='color:#3182bd'>┅ median</span> · outliers in red, orange, purple")
    reported = sorted({rank for name in series.names() for rank, _ in series.ranks(name)})
    return " ".join(f"<span style='color:{PALETTE[r % len(PALETTE)]}'>━ rank {r}</span>"
                    for r in reported)


def charts_html(series: MetricSeries, *, max_charts: int = MAX_CHARTS) -> str:
    """Every metric's chart (the first ``max_charts``), with a legend; "" without metrics.

    Styled inline, so that the static summary looks the same outside the panel."""
    names = series.names()
    if not names:
        return ""
    cells = []
    for name in names[:max_charts]:
        chart = chart_data(series, name)
        cells.append(
            f"<div class='nbdist-chart' data-metric='{html.escape(name, quote=True)}' "
            f"style='width:{WIDTH}px;margin:0 8px 4px 0'><div style='font-size:11px;"
            f"white-space:nowrap;overflow:hidden;text-overflow:ellipsis'><b>{html.escape(name)}"
            f"</b> <span style='color:#777'>{_caption(series, chart)}</span></div>"
            f"{chart_svg(chart)}</div>")
    notes = []
    hidden = names[max_charts:]
    if hidden:
        notes.append(f"not charted: {html.escape(', '.join(hidden))}")
    if series.refused_count:
        refused = html.escape(", ".join(sorted(series.refused)))
        notes.append(f"{series.refused_count} more metric names not kept (at most "
                     f"{series.max_metrics} per job): {refused}")
    note = "".join(f"<div style='color:#777;font-size:11px'>{n}</div>" for n in notes)
    return (f"<div class='nbdist-charts-all'><div style='font-size:11px'>{_legend(series)}</div>"
            f"<div style='display:flex;flex-wrap:wrap'>{''.join(cells)}</div>{note}</div>")


class ChartsView:
    """The panel's charts: an HTML widget redrawn from the job's series, paced.

    The caller holds the job's lock around :meth:`render` (the panel renders under it).
    """

    def __init__(self, series: MetricSeries) -> None:
        import ipywidgets as w

        self.series = series
        self.widget = w.HTML(_dom_classes=("nbdist-charts",))
        self.redraws = 0
        self.bytes_sent = 0  # the HTML sent in all, for the benchmarks
        self._version = -1
        self._next = 0.0

    def render(self, *, final: bool = False) -> int:
        """Redraw if the series moved and the pace allows (always when ``final``); return
        the messages sent (0 or 1)."""
        series = self.series
        now = time.monotonic()
        if not final and (series.version == self._version or now < self._next):
            return 0
        if final:
            series.flush(time.time())
        self._version = series.version
        value = charts_html(series)
        if value == self.widget.value:
            return 0
        self._next = now + max(CHART_EVERY_S, len(value) / BYTES_PER_S)
        self.widget.value = value
        self.redraws += 1
        self.bytes_sent += len(value)
        return 1


def static_html(series: MetricSeries) -> str:
    """The charts for the static summary under the panel ("" without metrics)."""
    body = charts_html(series)
    if not body:
        return ""
    return f"<details open><summary>metrics</summary>{body}</details>"

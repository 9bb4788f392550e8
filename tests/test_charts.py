"""The charts' SVG (nbdist/views/charts.py): valid XML, a line per rank, the band above 16
ranks, bounded size; the panel's paced chart widget and the static summary's picture."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest

from nbdist.series import MetricSeries
from nbdist.state import DONE
from nbdist.views import charts
from nbdist.views.widget import Panel, _Static

from .helpers import running_job

SVG = "{http://www.w3.org/2000/svg}"


def _svgs(html: str) -> dict[str, ET.Element]:
    """Each chart's <svg>, by metric, parsed as XML (the HTML around it is XML too)."""
    root = ET.fromstring(html)
    return {div.get("data-metric", ""): div.find(f"{SVG}svg")  # type: ignore[misc]
            for div in root.iter("div") if div.get("class") == "nbdist-chart"}


def _fed(np: int, steps: int, **special: float) -> MetricSeries:
    m = MetricSeries(np, 0.0)
    for step in range(1, steps + 1):
        for r in range(np):
            loss = 1.0 / step + r * 1e-3
            m.add(r, {"loss": special.get(f"r{r}", loss), "lr": 0.1, "note": "x"}, step,
                  step * 0.6)
    return m


def test_a_chart_per_metric_a_polyline_per_rank_in_valid_svg() -> None:
    """Four ranks: one chart per numeric metric, each an SVG with one polyline per rank."""
    svgs = _svgs(charts.charts_html(_fed(4, 30)))
    assert list(svgs) == ["loss", "lr"]
    for svg in svgs.values():
        lines = svg.findall(f"{SVG}polyline")
        assert sorted(el.get("class", "").split()[1] for el in lines) == \
            [f"nbdist-r{r}" for r in range(4)]
        assert all(len(el.get("points", "").split()) >= 2 for el in lines)
        assert svg.find(f"{SVG}polygon") is None  # no band for 4 ranks


def test_above_16_ranks_rank_0_the_band_its_median_and_the_outliers() -> None:
    """64 ranks: rank 0's line, an outlier's line, the min-max band and the median; no line
    for the ordinary ranks."""
    svg = _svgs(charts.charts_html(_fed(64, 30, r9=50.0)))["loss"]
    lines = svg.findall(f"{SVG}polyline")
    assert {el.get("class") for el in lines} == {
        "nbdist-line nbdist-r0", "nbdist-outlier nbdist-r9", "nbdist-median"}
    assert len(svg.findall(f"{SVG}polygon[@class='nbdist-band']")) == 1


def test_a_nan_breaks_the_line_and_a_long_run_stays_small() -> None:
    """A NaN splits a rank's line in two; 10k steps of 16 ranks still draw at most
    MAX_DRAWN points a line, so a redraw's size does not grow with the run."""
    m = MetricSeries(1, 0.0)
    for step in range(1, 21):
        m.add(0, {"loss": math.nan if step == 10 else 1.0 / step}, step, 0.0)
    assert len(_svgs(charts.charts_html(m))["loss"].findall(f"{SVG}polyline")) == 2
    short, long = _fed(16, 200), _fed(16, 10_000)
    small, big = charts.charts_html(short), charts.charts_html(long)
    for el in _svgs(big)["loss"].findall(f"{SVG}polyline"):
        assert len(el.get("points", "").split()) <= charts.MAX_DRAWN
    assert len(big) < 1.5 * len(small) and len(big) < 60_000


def test_metric_names_are_escaped() -> None:
    """A metric named like markup is shown as text."""
    m = MetricSeries(1, 0.0)
    m.add(0, {"<b>x</b>": 1.0}, 1, 0.0)
    html = charts.charts_html(m)
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    ET.fromstring(html)


def test_the_panel_draws_charts_paced_and_the_static_summary_keeps_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The panel's chart widget redraws when metrics move but not faster than its pace; the
    final render and the static summary show the last points."""
    job = running_job()
    panel = Panel(job)
    assert panel.charts.widget.value == ""
    job.apply(0, {"t": "metrics", "values": {"loss": 1.0}, "step": 1})
    panel.render()
    first = panel.charts.widget.value
    assert "data-metric='loss'" in first and panel.charts.redraws == 1
    job.apply(0, {"t": "metrics", "values": {"loss": 0.5}, "step": 2})
    panel.render()  # within CHART_EVERY_S of the last redraw: held back
    assert panel.charts.widget.value == first
    monkeypatch.setattr(panel.charts, "_next", 0.0)  # the pace has passed
    panel.render()  # nothing else changed: the charts catch up all the same
    assert panel.charts.widget.value != first and panel.charts.redraws == 2
    job.apply(1, {"t": "metrics", "values": {"loss": 0.25}, "step": 1})
    job.finish(DONE)
    panel.close()
    assert "nbdist-r1" in panel.charts.widget.value
    static = _Static(job)._repr_html_()
    assert "<details open><summary>metrics</summary>" in static
    assert "nbdist-r0" in static and "nbdist-r1" in static

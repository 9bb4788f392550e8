"""The metric series (nbdist/series.py) alone, and fed by the job's state from rank events."""

from __future__ import annotations

import math

import pytest

from nbdist.series import BAND_EVERY_S, MAX_POINTS, MetricSeries, Series

from .helpers import running_job


def test_a_long_series_keeps_at_most_max_points_evenly_from_first_to_last() -> None:
    """100k points leave at most MAX_POINTS, evenly spaced, the first and the newest kept."""
    s = Series()
    for i in range(100_000):
        s.add(i, i * 0.01, float(i))
    points = s.points()
    assert len(s) < MAX_POINTS and len(points) <= MAX_POINTS
    assert points[0].step == 0 and points[-1].step == 99_999
    gaps = {b.step - a.step for a, b in zip(points[:-2], points[1:-1], strict=True)}
    assert gaps == {s.stride}  # one resolution from start to end, the newest point apart
    assert len(s) > MAX_POINTS // 4  # halving keeps a useful number of points


def test_a_short_series_keeps_every_point() -> None:
    """Below the bound nothing is dropped."""
    s = Series(max_points=8)
    for i in range(7):
        s.add(i, 0.0, i * 2.0)
    assert [p.value for p in s.points()] == [0, 2, 4, 6, 8, 10, 12]
    with pytest.raises(ValueError, match="max_points=1"):
        Series(max_points=1)


def test_a_bar_reset_continues_the_steps_and_no_step_counts_on() -> None:
    """A bar counting from 0 again (a new epoch) continues after the last step; steps left
    out count on from the last."""
    s = Series()
    for n in (1, 2, 3, 1, 2):
        s.add(n, 0.0, 1.0)
    assert [p.step for p in s.points()] == [1, 2, 3, 4, 5]
    t = Series()
    for _ in range(3):
        t.add(None, 0.0, 1.0)
    assert [p.step for p in t.points()] == [0, 1, 2]


def test_only_numbers_are_charted_and_metric_names_are_bounded() -> None:
    """Strings and bools are skipped; names past max_metrics are counted, not kept."""
    m = MetricSeries(2, 100.0, max_metrics=3)
    m.add(0, {"loss": 0.5, "phase": "train", "ok": True, "n": 3}, 1, 101.0)
    assert m.names() == ["loss", "n"]
    for i in range(50):
        m.add(1, {f"x{i}": 1.0}, 1, 101.0)
    assert len(m) == 3 and m.refused_count == 49 and len(m.refused) <= 3
    assert [p.time for p in m.points("loss", 0)] == [1.0]  # time since the job began
    m.add(5, {"loss": 1.0}, 1, 102.0)  # no such rank: ignored
    assert m.latest("loss")[0] == 0.5 and math.isnan(m.latest("loss")[1])


def test_many_ranks_get_a_band_of_min_median_max_sampled_over_time() -> None:
    """Above 16 ranks, each sample of the band holds the min, median and max of the ranks'
    latest values, at most one sample per BAND_EVERY_S."""
    np = 64
    m = MetricSeries(np, 0.0)
    assert m.banded and not MetricSeries(16, 0.0).banded
    for step in range(1, 11):
        for r in range(np):
            m.add(r, {"loss": step * 100 + r}, step, step * BAND_EVERY_S + r * 1e-4)
    m.flush(100.0)
    band = m.bands["loss"]
    lows, meds, highs = (b.points() for b in band)
    assert len(meds) <= 12  # a sample per BAND_EVERY_S, not one per event
    assert lows[-1].value == 1000 and highs[-1].value == 1063 and meds[-1].value == 1031.5
    assert all(lo.value <= me.value <= hi.value for lo, me, hi in zip(lows, meds, highs,
                                                                    strict=True))
    assert [p.step for p in meds] == sorted(p.step for p in meds)


def test_outliers_are_far_from_the_median_or_not_finite_furthest_first() -> None:
    """A rank far from the others and a rank at NaN are outliers; ordinary spread is not."""
    m = MetricSeries(40, 0.0)
    for r in range(40):
        value = {7: 5.0, 9: 0.9, 11: math.nan}.get(r, 1.0 + r * 1e-3)
        m.add(r, {"loss": value}, 1, 1.0)
    assert m.outliers("loss") == [11, 7, 9]
    assert m.outliers("loss", limit=2) == [11, 7]
    assert m.outliers("loss", exclude=frozenset({11})) == [7, 9]
    calm = MetricSeries(40, 0.0)
    for r in range(40):
        calm.add(r, {"loss": 1.0 + r * 1e-3}, 1, 1.0)
    assert calm.outliers("loss") == []


def test_the_state_charts_reports_by_their_count_and_tqdm_postfix_by_the_bar_count() -> None:
    """``metrics`` events feed the series at their step; a progress event's postfix feeds it
    at the bar's n and shows among the row's metrics."""
    job = running_job()
    job.apply(0, {"t": "metrics", "values": {"loss": 0.9}, "step": 1})
    job.apply(0, {"t": "metrics", "values": {"loss": 0.7}, "step": 2})
    job.apply(1, {"t": "progress", "id": 1, "n": 40, "total": 100,
                  "postfix": {"acc": 0.5}})
    job.apply(1, {"t": "progress", "id": 1, "n": 80, "total": 100,
                  "postfix": {"acc": 0.75}})
    job.apply(1, {"t": "progress", "id": 1, "n": 90, "total": 100})  # no postfix: no point
    assert [(p.step, p.value) for p in job.series.points("loss", 0)] == \
        [(1, 0.9), (2, 0.7)]
    assert [(p.step, p.value) for p in job.series.points("acc", 1)] == \
        [(40, 0.5), (80, 0.75)]
    assert job.ranks[1].metrics == {"acc": 0.75}

"""Every metric of every rank, kept as a series for the charts, in bounded memory. Pure Python.

A rank's metrics reach the driver two ways: ``nbdist.report(loss=...)`` (a ``metrics`` event
whose ``step`` is the rank's count of reports) and a tqdm bar's postfix (``set_postfix``, which
Lightning's progress bar calls with its logged metrics; a ``progress`` event whose ``n`` is the
step). :class:`MetricSeries` keeps, for each metric name and each rank, a :class:`Series` of
``(step, time, value)`` points:

- **Bounded memory.** A series keeps at most ``MAX_POINTS`` points. When it is full, every
  other point is dropped and from then on only every second point received is kept (the
  resolution halves, again each time it fills up), so a long run is covered from its first
  point to its last at an even density. The newest point is always kept apart, so a chart
  ends where the rank is. At most ``MAX_METRICS`` metric names are kept per job; a rank
  inventing names (``loss_0``, ``loss_1``, ...) has the rest counted, not stored.
- **Steps that go back.** A bar that is reset (a new epoch's bar, Lightning's ``reset``)
  counts from 0 again; the series continues from where it was, so steps only grow.
- **Many ranks.** Above ``BAND_ABOVE`` ranks the charts draw rank 0, the band of all ranks
  (min, median, max) and the outliers, not a line per rank. The band is a series of its own,
  sampled from the ranks' latest values at most every ``BAND_EVERY_S`` seconds while the
  metric moves: O(ranks) per metric per sample, whatever the length of the run.
  :meth:`MetricSeries.outliers` picks the ranks far from the others' median.

Events arrive on the event server's thread and views read from theirs: the caller (the
job's state) holds its lock around every call.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

#: Points a series keeps before its resolution halves.
MAX_POINTS = 512
#: Metric names kept per job.
MAX_METRICS = 32
#: Above this many ranks the charts show rank 0, a band and the outliers.
BAND_ABOVE = 16
#: The band samples the ranks' latest values at most this often (seconds).
BAND_EVERY_S = 0.5
#: A rank is an outlier when its latest value is further than this many median absolute
#: deviations from the median of all ranks' latest values (or is NaN or infinite).
OUTLIER_MADS = 5.0
#: Outliers drawn per chart at most.
MAX_OUTLIERS = 3


class Point(NamedTuple):
    step: float
    time: float  # seconds since the job was created
    value: float


def number(value: Any) -> float | None:
    """``value`` as a float if it is a number to chart (bools and strings are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Series:
    """One metric of one rank: at most ``max_points`` points plus the newest one."""

    __slots__ = ("steps", "times", "values", "stride", "received", "last", "max_points",
                 "_offset", "_raw")

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError(f"a series keeps at least 2 points, not max_points={max_points}")
        self.max_points = max_points
        # Arrays of machine numbers: 20 bytes a point, not a tuple of three floats (~130).
        self.steps = array("d")
        self.times = array("f")
        self.values = array("d")
        self.stride = 1  # every stride-th point received is kept
        self.received = 0
        self.last: Point | None = None
        self._offset = 0.0  # added to the steps of a bar that started counting again
        self._raw = -math.inf  # the last step as the rank sent it

    def add(self, step: float | None, time: float, value: float) -> None:
        """Append a point; ``step`` None means "the next one" (one more than the last)."""
        if step is None:
            step = (self.last.step + 1) if self.last is not None else 0.0
        else:
            if step < self._raw:  # the bar was reset: continue after where it was
                self._offset += self._raw
            self._raw = step
            step += self._offset
        point = Point(step, time, value)
        self.last = point
        index = self.received
        self.received += 1
        if index % self.stride:
            return
        self.steps.append(step)
        self.times.append(time)
        self.values.append(value)
        if len(self.steps) >= self.max_points:
            for column in (self.steps, self.times, self.values):
                del column[1::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.steps)

    def points(self) -> list[Point]:
        """The kept points, oldest first, ending with the newest point received."""
        out = [Point(s, t, v) for s, t, v in zip(self.steps, self.times, self.values,
                                                 strict=True)]
        if self.last is not None and (not out or out[-1].step != self.last.step):
            out.append(self.last)
        return out


class Band(NamedTuple):
    """The spread of all ranks' latest values, sampled over the run."""

    low: Series
    median: Series
    high: Series


class MetricSeries:
    """The series of every metric of every rank of one job.

    Parameters
    ----------
    np : int
        Number of ranks.
    start : float
        Wall time the job was created; points carry their time since then.
    """

    def __init__(self, np: int, start: float, *, max_points: int = MAX_POINTS,
                 max_metrics: int = MAX_METRICS, band_above: int = BAND_ABOVE) -> None:
        self.np = np
        self.start = start
        self.max_points = max_points
        self.max_metrics = max_metrics
        self.banded = np > band_above
        self.series: dict[str, list[Series | None]] = {}
        self.bands: dict[str, Band] = {}
        self.refused: set[str] = set()  # names beyond max_metrics (bounded: their count only)
        self.refused_count = 0
        self.version = 0  # bumped on every point: the charts redraw when it moved
        self._latest: dict[str, list[float]] = {}  # name -> each rank's newest value (or NaN)
        self._steps: dict[str, list[float]] = {}  # name -> each rank's newest step (or NaN)
        self._band_at: dict[str, float] = {}  # name -> time of its last band sample
        self._band_due: set[str] = set()  # names with points since their last band sample

    def add(self, rank: int, values: Mapping[str, Any], step: Any, now: float) -> None:
        """Fold a rank's reported values (numbers are charted, anything else is skipped)."""
        if not 0 <= rank < self.np:
            return
        at = now - self.start
        raw = number(step)
        for name, value in values.items():
            v = number(value)
            if v is None:
                continue
            ranks = self.series.get(name)
            if ranks is None:
                ranks = self._new_metric(name)
                if ranks is None:
                    continue
            s = ranks[rank]
            if s is None:
                s = ranks[rank] = Series(self.max_points)
            s.add(raw, at, v)
            assert s.last is not None
            self._latest[name][rank] = v
            self._steps[name][rank] = s.last.step
            self.version += 1
            if self.banded:
                self._band_due.add(name)
                if at - self._band_at.get(name, -math.inf) >= BAND_EVERY_S:
                    self._sample_band(name, at)

    def _new_metric(self, name: str) -> list[Series | None] | None:
        if len(self.series) >= self.max_metrics:
            if name not in self.refused:
                self.refused_count += 1
                if len(self.refused) < self.max_metrics:  # names to show, not all of them
                    self.refused.add(name)
            return None
        ranks: list[Series | None] = [None] * self.np
        self.series[name] = ranks
        self._latest[name] = [math.nan] * self.np
        self._steps[name] = [math.nan] * self.np
        return ranks

    def _sample_band(self, name: str, at: float) -> None:
        finite = sorted(v for v in self._latest[name] if math.isfinite(v))
        self._band_at[name] = at
        self._band_due.discard(name)
        if not finite:
            return
        steps = sorted(s for s in self._steps[name] if not math.isnan(s))
        band = self.bands.get(name)
        if band is None:
            band = self.bands[name] = Band(*(Series(self.max_points) for _ in range(3)))
        step = steps[len(steps) // 2]
        # A band's step must not go back, or Series would read it as a bar that was reset.
        if band.median.last is not None:
            step = max(step, band.median.last.step)
        band.low.add(step, at, finite[0])
        band.median.add(step, at, _median(finite))
        band.high.add(step, at, finite[-1])

    def flush(self, now: float) -> None:
        """Sample the band of every metric that moved since its last sample (the job ended,
        or the charts want their final form)."""
        for name in sorted(self._band_due):
            self._sample_band(name, now - self.start)

    # -- reading ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Metric names, in the order they were first reported."""
        return list(self.series)

    def ranks(self, name: str) -> Iterator[tuple[int, Series]]:
        """``(rank, series)`` for every rank that reported ``name``."""
        for rank, s in enumerate(self.series.get(name, ())):
            if s is not None:
                yield rank, s

    def points(self, name: str, rank: int) -> list[Point]:
        """The points of ``name`` kept for ``rank`` ([] if it reported none)."""
        ranks = self.series.get(name)
        s = ranks[rank] if ranks is not None and 0 <= rank < self.np else None
        return s.points() if s is not None else []

    def latest(self, name: str) -> list[float]:
        """Each rank's newest value of ``name`` (NaN where a rank has not reported it)."""
        return list(self._latest.get(name, ()))

    def outliers(self, name: str, limit: int = MAX_OUTLIERS, *,
                 exclude: frozenset[int] = frozenset()) -> list[int]:
        """Ranks whose newest value is NaN or infinite, or far from the median of the others
        (more than ``OUTLIER_MADS`` median absolute deviations), furthest first."""
        reported = [(r, v) for r, s in self.ranks(name) if r not in exclude
                    for v in [self._latest[name][r]]]
        finite = sorted(v for _, v in reported if math.isfinite(v))
        broken = [r for r, v in reported if not math.isfinite(v)]
        if len(finite) < 3:
            return broken[:limit]
        med = _median(finite)
        mad = _median(sorted(abs(v - med) for v in finite))
        # With every rank alike (MAD 0) any rank that differs at all stands out; a tolerance
        # keeps float noise from counting as a difference.
        floor = 1e-9 * max(1.0, abs(med))
        far = sorted(((abs(v - med), r) for r, v in reported if math.isfinite(v)
                      and abs(v - med) > max(OUTLIER_MADS * mad, floor)), reverse=True)
        return (broken + [r for _, r in far])[:limit]

    def __len__(self) -> int:
        return len(self.series)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2

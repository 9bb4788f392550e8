"""What finished jobs keep: their values once (not the pickles too), and within
``%config DistMagics.history_mb`` in all; a job whose values were let go says so."""

from __future__ import annotations

import gc
import os
from typing import Any

import psutil
import pytest

import nbdist
from nbdist import handle
from nbdist import job as jobs
from nbdist.errors import ValuesDroppedError
from nbdist.settings import settings
from nbdist.views import status

from .helpers import Gate, run

pytestmark = pytest.mark.timeout(300)

SIZE = 200_000_000


def _big(n: int, mark: int) -> bytes:
    return bytes([mark]) * n


def _rss() -> int:
    gc.collect()
    return int(psutil.Process(os.getpid()).memory_info().rss)


@pytest.mark.slow
def test_three_200_mb_results_hold_one_copy_within_the_history_budget() -> None:
    """After three jobs returning 200 MB each, the kernel holds one copy of the newest value
    (it held pickle and value of all three, +1.2 GB); the older jobs stay listed, and their
    .result() says the values were let go and how to keep one."""
    before = _rss()
    ids = []
    for mark in range(3):
        job = nbdist.run(_big, SIZE, mark, np=1, backend="local")
        value = job.result()
        assert len(value) == SIZE and value[:1] == bytes([mark])
        ids.append(job.id)
        del value, job
    grown = _rss() - before
    assert grown < 2.25 * SIZE, f"the kernel holds {grown / 1e6:.0f} MB after three jobs"
    assert set(ids) <= {j.id for j in jobs.jobs()}  # still listed
    oldest = jobs.get_job(ids[0])
    assert oldest is not None and oldest.retained_bytes() == 0
    with pytest.raises(ValuesDroppedError, match=r"let go to bound the kernel's memory.*"
                                                 r"x = job.result\(\).*-o VAR"):
        oldest.result()
    newest = jobs.get_job(ids[2])
    assert newest is not None and newest.result()[:1] == bytes([2])
    rows = {line.split()[0]: line.split()[-1]
            for line in status.jobs_table([j.state for j in jobs.jobs()]).splitlines()}
    assert rows[ids[0]] == "dropped" and rows[ids[2]] == "yes"  # %dist_status's last column


def test_a_value_within_the_budget_is_kept_and_the_newest_always(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small values of older jobs are kept while they fit; the newest job keeps its value even
    when it alone is over the budget."""
    monkeypatch.setattr(settings, "history_mb", 3_000_000 / 2**20)
    small = nbdist.run(_big, 1_000_000, 1, np=1, backend="local")
    assert len(small.result()) == 1_000_000
    big = nbdist.run(_big, 5_000_000, 2, np=1, backend="local")
    assert len(big.result()) == 5_000_000  # over the budget alone, and kept
    with pytest.raises(ValuesDroppedError):
        small.result()
    small2 = nbdist.run(_big, 1_000_000, 3, np=1, backend="local")
    assert small2.result()[:1] == b"\x03"
    with pytest.raises(ValuesDroppedError):
        big.results  # noqa: B018  (the property raises)


def test_the_bound_is_kept_by_the_time_a_waiter_sees_the_job_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count against the budget runs before ``done()`` turns true: ``result()`` never
    returns while an older job still holds what the newest one's end lets go (CI saw the older
    value kept when the count ran a moment after the waiter woke)."""
    monkeypatch.setattr(settings, "history_mb", 3_000_000 / 2**20)
    seen_done: list[bool] = []
    count = handle.retain

    def watched(newest: handle.Handle) -> None:
        seen_done.append(newest.done())
        count(newest)

    monkeypatch.setattr(handle, "retain", watched)
    small = nbdist.run(_big, 2_000_000, 1, np=1, backend="local")
    assert len(small.result()) == 2_000_000
    big = nbdist.run(_big, 2_000_000, 2, np=1, backend="local")
    assert big.result()[:1] == b"\x02"
    with pytest.raises(ValuesDroppedError):
        small.result()
    assert seen_done == [False, False]  # each job's count ran before its waiter could wake


def test_a_session_cell_s_values_are_bounded_too(
    ip: Any, monkeypatch: pytest.MonkeyPatch, no_session: None
) -> None:
    """Pulled values count toward the budget: an older pull's cell lets its value go."""
    monkeypatch.setattr(settings, "history_mb", 3_000_000 / 2**20)
    run(ip, "%dist_session start -np -1")
    run(ip, "%%distributed\na = bytes(2_000_000)\nb = bytes(2_000_000)")
    run(ip, "%dist_pull a")
    first = jobs.jobs()[-1]
    assert first.retained_bytes() > 2_000_000
    run(ip, "%dist_pull b")
    assert first.retained_bytes() == 0
    with pytest.raises(ValuesDroppedError):
        first.result()
    assert len(ip.user_ns["a"]) == 2_000_000  # the notebook's variable is the user's


def test_the_job_that_ended_last_keeps_its_values_whatever_the_start_order(
    monkeypatch: pytest.MonkeyPatch, gate: Gate
) -> None:
    """A job started first but ending last keeps its values; the one that ended before it,
    though started after it, lets its values go."""
    monkeypatch.setattr(settings, "history_mb", 3_000_000 / 2**20)

    def slow(n: int) -> bytes:
        gate.wait()
        return bytes(n)

    first = nbdist.run(slow, 2_000_000, np=1, backend="local")
    second = nbdist.run(_big, 2_000_000, 7, np=1, backend="local")
    assert second.result()[:1] == b"\x07"
    gate.open()
    assert len(first.result()) == 2_000_000  # ended last: kept
    with pytest.raises(ValuesDroppedError):
        second.result()

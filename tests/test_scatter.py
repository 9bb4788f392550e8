"""``%dist_scatter`` and ``%dist_gather`` (docs/sessions.md): a notebook value split across a
session's ranks by rows, and the ranks' slices joined again in rank order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError

from nbdist import session as sessions
from nbdist import slices

from .helpers import run

pytestmark = pytest.mark.usefixtures("no_session")


@pytest.mark.slow
def test_parts_tile_the_value_and_join_back() -> None:
    """Every type is cut into slices that differ by at most one row and joined back equal;
    values of mixed or other types join as a list."""
    np = pytest.importorskip("numpy")
    pd = pytest.importorskip("pandas")
    values = [list(range(10)), tuple("abcdefg"), np.arange(22).reshape(11, 2),
              pd.DataFrame({"a": range(9), "b": list("abcdefghi")}), pd.Series(range(5))]
    for value in values:
        parts = [slices.part(value, r, 3) for r in range(3)]
        sizes = [slices.length(p) for p in parts]
        assert sum(sizes) == slices.length(value) and max(sizes) - min(sizes) <= 1
        joined, ok = slices.join(parts)
        assert ok and type(joined) is type(value)
        if hasattr(value, "equals"):
            assert joined.reset_index(drop=True).equals(value)
        else:
            assert np.array_equal(np.asarray(joined), np.asarray(value))
    assert slices.join([1, 2]) == ([1, 2], False)
    assert slices.join([[1], (2,)]) == ([[1], (2,)], False)
    assert slices.kind({"a": 1}) is None


@pytest.mark.slow
def test_a_tensor_slice_travels_alone() -> None:
    """A torch tensor's slice is its own storage, not a view that would send the whole one."""
    torch = pytest.importorskip("torch")
    big = torch.zeros(1000, 10)
    piece = slices.part(big, 1, 4)
    assert piece.shape == (250, 10)
    assert piece.untyped_storage().nbytes() == 250 * 10 * 4


@pytest.fixture
def live(ip: Any) -> Iterator[sessions.Session]:
    """A three-rank local session, stopped after the test."""
    run(ip, "%dist_session start -np -3")
    live = sessions.current()
    assert live is not None and live.alive
    yield live
    if live.alive:
        live.stop()


@pytest.mark.slow
def test_scatter_and_gather_round_trip(ip: Any, live: sessions.Session) -> None:
    """A list, a numpy array and a pandas DataFrame scattered over three ranks reach each rank
    as its slice under the same name; gathered after the ranks changed them, they come back
    joined in rank order; a value of another type comes back as a list per rank."""
    run(ip, "import numpy as np, pandas as pd\n"
            "items = list(range(10))\n"
            "arr = np.arange(14).reshape(7, 2)\n"
            "frame = pd.DataFrame({'x': range(8)})\n")
    for name in ("items", "arr", "frame"):
        run(ip, f"%dist_scatter {name}")
    got = run(ip, "%%distributed -o seen\n"
                  "import os\n"
                  "r = int(os.environ['RANK'])\n"
                  "items = [v * 10 + r for v in items]\n"
                  "frame['rank'] = r\n"
                  "rank_only = {'rank': r}\n"
                  "(len(items), arr.shape[0], len(frame))")
    assert got == (3, 2, 2)
    assert ip.user_ns["seen"] == [(3, 2, 2), (3, 2, 3), (4, 3, 3)]
    for name in ("items", "arr", "frame", "rank_only"):
        run(ip, f"%dist_gather {name}")
    assert ip.user_ns["items"] == [0, 10, 20, 31, 41, 51, 62, 72, 82, 92]
    assert ip.user_ns["arr"].tolist() == [[2 * i, 2 * i + 1] for i in range(7)]
    frame = ip.user_ns["frame"]
    assert frame["x"].tolist() == list(range(8))
    assert frame["rank"].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert ip.user_ns["rank_only"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert live.alive


def test_bad_scatters_are_usage_errors(ip: Any, live: sessions.Session) -> None:
    """A value that cannot be cut, or with fewer items than ranks, is refused with the fix."""
    run(ip, "settings = {'lr': 0.1}\npair = [1, 2]")
    with pytest.raises(UsageError, match="cannot scatter 'settings', a dict.*%dist_push"):
        run(ip, "%dist_scatter settings")
    with pytest.raises(UsageError, match="it has 2 items for the 3 ranks"):
        run(ip, "%dist_scatter pair")
    with pytest.raises(UsageError, match="no variable 'missing'"):
        run(ip, "%dist_scatter missing")
    assert live.alive


@pytest.mark.slow
def test_a_refused_scatter_push_or_gather_leaves_the_session_as_it_was(
        ip: Any, live: sessions.Session) -> None:
    """A list holding a lock in its last slice, scattered or pushed (after a good name), is
    refused before any rank is involved; a gather of a lock fails that cell alone: the next
    cell runs, the ranks' variables are kept (issue 36)."""
    from nbdist.errors import CaptureError, DistributedError

    run(ip, "import threading\nkept = 7\n"
            "locked = [1, 2, 3, 4, 5, threading.Lock()]\n")
    run(ip, "%dist_push kept")
    before = live.job.state.ranks[0].pid, live.last_cell
    with pytest.raises(CaptureError, match="locked"):
        run(ip, "%dist_scatter locked")
    with pytest.raises(CaptureError, match="locked"):
        run(ip, "%dist_push kept locked")
    assert (live.job.state.ranks[0].pid, live.last_cell) == before  # no cell was started
    run(ip, "%%distributed\nlock_here = __import__('threading').Lock()")
    with pytest.raises(DistributedError):
        run(ip, "%dist_gather lock_here")
    assert run(ip, "%%distributed -o seen\nkept + 1") == 8
    assert ip.user_ns["seen"] == [8, 8, 8] and live.alive

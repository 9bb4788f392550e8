"""``%dist_push`` and ``%dist_scatter`` of large values (issue 36, HARDENING.md rule 13): pickled
once, streamed, nothing kept by the kernel after; on the event channel in pieces."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from nbdist import session as sessions
from nbdist.magics import DistMagics

from .helpers import run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_session")]

MB = 10**6
DEFAULT_WARN_MB = DistMagics.large_value_mb.default_value


@pytest.fixture
def live(ip: Any) -> Iterator[sessions.Session]:
    """A three-rank local session, stopped after the test (and the values it used dropped)."""
    run(ip, "%config DistMagics.large_value_mb = 1000")  # no size warning: the size is the point
    run(ip, "%dist_session start -np -3")
    live = sessions.current()
    assert live is not None and live.alive
    yield live
    if live.alive:
        live.stop()
    ip.user_ns.pop("big", None)
    run(ip, f"%config DistMagics.large_value_mb = {DEFAULT_WARN_MB}")


def test_a_large_push_and_scatter_leave_nothing_in_the_kernel(
        ip: Any, live: sessions.Session) -> None:
    """After pushing 100 MB to three ranks and scattering it, the kernel holds less than half
    the value more than before (it held 8.5x the value after a push, 2.7x after a scatter)."""
    np = pytest.importorskip("numpy")
    ip.user_ns["big"] = np.frombuffer(np.random.bytes(100 * MB), dtype=np.uint8).copy()
    gc.collect()
    before = psutil.Process().memory_info().rss
    run(ip, "%dist_push big")
    run(ip, "%dist_scatter big")
    gc.collect()
    kept = psutil.Process().memory_info().rss - before
    assert kept < 50 * MB, f"the kernel kept {kept / MB:.0f} MB"
    sizes = run(ip, "%%distributed -o sizes\nbig.nbytes")
    assert ip.user_ns["sizes"] == [33_333_333, 33_333_333, 33_333_334] and sizes == 33_333_333


def test_a_large_push_travels_the_event_channel_in_pieces(
        ip: Any, live: sessions.Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the supervisors are not threads of the kernel (Spark's), a 9 MB push goes on the
    event channel as base64 pieces of 4 MiB, joined by each supervisor: each rank gets it whole."""
    sent: list[dict[str, Any]] = []
    send = live.job.send

    def spy(rank: int, event: Any, direct: bool = False) -> bool:
        sent.append({k: v for k, v in event.items() if k != "data"})
        return send(rank, event, direct)

    monkeypatch.setattr(live.job.launcher, "deliver", lambda rank, event: False)
    monkeypatch.setattr(live.job, "send", spy)
    ip.user_ns["big"] = bytes(range(256)) * (9 * MB // 256)
    run(ip, "%dist_push big")
    # Each rank: the pickle of the payload's other keys, then the value's in 3 pieces.
    assert [e["t"] for e in sent] == (["cell_part"] * 4 + ["cell"]) * 3, sent
    got = run(ip, "%%distributed -o got\nimport hashlib\nhashlib.sha256(big).hexdigest()")
    import hashlib

    assert ip.user_ns["got"] == [hashlib.sha256(ip.user_ns["big"]).hexdigest()] * 3 and got

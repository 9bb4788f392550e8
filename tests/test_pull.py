"""``%dist_pull`` of large values through a real IPython shell: streamed in pieces, intact, and
the kernel's memory bounded while it arrives."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from nbdist import session as sessions

from .helpers import run

pytestmark = [pytest.mark.usefixtures("no_session"), pytest.mark.timeout(300)]

MB = 80
N = MB * 10**6 // 251 * 251

MAKE = {
    "numpy": "import numpy as np\nx = np.tile(np.arange(251, dtype=np.uint8), {n} // 251)",
    "bytes": "x = bytes(range(251)) * ({n} // 251)",
    "torch": "import torch\nx = torch.arange({n} // 4, dtype=torch.int32) % 251",
}
#: The kernel's growth allowed, in multiples of the value's size: an array or a tensor is
#: unpickled onto the buffer it arrived in; bytes cannot be, and need one copy.
BOUND = {"numpy": 2, "bytes": 2, "torch": 2}


class PeakRss:
    """This process's resident memory, sampled every few ms while the block runs: the most
    it rose above where it started."""

    def __enter__(self) -> PeakRss:
        self._me = psutil.Process(os.getpid())
        self.before = self.peak = self._me.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._me.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._me.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.before


@pytest.fixture
def one_rank(ip: Any) -> Iterator[sessions.Session]:
    run(ip, "%dist_session start -np -1")
    live = sessions.current()
    assert live is not None
    yield live
    live.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MAKE))
def test_pulling_80_mb_arrives_intact_with_the_kernel_s_peak_bounded(
    ip: Any, one_rank: sessions.Session, kind: str
) -> None:
    """An 80 MB array, tensor or bytes pulled from a rank is intact, and the kernel's memory
    rises by less than BOUND times its size while it arrives: pieces in flight, never whole
    copies."""
    run(ip, "%%distributed\n" + MAKE[kind].format(n=N))
    if kind == "torch":
        torch = pytest.importorskip("torch")  # in the kernel before: not the pull's cost
    with PeakRss() as rss:
        run(ip, "%dist_pull x")
    x = ip.user_ns.pop("x")
    if kind == "torch":
        assert torch.equal(x, torch.arange(N // 4, dtype=torch.int32) % 251)
    else:
        assert len(x) == N
        assert bytes(x[:502]) == bytes(range(251)) * 2
        assert bytes(x[-251:]) == bytes(range(251))
        middle = bytes(range(251))[N // 2 % 251:] + bytes(range(251))[:N // 2 % 251]
        assert bytes(x[N // 2:N // 2 + 251]) == middle
    bound = BOUND[kind] * N
    print(f"{kind}: the kernel grew by {rss.growth / N:.2f}x the value's size")
    assert rss.growth < bound, f"the kernel grew by {rss.growth / N:.2f}x the value's size"
    del x


"""A kernel holding many open files: nbdist's own descriptors get numbers above 1024, where
``select.select`` refuses them (FD_SETSIZE); nbdist waits on them with poll instead."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import nbdist
from nbdist import timeline
from nbdist.launch import local

from .. import hostile

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def open_files() -> Iterator[list[int]]:
    """1100 files held open by the test's process (the kernel) for the test's length."""
    with hostile.more_files(1100 + 600):
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        try:
            yield fds
        finally:
            for fd in fds:
                os.close(fd)


def _printer(lines: int) -> int:
    import os
    import sys

    for i in range(lines):
        print(f"line {i}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    return int(os.environ["RANK"])


@pytest.mark.parametrize("zygote", [True, False])
@pytest.mark.fresh_pool
def test_a_job_that_prints_works_from_a_kernel_holding_1100_files(
    open_files: list[int], zygote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 1100 files open in the kernel, a job's ranks print, and every line arrives, from
    the zygote and from fresh interpreters (NBDIST_ZYGOTE is read at import: set here)."""
    monkeypatch.setattr(local, "ZYGOTE", zygote and local.ZYGOTE)
    local.pool.clear()
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    assert probe > 1024  # the job's pipes and sockets get numbers above select's limit
    job = nbdist.run(_printer, 500, np=2, backend="local")
    assert job.results == [0, 1]
    assert job.lost_output is None
    for r in job.state.ranks:
        assert zygote or timeline.FORKED not in r.marks, "a rank was forked from a zygote"
        assert r.lines == 501, (r.rank, r.lines)
        assert r.last_line in ("line 499", "to stderr")

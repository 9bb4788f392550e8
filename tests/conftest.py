"""Shared fixtures: a real IPython shell with nbdist loaded; a guard against leaked processes;
real Spark sessions for the tests that use Spark (``tests/sparks.py``). Only fixtures and hooks
live here: what tests call is in ``tests/helpers.py``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .helpers import GONE_WITHIN_S, Gate

# A zygote started at every %load_ext (the session's shell, every real kernel) would cost each
# of those tests an import of torch; tests/test_warm_at_load.py turns it on where it is tested.
os.environ.setdefault("NBDIST_WARM_AT_LOAD", "0")
from .sparks import (  # noqa: F401  (fixtures, shared by tests/spark and tests/faults)
    no_leftover_spark_ranks,
    release,
    spark_cluster,
    spark_connect,
    spark_local,
    spark_mark,
    spark_nodes,
    sparks,
    uses_spark,
)


@pytest.fixture(scope="session")
def ip() -> Iterator[object]:
    """A real InteractiveShell with ``%load_ext nbdist`` done."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    assert shell is not None
    shell.run_line_magic("load_ext", "nbdist")
    yield shell


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    """A gate (``helpers.Gate``) the test's ranks wait at until the test opens it."""
    return Gate(tmp_path / "gate")


@pytest.fixture
def no_session() -> Iterator[None]:
    """The test leaves no ``%dist_session`` behind (stopped, and forgotten by the kernel)."""
    from nbdist import session as sessions

    yield
    live = sessions.current()
    if live is not None and live.alive:
        live.stop()
    sessions._current = None


def _descendants() -> dict[int, str]:
    out = {}
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline()[:4])
        except psutil.Error:
            pass
    return out


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    release(item.session.items, nextitem)  # the tests that follow Spark's see no session


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, every process the test started must be gone (within the 10 s bound)."""
    from nbdist.launch.local import pool

    if request.node.get_closest_marker("multihost"):  # its hosts' processes: its own check
        yield
        return
    if uses_spark(request.node):  # Spark's own processes outlive tests: its own check
        request.getfixturevalue("no_leftover_spark_ranks")
        yield
        return
    if request.node.get_closest_marker("ray"):  # Ray's own too (tests/ray/conftest.py)
        request.getfixturevalue("no_leftover_ray")
        yield
        return
    before = set(_descendants())
    yield
    pool.clear()  # warm interpreters are meant to outlive a job, not a test
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = {pid: cmd for pid, cmd in _descendants().items() if pid not in before}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes left running after the test: {left}"

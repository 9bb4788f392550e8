"""Shared fixtures: a real IPython shell with nbdist loaded; a guard against leaked processes;
real Spark sessions for the tests that use Spark (``tests/sparks.py``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from .sparks import (  # noqa: F401  (fixtures, shared by tests/spark and tests/faults)
    no_leftover_spark_ranks,
    release,
    spark_cluster,
    spark_local,
    spark_mark,
    sparks,
    uses_spark,
)

#: How long ranks may take to disappear after a job ended (the contract says 10 s).
GONE_WITHIN_S = 10.0


def none_left(find: Callable[[], list[psutil.Process]], within: float = GONE_WITHIN_S,
              what: str = "rank processes left running after the test") -> None:
    """The processes ``find`` returns are all gone within ``within`` seconds; those that are
    not are killed and the test fails naming them."""
    deadline = time.monotonic() + within
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.05)  # processes end on their own schedule; nothing to wait on
    described = {p.pid: " ".join(p.cmdline()[:4]) for p in left if p.is_running()}
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    assert not described, f"{what}: {described}"


@pytest.fixture(scope="session")
def ip() -> Iterator[object]:
    """A real InteractiveShell with ``%load_ext nbdist`` done."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    assert shell is not None
    shell.run_line_magic("load_ext", "nbdist")
    yield shell


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


def is_rank(proc: psutil.Process) -> bool:
    """A rank's interpreter: started fresh (it runs nbdist.runtime), or forked by a zygote
    (it shows the zygote's command line, and so does its parent)."""
    from nbdist.launch.zygote import COMMAND

    cmd = " ".join(proc.cmdline())
    if "nbdist.runtime" in cmd:
        return True
    parent = proc.parent() if COMMAND in cmd else None
    return parent is not None and COMMAND in " ".join(parent.cmdline())


def rank_processes() -> list[psutil.Process]:
    """Rank interpreters started from this process, the idle warm ones excepted."""
    from nbdist.launch.local import pool

    warm = set(pool.pids())
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.pid in warm or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if is_rank(p):
                found.append(p)
        except psutil.Error:
            pass
    return found


def run(ip: Any, cell: str) -> Any:
    """Run a cell in the shell; raise what it raised, else return its result."""
    result = ip.run_cell(cell)
    if result.error_before_exec is not None:
        raise result.error_before_exec
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result.result


def wait_for(predicate: object, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)

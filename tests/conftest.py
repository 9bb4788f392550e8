"""Shared fixtures: a real IPython shell with nbdist loaded; a guard against leaked processes;
real Spark sessions for the tests that use Spark (``tests/sparks.py``). Only fixtures and hooks
live here: what tests call is in ``tests/helpers.py``."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from .helpers import GONE_WITHIN_S, Gate

# A zygote started at every %load_ext (the session's shell, every real kernel) would cost each
# of those tests an import of torch; tests/test_warm_at_load.py turns it on where it is tested.
os.environ.setdefault("NBDIST_WARM_AT_LOAD", "0")
# Every JVM the tests start (Spark's driver, master, workers, executors, Connect server) lives
# for a few small jobs: C2's compiler threads and the parallel collector are most of what it
# costs beyond that on 2 cores. C1 and the serial collector: tests/spark/test_standalone.py took
# 93 s of CPU instead of 133 (docs/developing.md). JVMs print that they picked it up, on stderr.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
from .sparks import (  # noqa: F401  (fixtures, shared by tests/spark and tests/faults)
    CLUSTER_FIXTURES,
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-durations", action="store_true",
                     help="end with the seconds each test file took (set-up, call and "
                          "tear-down of its tests, summed; `make test`)")


_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """``--file-durations``: the seconds of each test file, the longest first (under xdist
    the files overlap in time: they add up to more than the wall time)."""
    if not config.getoption("--file-durations") or not _file_seconds:
        return
    terminalreporter.section("seconds per test file (set-up + call + tear-down)")
    for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_file_seconds.values()):8.1f}  in all")


#: Markers of what only one process at a time may hold (one Spark JVM and standalone cluster, one
#: Ray cluster, the multi-host tests' simulated hosts on a fixed subnet, the browser's JupyterLab):
#: under pytest-xdist (``make test``: ``-n ... --dist loadgroup``) the tests of each run in one
#: worker, in their file order, while the other workers share out the rest. Spark's are two
#: groups: the tests of the standalone cluster form ``spark-cluster``.
XDIST_GROUPS = ("multihost", "spark", "ray", "browser")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test of an ``XDIST_GROUPS`` marker (or that uses a Spark fixture) joins that xdist
    group; where torch is not installed (the version matrix's Pythons), ``torch`` tests skip."""
    grouping = config.pluginmanager.hasplugin("xdist")
    no_torch = importlib.util.find_spec("torch") is None
    for item in items:
        if no_torch and item.get_closest_marker("torch"):
            item.add_marker(pytest.mark.skip(reason="needs torch (nbdist[torch])"))
        if not grouping or item.get_closest_marker("xdist_group"):
            continue
        group = next((m for m in XDIST_GROUPS if item.get_closest_marker(m)), None)
        if group is None and uses_spark(item):
            group = "spark"
        if group == "spark" and uses_spark(item, CLUSTER_FIXTURES):
            # Two Spark workers, each with a JVM of its own: the local session's tests and
            # the standalone cluster's (and Connect's) run side by side.
            group = "spark-cluster"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


class _GroupsCheck:
    """Fails the run where pytest-xdist did not put the groups in the tests' ids (pytest 9.2
    with xdist 3.8 did not, and every worker started a Spark cluster of its own)."""

    @pytest.hookimpl(trylast=True)  # after xdist's
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group")
                and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {len(lost)} tests (such as "
                                    f"{lost[0]}): see the pytest pin in pyproject.toml")


def pytest_configure(config: pytest.Config) -> None:
    # pytest sets PYTEST_CURRENT_TEST in the environment for each phase of each test, and a
    # zygote serves one environment (its key is all of it): every test, and every phase of
    # one, started a zygote of its own. No test reads it.
    import _pytest.runner

    _pytest.runner._update_current_test_var = lambda item, when: None
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        config.pluginmanager.register(_GroupsCheck(), "nbdist-xdist-groups")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    release(item.session.items, nextitem)  # the tests that follow Spark's see no session


def _pool_reusable(pool: Any) -> bool:
    """Whether the test process's warm pool may serve the next test: only zygotes that can
    fork (none stale, none refusing), and no warm interpreters, idle or being started (the
    fallback where no zygote serves a job's environment)."""
    with pool._lock:
        zygotes, idle, filler = list(pool._zygotes.values()), list(pool._idle), pool._filler
    return not idle and filler is None and all(z.alive and z.safe and not z.stale
                                               for z in zygotes)


def _let_go(pool: Any) -> None:
    """The pool as a new kernel's: no zygote, and no last job's modules to import ahead (after
    a Keras test those were TensorFlow's and JAX's: 10 s of CPU in the next test's zygote)."""
    pool.clear()
    pool._last = set()


@pytest.fixture(autouse=True)
def no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, every process the test started must be gone (within the 10 s bound),
    but the zygotes of this process's warm pool (``nbdist.launch.local.pool``): the next tests'
    jobs fork their ranks from them, as a notebook's next cells do, instead of starting a
    zygote each (and importing torch in it again). A test that looks at the pool itself, or
    turns zygotes off, is marked ``fresh_pool``: the pool is let go before and after it."""
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
    fresh = request.node.get_closest_marker("fresh_pool") is not None
    if fresh:
        _let_go(pool)
    before = set(_descendants())
    yield
    if fresh or not _pool_reusable(pool):
        _let_go(pool)
    kept = set(pool.pids())  # the zygotes the next tests fork from; their ranks must be gone
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        left = {pid: cmd for pid, cmd in _descendants().items()
                if pid not in before and pid not in kept}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert not left, f"processes left running after the test: {left}"

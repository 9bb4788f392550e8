"""Helpers the tests import: run a cell, wait for a condition, find rank processes, hold ranks
at a gate.

Fixtures live in ``conftest.py`` (pytest finds them there); what a test calls lives here, so
that no test imports ``conftest`` (pytest imports it under its own rules, and a second import
under another name would run it twice).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from nbdist.state import SILENT_AFTER_S, JobState

#: How long ranks may take to disappear after a job ended (the contract says 10 s).
GONE_WITHIN_S = 10.0
#: How long a rank waits at a :class:`Gate` the test never opens before it fails: the longest
#: ``@pytest.mark.timeout`` of the suite (tests/spark/test_connect.py's, whose gate may open
#: minutes after its task began to wait), so it never fails a test that would pass, and ends
#: what a forgotten ``open()`` would leave waiting (a --bg job in a kernel, a Spark task).
GATE_TIMEOUT_S = 900.0


def out(text: str, s: str = "o") -> dict[str, object]:
    """An ``out`` event: ``text`` on stream ``s`` ("o" stdout, "e" stderr)."""
    return {"t": "out", "s": s, "text": text}


def running_job(np: int = 2) -> JobState:
    """A job's state with ``np`` ranks that said hello on node-a, started and run."""
    job = JobState("j77", "local", np)
    for r in range(np):
        job.apply(r, {"t": "hello", "host": "node-a", "gpus": []})
        job.apply(r, {"t": "state", "state": "starting", "pid": 1000 + r, "host": "node-a"})
        job.apply(r, {"t": "state", "state": "running"})
    return job


def is_rank(proc: psutil.Process) -> bool:
    """A rank's interpreter: started fresh (it runs nbdist.rank.runtime), or forked by a zygote
    (it shows the zygote's command line, and so does its parent)."""
    from nbdist.rank import executor_zygote, zygote

    cmd = " ".join(proc.cmdline())
    if "nbdist.rank.runtime" in cmd:
        return True
    for command in (zygote.COMMAND, executor_zygote.COMMAND):
        parent = proc.parent() if command in cmd else None
        if parent is not None and command in " ".join(parent.cmdline()):
            return True
    return False


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


def wait_for(predicate: Callable[[], object], timeout: float = 30.0,
             what: str = "condition") -> None:
    """Poll ``predicate`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Gate:
    """A file the ranks wait for until the test creates it: the test looks at the ranks while
    they run (their lines, their state), however slow the machine, then lets them through.

    The test calls :meth:`open`; the ranks wait with :meth:`wait` (in a function shipped to
    them, the gate an argument of ``nbdist.run``) or run :meth:`code` (in a cell or a script).
    Both fail with a TimeoutError naming the gate after ``timeout`` seconds (None: never). The
    ``gate`` fixture (``conftest.py``) gives a test a fresh one.

    A gate travels by reference (cloudpickle pickles an importable class by name): a rank
    imports ``tests.helpers``, as it imports a test module whose module-level function a test
    ships. Every interpreter of the project's environment finds ``tests`` (the editable
    install puts the checkout on ``sys.path``), the ranks of Spark's executors too.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"Gate({self.path!r})"

    def open(self) -> None:
        """Let the ranks through; opening an open gate does nothing."""
        Path(self.path).touch()  # the file appears whole: it has nothing in it

    def wait(self, timeout: float | None = GATE_TIMEOUT_S) -> None:
        """Block until the test opened the gate (on a rank: it needs only os and time)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not os.path.exists(self.path):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(self._never_opened(timeout))
            time.sleep(0.01)

    def code(self, indent: str = "", timeout: float | None = GATE_TIMEOUT_S) -> str:
        """:meth:`wait` as source lines (no newline after the last), each after ``indent``, for
        a cell or a script. They import os and time and bind no other name (a session keeps the
        names a cell binds), so the deadline is wall-clock time, counted from this call."""
        lines = ["import os, time", f"while not os.path.exists({self.path!r}):"]
        if timeout is not None:
            lines += [f"    if time.time() > {time.time() + timeout:.1f}:",
                      f"        raise TimeoutError({self._never_opened(timeout)!r})"]
        lines.append("    time.sleep(0.01)")
        return "\n".join(indent + line for line in lines)

    def _never_opened(self, timeout: float | None) -> str:
        return f"gate {self.path} was not opened within {timeout:g} s: does the test open() it?"


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


def cluster_job(np: int = 64, per_host: int = 8) -> JobState:
    """A running job of ``np`` ranks, ``per_host`` on each of hosts node-0, node-1...: every
    rank's bar at 50-89 %, rank 5 behind at 1 %, rank 40 failed, rank 50 silent."""
    job = JobState("j64", "spark", np)
    for r in range(np):
        host = f"node-{r // per_host}"
        job.apply(r, {"t": "hello", "host": host, "gpus": [str(r % per_host)]})
        job.apply(r, {"t": "state", "state": "starting", "pid": 1000 + r, "host": host})
        job.apply(r, {"t": "state", "state": "running"})
        job.apply(r, {"t": "progress", "id": 1, "n": 50 + (r % 40), "total": 100})
    job.apply(5, {"t": "progress", "id": 1, "n": 1, "total": 100})
    job.set_rank(40, "failed", 1)
    job.ranks[50].last_seen = time.time() - SILENT_AFTER_S - 1
    return job

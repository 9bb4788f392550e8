"""Helpers the tests import: run a cell, wait for a condition, find rank processes.

Fixtures live in ``conftest.py`` (pytest finds them there); what a test calls lives here, so
that no test imports ``conftest`` (pytest imports it under its own rules, and a second import
under another name would run it twice).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from nbdist.state import SILENT_AFTER_S, JobState

#: How long ranks may take to disappear after a job ended (the contract says 10 s).
GONE_WITHIN_S = 10.0


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
    from nbdist.launch import executor_zygote, zygote

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

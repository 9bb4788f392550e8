"""Warm interpreters: the next local job starts where its modules are already imported."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

import nbdist
from nbdist.launch import local

from .conftest import wait_for

pytestmark = pytest.mark.timeout(180)


def first_job() -> int:
    import os

    import torch  # noqa: F401  (what the next job should find imported)

    return os.getpid()


def second_job() -> dict[str, object]:
    import os
    import sys

    preloaded = "torch" in sys.modules
    import torch

    return {"pid": os.getpid(), "preloaded": preloaded, "rank": os.environ["RANK"],
            "threads": torch.get_num_threads(), "omp": os.environ["OMP_NUM_THREADS"],
            "usermod": "nbdist_usermod" in sys.modules}


def test_next_job_runs_in_warm_interpreters_with_its_own_environment() -> None:
    """After a job that imported torch, the next one starts with torch loaded and its own env."""
    pytest.importorskip("torch")
    first = nbdist.run(first_job, np=2).results
    assert local.pool.wait_ready(timeout=60)
    warm = set(local.pool.pids())
    assert len(warm) == 2 and not warm & set(first)
    assert "torch" in local.pool.modules
    results = nbdist.run(second_job, np=2).results
    assert {r["pid"] for r in results} == warm
    assert all(r["preloaded"] for r in results)
    assert [r["rank"] for r in results] == ["0", "1"]
    assert all(r["threads"] == int(str(r["omp"])) for r in results)


def test_user_modules_are_not_preloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of the user's (which may be edited before the next run) is never preloaded."""
    pytest.importorskip("torch")
    (tmp_path / "nbdist_usermod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def uses_it() -> int:
        import nbdist_usermod
        import torch  # noqa: F401

        return int(nbdist_usermod.VALUE)

    assert nbdist.run(uses_it, np=1).result() == 1
    assert local.pool.wait_ready(timeout=60)
    assert "nbdist_usermod" not in local.pool.modules and "torch" in local.pool.modules
    assert nbdist.run(second_job, np=1).result()["usermod"] is False


def test_a_different_environment_gets_fresh_interpreters() -> None:
    """A job with other --env values does not take interpreters started for another."""
    nbdist.run(first_job, np=1).result()
    assert local.pool.wait_ready(timeout=60)
    warm = set(local.pool.pids())
    pid = nbdist.run(first_job, np=1, env={"SOMETHING": "else"}).result()
    assert pid not in warm


def test_idle_interpreters_are_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm interpreters idle longer than the limit are killed; none are made when disabled."""
    monkeypatch.setattr(local, "WARM_IDLE_S", 3.0)
    nbdist.run(first_job, np=2).result()
    wait_for(lambda: len(local.pool.pids()) == 2, 30, "two warm interpreters")
    warm = [psutil.Process(p) for p in local.pool.pids()]
    assert warm
    wait_for(lambda: not local.pool.pids(), 30, "the idle interpreters to be let go")
    psutil.wait_procs(warm, timeout=10)
    monkeypatch.setattr(local, "WARM_POOL", False)
    nbdist.run(first_job, np=1).result()
    assert local.pool.wait_ready(timeout=5) and not local.pool.pids()


def test_warm_interpreters_die_with_the_driver() -> None:
    """A driver killed with SIGKILL takes its warm interpreters with it (control pipe EOF)."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import nbdist
        from nbdist.launch import local
        nbdist.run(lambda: 1, np=2).result()
        local.pool.wait_ready(60)
        print(" ".join(map(str, local.pool.pids())), flush=True)
        import time; time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        procs = [psutil.Process(p) for p in pids]
    finally:
        driver.kill()
        driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive

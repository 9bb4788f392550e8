"""Warm at load: ``%load_ext nbdist`` starts the first job's zygote in the background."""

from __future__ import annotations

import importlib.util
import os

import pytest

import nbdist
from nbdist.launch import local

pytestmark = [pytest.mark.skipif(not local.ZYGOTE, reason="zygotes are Linux only"),
              pytest.mark.fresh_pool]


def _probe() -> tuple[int, int, bool]:
    import os
    import sys

    return os.getppid(), os.getpriority(os.PRIO_PROCESS, 0), "torch" in sys.modules


@pytest.fixture
def reload(ip, monkeypatch):
    """Reload nbdist in the test shell with warm at load on (``NBDIST_WARM_AT_LOAD=1``)."""
    monkeypatch.setenv("NBDIST_WARM_AT_LOAD", "1")
    local.pool.clear()

    def again() -> None:
        ip.run_line_magic("unload_ext", "nbdist")
        ip.run_line_magic("load_ext", "nbdist")

    yield again
    ip.run_line_magic("config", "DistMagics.warm_at_load = True")
    local.pool.clear()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_load_starts_the_zygote_the_first_job_forks_from(reload):
    """After %load_ext a zygote has torch imported, and the first job's ranks are forked from
    it with the kernel's priority (its imports ran at nice 19)."""
    reload()
    assert local.pool.wait_ready(120), "the zygote started at load did not finish importing"
    (zygote,) = local.pool.pids()
    job = nbdist.run(_probe, np=2, backend="local")
    results = job.results
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert [r[0] for r in results] == [zygote, zygote], "the ranks were not forked from it"
    assert [r[1] for r in results] == [own, own], "a rank did not get the kernel's nice value"
    assert all(r[2] for r in results), "torch was not preloaded in the ranks"
    assert local.pool.pids() == [zygote], "the job did not keep the zygote for the next one"


@pytest.mark.parametrize("how", ["env", "config"])
def test_the_off_switches_start_nothing(reload, monkeypatch, ip, how):
    """NBDIST_WARM_AT_LOAD=0 or %config DistMagics.warm_at_load = False: no zygote at load."""
    if how == "env":
        monkeypatch.setenv("NBDIST_WARM_AT_LOAD", "0")
    else:
        ip.run_line_magic("config", "DistMagics.warm_at_load = False")
    reload()
    # warm_at_load sets pool.preloading before it returns, when it starts anything at all.
    assert local.pool.preloading is None, "a zygote was being started at load"
    assert local.pool.pids() == []


def test_without_torch_nothing_is_started(monkeypatch):
    """Where torch is not installed, loading starts no zygote."""
    monkeypatch.setenv("NBDIST_WARM_AT_LOAD", "1")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert local.warm_at_load() is None
    assert local.pool.pids() == []

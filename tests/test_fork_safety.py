"""Fork safety is judged by what makes a fork unsafe: a started CUDA driver (its device handles,
torch's own word) or another Python thread, named with where it started; a mapped ``libcuda``
alone leaves the zygote forking."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import nbdist
from nbdist.launch import local
from nbdist.rank import fork_safety
from nbdist.state import JobState
from nbdist.views import status

from .helpers import run

pytestmark = [pytest.mark.timeout(180), pytest.mark.fresh_pool]


def test_device_handles_are_found_among_descriptors_and_mappings() -> None:
    """Open or mapped /dev/nvidia* and /dev/dxg count, each once; a mapped libcuda does not."""
    maps = [
        "7f00-7f10 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n",
        "7f20-7f30 rw-s 00000000 00:05 99 /dev/nvidia0\n",
        "7f40-7f50 rw-p 00000000 00:00 0 \n",
        "7f60-7f70 rw-s 00000000 00:05 98 /dev/nvidiactl\n",
    ]
    fds = ["/dev/null", "pipe:[123]", "/dev/nvidiactl", "/dev/nvidia-uvm", "socket:[9]"]
    assert fork_safety.device_handles(fds, maps) == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"]
    assert fork_safety.device_handles(["/dev/dxg"], []) == ["/dev/dxg"]
    assert fork_safety.device_handles(["/dev/null"], maps[:1] + maps[2:3]) == []


def test_this_process_without_a_gpu_driver_is_safe_to_fork() -> None:
    """Here (no CUDA driver started, one thread) a fork is safe and nothing is said."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        pytest.skip("this test process started CUDA")
    assert fork_safety.cuda_started() == ""


def test_a_thread_is_named_with_what_it_runs_and_which_import_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread started at import: the reason names it, its target and the module."""
    (tmp_path / "nbdist_starts_a_thread.py").write_text(
        "import threading\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait, name='poller', daemon=True).start()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with fork_safety.recording_thread_starts():
        import nbdist_starts_a_thread as module
    assert threading.Thread.start.__qualname__ == "Thread.start"  # the wrapper is gone
    try:
        poller = next(t for t in threading.enumerate() if t.name == "poller")
        text = fork_safety.describe_thread(poller)
        assert text.startswith("thread 'poller' (runs threading.Event.wait; module "
                               "nbdist_starts_a_thread started it at import (")
        assert f"{tmp_path / 'nbdist_starts_a_thread.py'}:3)" in text
        safe, why = fork_safety.fork_safety()
        assert not safe and text in why
    finally:
        module.stop.set()
        poller.join(10)


def _fake_libcuda(directory: Path) -> Path:
    """A shared library named ``libcuda.so.1`` that starts nothing when loaded: built with the C
    compiler when there is one, else a copy of one of Python's own (loading runs no code of it)."""
    lib = directory / "libcuda.so.1"
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is not None:
        source = directory / "fake_cuda.c"
        source.write_text("int cuInit(unsigned int flags) { return 100; }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    else:
        import _ctypes

        shutil.copy(_ctypes.__file__, lib)
    return lib


def _ppid() -> int:
    import os

    import nbdist_maps_libcuda  # noqa: F401

    return os.getppid()


@pytest.mark.slow
def test_a_module_that_maps_libcuda_without_starting_it_leaves_the_zygote_forking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed module that maps a ``libcuda.so.1`` at import but starts no driver: the
    zygote holds it mapped and the later runs are still forked from it."""
    lib = _fake_libcuda(tmp_path)
    _installed_module(tmp_path, monkeypatch, "nbdist_maps_libcuda",
                      f"import ctypes\nctypes.CDLL({str(lib)!r})\n")
    nbdist.run(_ppid, np=1).result()
    assert local.pool.wait_ready(timeout=60)
    (zygote,) = local.pool._zygotes.values()
    with open(f"/proc/{zygote.pid}/maps") as maps:
        assert str(lib) in maps.read()  # the library is mapped in the zygote
    assert zygote.safe, zygote.why
    assert nbdist.run(_ppid, np=1).result() == zygote.pid  # forked
    assert nbdist.run(_ppid, np=2).results == [zygote.pid] * 2


def _installed_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                      source: str) -> None:
    """``name`` as an installed module (a ``site-packages`` folder on PYTHONPATH)."""
    site = tmp_path / "site-packages"  # what counts as installed, not the user's own code
    site.mkdir(exist_ok=True)
    (site / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")])))


def _status(ip: Any, capsys: Any, line: str) -> str:
    capsys.readouterr()
    run(ip, f"%dist_status {line}")
    return str(capsys.readouterr().out)


@pytest.mark.slow
def test_ranks_started_fresh_say_why_in_dist_status_and_the_timeline(
    ip: Any, capsys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that starts a thread at import: the next job's ranks do not come from the
    zygote, and ``%dist_status JOB`` and its ``--timeline`` name the thread and the module."""
    _installed_module(tmp_path, monkeypatch, "nbdist_threaded",
                      "import threading\nthreading.Thread(target=threading.Event().wait, "
                      "daemon=True, name='poller').start()\n")
    run(ip, "%%distributed -np 2 --quiet\nimport nbdist_threaded\n1")
    run(ip, "%%distributed -np 2 --quiet\nimport nbdist_threaded\n2")
    job = nbdist.job.get_job()
    assert job is not None
    why = ("the zygote cannot fork: thread 'poller' (runs threading.Event.wait; module "
           "nbdist_threaded started it at import (")
    assert [(r.start, r.start_why.startswith(why)) for r in job.state.ranks] == [
        ("warm", True), ("warm", True)]  # interpreters warmed after the first job
    detail = _status(ip, capsys, job.id)
    assert f"ranks 0, 1 started in warm interpreters, not forked: {why}" in detail
    assert "nbdist_threaded.py:2))" in detail
    assert f"ranks 0, 1 started in warm interpreters, not forked: {why}" in _status(
        ip, capsys, f"{job.id} --timeline")
    html = status.RanksReport(job.state)._repr_html_()
    assert "started in warm interpreters, not forked: the zygote cannot fork: thread" in html


@pytest.mark.slow
def test_forked_ranks_say_so_only_in_the_timeline(ip: Any, capsys: Any) -> None:
    """Ranks forked from the zygote: no note in ``%dist_status JOB``; the timeline says so."""
    run(ip, "%%distributed -np 2 --quiet\n1")
    run(ip, "%%distributed -np 2 --quiet\n2")
    job = nbdist.job.get_job()
    assert job is not None
    assert [r.start for r in job.state.ranks] == ["forked", "forked"]
    assert "started" not in _status(ip, capsys, job.id)
    assert "ranks 0, 1 forked from a zygote\n" in _status(ip, capsys, f"{job.id} --timeline")


@pytest.mark.slow
def test_with_zygotes_off_the_ranks_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """NBDIST_ZYGOTE=0: the first job's ranks start fresh and the next ones warm, saying why."""
    monkeypatch.setattr(local, "ZYGOTE", False)
    first = nbdist.run(abs, -1, np=2)
    assert first.results == [1, 1]
    assert local.pool.wait_ready(timeout=60)
    second = nbdist.run(abs, -2, np=1)
    assert second.results == [2]
    assert status.start_lines(first.state) == [
        "ranks 0, 1 started as fresh interpreters: zygotes are off (NBDIST_ZYGOTE=0)"]
    assert status.start_lines(second.state) == [
        "rank 0 started in a warm interpreter, not forked: zygotes are off (NBDIST_ZYGOTE=0)"]


def test_start_lines_group_the_ranks_by_how_and_why() -> None:
    """Ranks that started the same way for the same reason share a line; forked ones only
    appear when asked for."""
    job = JobState("j5", "spark", 4)
    starts = [("forked", ""), ("fresh", "no zygote on this executor yet"),
              ("fresh", "no zygote on this executor yet"), ("warm", "the zygote exited")]
    for rank, (how, why) in enumerate(starts):
        job.apply(rank, {"t": "state", "state": "starting", "pid": 10 + rank, "start": how,
                         "why": why})
    assert status.start_lines(job) == [
        "ranks 1, 2 started as fresh interpreters: no zygote on this executor yet",
        "rank 3 started in a warm interpreter, not forked: the zygote exited"]
    assert status.start_lines(job, forked=True)[0] == "rank 0 forked from a zygote"
    job.apply(0, {"t": "state", "state": "starting", "start": 5, "why": None})  # not trusted
    assert job.ranks[0].start == "forked"

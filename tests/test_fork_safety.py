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

import pytest

import nbdist
from nbdist.launch import fork_safety, local

pytestmark = pytest.mark.timeout(180)


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
    site = tmp_path / "site-packages"  # what counts as installed, not the user's own code
    site.mkdir()
    (site / "nbdist_maps_libcuda.py").write_text(f"import ctypes\nctypes.CDLL({str(lib)!r})\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")])))
    nbdist.run(_ppid, np=1).result()
    assert local.pool.wait_ready(timeout=60)
    (zygote,) = local.pool._zygotes.values()
    with open(f"/proc/{zygote.pid}/maps") as maps:
        assert str(lib) in maps.read()  # the library is mapped in the zygote
    assert zygote.safe, zygote.why
    assert nbdist.run(_ppid, np=1).result() == zygote.pid  # forked
    assert nbdist.run(_ppid, np=2).results == [zygote.pid] * 2

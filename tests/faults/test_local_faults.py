"""The fault matrix on the local backend: every way a distributed job can go wrong.

Each test injects one fault into real rank processes and checks what the user gets: a clear
error naming the rank, and nothing left running (the autouse guard in tests/conftest.py fails
any test that leaves a process behind for more than 10 s). Run alone with
``pytest tests/faults``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbdist
from nbdist import events

from ..conftest import rank_processes, wait_for

pytestmark = pytest.mark.timeout(180)


def job_of(src: str, np: int = 2, **kw: Any) -> nbdist.job.Job:
    """Run a function named ``f`` defined by ``src`` (module-level code) on ``np`` ranks."""
    ns: dict[str, Any] = {}
    exec(compile(textwrap.dedent(src), "<fault>", "exec"), ns)
    return nbdist.run(ns["f"], np=np, **kw)


def failure(job: nbdist.job.Job) -> nbdist.DistributedError:
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    return info.value


COLLECTIVE = """
def f():
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if dist.get_rank() == {bad}:
        {fault}
    dist.all_reduce(torch.ones(1))   # the others wait here for the bad rank
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()
"""


def test_exception_while_others_wait_in_a_collective() -> None:
    """Rank 1 raising while rank 0 waits in all_reduce: its traceback, and rank 0 torn down."""
    pytest.importorskip("torch")
    job = job_of(COLLECTIVE.format(bad=1, fault="raise RuntimeError('NaN loss at step 3')"))
    err = failure(job)
    assert str(err).startswith("rank 1 of 2 failed: RuntimeError: NaN loss at step 3")
    assert 'File "<fault>", line 8, in f' in err.failures[1]
    wait_for(lambda: not rank_processes(), 10, "both ranks gone")


@pytest.mark.parametrize(
    ("fault", "signal_name"),
    [("os.kill(os.getpid(), 9)", "SIGKILL"),
     ("import ctypes; ctypes.string_at(0)", "SIGSEGV")],
)
def test_rank_killed_by_a_signal_in_a_collective(fault: str, signal_name: str) -> None:
    """A rank dying of SIGKILL or a segfault is named with its signal; its peer is stopped."""
    pytest.importorskip("torch")
    err = failure(job_of(COLLECTIVE.format(bad=0, fault=fault)))
    assert f"rank 0 was killed by {signal_name}" in err.failures[0]
    assert str(err).startswith("rank 0 of 2 failed")


@pytest.mark.parametrize(
    ("fault", "expected"),
    [("import sys; sys.exit(3)", "called sys.exit(3)"),
     ("os._exit(0)", "exited with code 0 before returning a result")],
)
def test_rank_exits_early_without_a_result(fault: str, expected: str) -> None:
    """sys.exit(3) and os._exit(0) before the end are failures naming the rank and the code."""
    src = f"""
def f():
    import os, time
    if os.environ["RANK"] == "1":
        print("leaving early", flush=True)
        {fault}
    time.sleep(600)
"""
    err = failure(job_of(src))
    assert expected in err.failures[1]
    assert list(err.failures) == [1]


def test_hung_collective_with_timeout() -> None:
    """A deadlock (rank 1 never joins the collective) ends at --timeout naming both ranks."""
    pytest.importorskip("torch")
    src = """
def f():
    import time
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("entering all_reduce" if dist.get_rank() == 0 else "deadlocked elsewhere", flush=True)
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
"""
    err = failure(job_of(src, timeout=15))
    assert err.reason == "timeout"
    assert "entering all_reduce" in err.failures[0]
    assert "deadlocked elsewhere" in err.failures[1]


@pytest.mark.parametrize("how", ["Popen", "setsid", "double-fork"])
def test_processes_a_rank_starts_die_with_it(how: str, tmp_path: Path) -> None:
    """Children the rank leaves running (same group, own session, daemonized) are killed."""
    pidfile = tmp_path / "pid"
    starts = {
        "Popen": "subprocess.Popen(['sleep', '600'])",
        "setsid": "subprocess.Popen(['sleep', '600'], start_new_session=True)",
        "double-fork": "subprocess.Popen(['sh', '-c', 'setsid sleep 600 & echo started'])",
    }
    src = f"""
def f():
    import subprocess, time, psutil
    {starts[how]}
    time.sleep(0.5)
    kids = psutil.Process().children(recursive=True)
    pid = [k.pid for k in kids if k.name() == 'sleep'][0]
    open({str(pidfile)!r}, 'w').write(str(pid))
    return pid
"""
    pid = job_of(src, np=1).result(timeout=60)
    assert pid == int(pidfile.read_text())
    wait_for(lambda: not _alive(pid), 10, f"the {how} child to die")


def test_cancel_kills_escaped_children_too(tmp_path: Path) -> None:
    """Cancelling a job kills what its ranks started in their own sessions."""
    src = f"""
def f():
    import subprocess, time
    p = subprocess.Popen(['sleep', '600'], start_new_session=True)
    open({str(tmp_path / 'pid')!r} + __import__('os').environ['RANK'], 'w').write(str(p.pid))
    time.sleep(600)
"""
    job = job_of(src)
    wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 30, "both ranks' children")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    job.cancel()
    assert failure(job).reason == "cancelled"
    wait_for(lambda: not any(_alive(p) for p in pids), 10, "the escaped children to die")


def test_too_many_gpu_ranks_fail_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for more GPU ranks than GPUs is a CapacityError with the numbers, before launch."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(nbdist.CapacityError, match=r"asked for 2 ranks with one GPU each.*has 1"):
        nbdist.run(print, np=2, gpu=True)
    assert not rank_processes()


def test_output_flood_keeps_driver_memory_bounded() -> None:
    """Huge lines, no newlines, invalid UTF-8 and \\r storms: the job ends, memory stays small."""
    src = """
def f():
    import os, sys
    os.write(1, b"y" * (10 * 1024 * 1024) + b"\\n")          # one 10 MB line
    os.write(1, b"z" * (8 * 1024 * 1024))                     # 8 MB without a newline
    os.write(1, b"\\n" + bytes(range(128, 256)) * 1000 + b"\\n")  # invalid UTF-8
    for i in range(200_000):                                  # a \\r storm
        sys.stdout.write(f"{i}\\r")
    sys.stdout.flush()
    chunk = (b"x" * 1023 + b"\\n") * 1024
    for _ in range(256):                                      # 256 MiB of 1 KiB lines
        os.write(1, chunk)
    os.write(1, bytes(range(128, 256)) * 1000 + b"\\n")     # invalid UTF-8
    print("end of flood", flush=True)
    return "survived"
"""
    rss_before = psutil.Process().memory_info().rss
    job = job_of(src, np=1)
    assert job.result(timeout=170) == "survived"
    r = job.state.ranks[0]
    assert r.last_line == "end of flood"
    assert max(len(line.text) for line in r.log) <= 20_000  # long lines were cut
    assert any("\ufffd" in line.text for line in r.log)  # bad bytes replaced, not fatal
    assert r.lines > 256 * 1024 and len(r.log) == nbdist.state.LOG_LINES
    grown = psutil.Process().memory_info().rss - rss_before
    assert grown < 200 * 1024 * 1024, f"driver grew by {grown / 1e6:.0f} MB"


def test_strangers_on_the_event_server_do_not_disturb_a_job(tmp_path: Path) -> None:
    """Garbage, a wrong MAC and a replayed hello are rejected while a real job runs on."""
    gate = tmp_path / "gate"
    src = f"""
def f():
    import os, time
    print("working", flush=True)
    while not os.path.exists({str(gate)!r}):
        time.sleep(0.01)
    return int(os.environ["RANK"])
"""
    job = job_of(src)
    wait_for(lambda: all(r.last_line == "working" for r in job.state.ranks), 30, "ranks up")
    server = events.shared_server("127.0.0.1")
    rejected = server.rejected
    for payload in (b"GET / HTTP/1.1\r\n\r\n",
                    events.encode({"t": "hello", "job": job.id, "rank": 0, "mac": "0" * 64}),
                    events.encode({"t": "hello", "job": job.id, "rank": 5, "mac": "x"})):
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.makefile("rb").readline()
            sock.sendall(payload)
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed on us
    wait_for(lambda: server.rejected == rejected + 3, 10, "three rejections")
    gate.touch()
    assert job.results == [0, 1]


def test_result_that_cannot_be_unpickled_on_the_driver(tmp_path: Path) -> None:
    """A value whose class exists only on the ranks is an error naming the rank and the type."""
    (tmp_path / "rank_only_mod.py").write_text("class Weights:\n    pass\n")
    src = """
def f():
    import rank_only_mod
    return rank_only_mod.Weights()
"""
    err = failure(job_of(src, np=1, env={"PYTHONPATH": str(tmp_path)}))
    assert "rank 0's result (a rank_only_mod.Weights) cannot be unpickled" in str(err)
    assert "No module named 'rank_only_mod'" in str(err)


def _alive(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_interrupt_in_a_real_kernel_stops_the_ranks(tmp_path: Path) -> None:
    """The stop button (SIGINT to the kernel) cancels the job, and the next cell works."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute_interactive("%load_ext nbdist", timeout=60)
        msg_id = kc.execute("%%distributed -np 2\nimport os, time\n"
                            f"open({str(tmp_path)!r} + '/up' + os.environ['RANK'], 'w').close()\n"
                            "time.sleep(600)")
        wait_for(lambda: len(list(tmp_path.glob("up*"))) == 2, 120, "both ranks up")
        kernel = psutil.Process(km.provisioner.process.pid)  # type: ignore[union-attr]
        ranks = [p for p in kernel.children(recursive=True) if "nbdist.runtime" in
                 " ".join(p.cmdline())]
        assert len(ranks) == 2
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "DistributedError"
        assert "interrupted from the notebook" in reply["content"]["evalue"]
        psutil.wait_procs(ranks, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
        out = kc.execute_interactive("%%distributed -np 2 --quiet\n6 * 7", timeout=120)
        assert out["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_hundred_jobs_leak_nothing(ip: Any) -> None:
    """100 jobs, a third of them failing, leave threads, fds, ports, children and memory flat."""
    me = psutil.Process()

    def snapshot() -> dict[str, float]:
        from nbdist.launch.local import pool

        pool.clear()  # warm interpreters are by design; the question is what accumulates
        wait_for(lambda: not rank_processes(), 10, "the last ranks to exit")
        return {
            "threads": me.num_threads(),
            "fds": me.num_fds(),
            "listening": sum(1 for c in me.net_connections("tcp") if c.status == "LISTEN"),
            "children": len([c for c in me.children(recursive=True)
                             if c.status() != psutil.STATUS_ZOMBIE]),
            "rss_mb": me.memory_info().rss / 2**20,
        }

    def one(i: int) -> None:
        result = ip.run_cell(f"%%distributed -np 2 --quiet\nimport os\n"
                             f"if {i} % 3 == 0 and os.environ['RANK'] == '1':\n"
                             f"    raise ValueError('planned failure {i}')\n"
                             f"print('job {i}')\n{i}\n")
        if i % 3 == 0:
            assert isinstance(result.error_in_exec, nbdist.DistributedError)
        else:
            assert result.result == i

    for i in range(5):  # warm up: the event server, thread pools and caches exist from here on
        one(i)
    before = snapshot()
    for i in range(5, 105):
        one(i)
    wait_for(lambda: not rank_processes(), 10, "the last ranks to exit")
    after = snapshot()
    report = {k: {"before": before[k], "after": after[k]} for k in before}
    Path("test-artifacts").mkdir(exist_ok=True)
    Path("test-artifacts/soak.json").write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"soak: {report}\n")
    assert after["threads"] <= before["threads"] + 2
    assert after["fds"] <= before["fds"] + 4
    assert after["listening"] <= before["listening"]
    assert after["children"] == 0
    assert after["rss_mb"] - before["rss_mb"] < 50
    assert os.getpid() == me.pid


def test_interrupt_while_the_view_is_built_still_cancels(ip: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop button landing before the wait (here: while the view is built) cancels too."""
    from nbdist.magics import DistMagics

    def interrupted(self: Any, job: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(DistMagics, "_view", interrupted)
    result = ip.run_cell("%%distributed -np 2\nimport time\ntime.sleep(600)")
    err = result.error_in_exec
    assert isinstance(err, nbdist.DistributedError), repr(err)
    assert err.reason == "cancelled" and "interrupted from the notebook" in str(err)
    wait_for(lambda: not rank_processes(), 10, "the ranks to be stopped")

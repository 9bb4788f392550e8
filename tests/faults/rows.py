"""The rows of the fault matrix, each injected on the backend it is given.

``test_local_faults.py`` and ``test_spark_faults.py`` run the same rows, each on its backend
(:class:`Target`): the same fault in real rank processes, the same checks of what the user
gets. What only one backend has (a real kernel's stop button, a killed Spark task) lives in
that backend's file.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import socket
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

import nbdist
from nbdist import channel, events
from nbdist.errors import OutputLostWarning
from nbdist.job import Job
from nbdist.launch import Launcher
from nbdist.launch.backends import choose as choose_launcher
from nbdist.protocol import CallPayload, LaunchRequest, RankOutcome

from ..helpers import GONE_WITHIN_S, Gate, wait_for


class Target(NamedTuple):
    """Where a row runs: the backend's name and how to find the ranks' processes."""

    backend: str
    processes: Callable[[], list[psutil.Process]]


def job_of(target: Target, src: str, np: int = 2, **kw: Any) -> Job:
    """Run a function named ``f`` defined by ``src`` (module-level code) on ``np`` ranks."""
    return nbdist.run(define(src), np=np, backend=target.backend, **kw)


def define(src: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(compile(textwrap.dedent(src), "<fault>", "exec"), ns)
    fn: Callable[..., Any] = ns["f"]
    return fn


def failure(job: Job) -> nbdist.DistributedError:
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    return info.value


def alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def all_gone(target: Target) -> None:
    wait_for(lambda: not target.processes(), GONE_WITHIN_S, "every rank process to end")


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

SIGNALS = [("os.kill(os.getpid(), 9)", "SIGKILL"),
           ("import ctypes; ctypes.string_at(0)", "SIGSEGV")]

EARLY_EXITS = [("import sys; sys.exit(3)", "called sys.exit(3)"),
               ("os._exit(0)", "exited with code 0 before returning a result")]

LINGERING = {
    "Popen": "subprocess.Popen(['sleep', '600'])",
    "setsid": "subprocess.Popen(['sleep', '600'], start_new_session=True)",
    "double-fork": "subprocess.Popen(['sh', '-c', 'setsid sleep 600 & echo started'])",
}


def exception_in_a_collective(target: Target) -> None:
    pytest.importorskip("torch")
    err = failure(job_of(target, COLLECTIVE.format(
        bad=1, fault="raise RuntimeError('NaN loss at step 3')")))
    assert str(err).startswith("rank 1 of 2 failed: RuntimeError: NaN loss at step 3")
    assert 'File "<fault>", line 8, in f' in err.failures[1]
    all_gone(target)


def killed_by_a_signal(target: Target, fault: str, signal_name: str) -> None:
    pytest.importorskip("torch")
    err = failure(job_of(target, COLLECTIVE.format(bad=0, fault=fault)))
    shown = (str(err), err.failures)
    assert f"rank 0 was killed by {signal_name}" in err.failures.get(0, ""), shown
    assert str(err).startswith("rank 0 of 2 failed"), shown
    all_gone(target)


def exits_early(target: Target, fault: str, expected: str) -> None:
    src = f"""
def f():
    import os, time
    if os.environ["RANK"] == "1":
        print("leaving early", flush=True)
        {fault}
    time.sleep(600)
"""
    err = failure(job_of(target, src))
    assert expected in err.failures[1]
    assert list(err.failures) == [1]
    all_gone(target)


def hung_collective(target: Target, timeout: float) -> None:
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
    err = failure(job_of(target, src, timeout=timeout))
    assert err.reason == "timeout"
    assert "ranks still running: 0, 1" in str(err)
    assert "entering all_reduce" in err.failures[0]
    assert "deadlocked elsewhere" in err.failures[1]
    all_gone(target)


def lingering_children_die(target: Target, how: str, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    src = f"""
def f():
    import subprocess, time, psutil
    {LINGERING[how]}
    time.sleep(0.5)
    kids = psutil.Process().children(recursive=True)
    pid = [k.pid for k in kids if k.name() == 'sleep'][0]
    open({str(pidfile)!r}, 'w').write(str(pid))
    return pid
"""
    pid = job_of(target, src, np=1).result(timeout=120)
    assert pid == int(pidfile.read_text())
    wait_for(lambda: not alive(pid), GONE_WITHIN_S, f"the {how} child to die")


#: A rank dying at once, and what its failure then says.
SUDDEN_DEATHS = {
    "os._exit": ("os._exit(3)", "exited with code 3 before returning a result"),
    "SIGKILL": ("os.kill(os.getpid(), 9)", "was killed by SIGKILL"),
    "segfault": ("import ctypes; ctypes.string_at(0)", "was killed by SIGSEGV"),
}


def escaped_child_dies_with_its_rank(target: Target, death: str, tmp_path: Path) -> None:
    fault, expected = SUDDEN_DEATHS[death]
    pidfile = tmp_path / "pid"
    src = f"""
def f():
    import os, subprocess
    # Its own session, and the rank's stdout and stderr: nothing of the rank's group.
    p = subprocess.Popen(['sleep', '600'], start_new_session=True)
    open({str(pidfile)!r}, 'w').write(str(p.pid))
    print("started it", flush=True)
    {fault}
"""
    err = failure(job_of(target, src, np=1))
    assert expected in err.failures[0] and "started it" in err.failures[0]
    pid = int(pidfile.read_text())
    wait_for(lambda: not alive(pid), GONE_WITHIN_S, f"the escaped child to die ({death})")
    all_gone(target)


def cancel_kills_escaped_children(target: Target, tmp_path: Path) -> None:
    src = f"""
def f():
    import subprocess, time
    p = subprocess.Popen(['sleep', '600'], start_new_session=True)
    open({str(tmp_path / 'pid')!r} + __import__('os').environ['RANK'], 'w').write(str(p.pid))
    time.sleep(600)
"""
    job = job_of(target, src)
    wait_for(lambda: len(list(tmp_path.glob("pid*"))) == 2, 120, "both ranks' children")
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    job.cancel()
    assert failure(job).reason == "cancelled"
    wait_for(lambda: not any(alive(p) for p in pids), GONE_WITHIN_S,
             "the escaped children to die")
    all_gone(target)


FLOOD = """
def f():
    import os, sys
    os.write(1, b"y" * (10 * 1024 * 1024) + b"\\n")          # one 10 MB line
    os.write(1, b"z" * (8 * 1024 * 1024))                     # 8 MB without a newline
    os.write(1, b"\\n" + bytes(range(128, 256)) * 1000 + b"\\n")  # invalid UTF-8
    for i in range(200_000):                                  # a \\r storm
        sys.stdout.write(f"{{i}}\\r")
    sys.stdout.flush()
    chunk = (b"x" * 1023 + b"\\n") * 1024
    for _ in range({mib}):                                    # MiBs of 1 KiB lines
        os.write(1, chunk)
    os.write(1, bytes(range(128, 256)) * 1000 + b"\\n")     # invalid UTF-8
    print("end of flood", flush=True)
    return "survived"
"""


def output_flood(target: Target, mib: int) -> None:
    rss_before = psutil.Process().memory_info().rss
    job = job_of(target, FLOOD.format(mib=mib), np=1)
    assert job.result(timeout=170) == "survived"
    r = job.state.ranks[0]
    assert r.last_line == "end of flood"
    assert max(len(line.text) for line in r.log) <= 20_000  # long lines were cut
    assert any("\ufffd" in line.text for line in r.log)  # bad bytes replaced, not fatal
    assert r.lines > mib * 1024 and len(r.log) == nbdist.state.LOG_LINES
    grown = psutil.Process().memory_info().rss - rss_before
    assert grown < 200 * 1024 * 1024, f"driver grew by {grown / 1e6:.0f} MB"
    # The flood's log file (hundreds of MB) goes: left in the temporary folder, run after
    # run, the suite's floods filled a machine's disk.
    shutil.rmtree(str(job.state.log_dir), ignore_errors=True)


def strangers_are_rejected(target: Target, tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    src = """
def f(gate):
    import os
    print("working", flush=True)
    gate.wait()
    return int(os.environ["RANK"])
"""
    job = job_of(target, src, gate=gate)
    wait_for(lambda: all(r.last_line == "working" for r in job.state.ranks), 120, "ranks up")
    server = events.shared_server(job.launcher.driver_address())
    rejected = server.rejected
    for payload in (b"GET / HTTP/1.1\r\n\r\n",
                    channel.encode({"t": "hello", "job": job.id, "rank": 0, "mac": "0" * 64}),
                    channel.encode({"t": "hello", "job": job.id, "rank": 5, "mac": "x"})):
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.makefile("rb").readline()
            sock.sendall(payload)
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed on us
    wait_for(lambda: server.rejected == rejected + 3, 10, "three rejections")
    gate.open()
    assert job.results == [0, 1]


def result_cannot_be_unpickled(target: Target, tmp_path: Path) -> None:
    (tmp_path / "rank_only_mod.py").write_text("class Weights:\n    pass\n")
    src = """
def f():
    import rank_only_mod
    return rank_only_mod.Weights()
"""
    err = failure(job_of(target, src, np=1, env={"PYTHONPATH": str(tmp_path)}))
    assert "rank 0's result (a rank_only_mod.Weights) cannot be unpickled" in str(err)
    assert "No module named 'rank_only_mod'" in str(err)


class Misdirected:
    """A real backend whose ranks are told a closed port for the driver's event server.

    Everything else is the backend's own: its supervisors find nothing listening there, as
    behind a firewall or with a driver address the executors cannot route to.
    """

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.name = launcher.name
        self.remote = launcher.remote
        self.port = channel.free_port("127.0.0.1")  # free: nothing listens on it

    def driver_address(self) -> events.DriverAddress:
        return self.launcher.driver_address()

    def capacity(self) -> Any:
        return self.launcher.capacity()

    def check(self, np: int, gpu: bool) -> None:
        self.launcher.check(np, gpu)

    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        closed = (request.driver[0], self.port)
        self.launcher.start(dataclasses.replace(request, driver=closed), on_outcome)

    def cancel(self) -> None:
        self.launcher.cancel()

    def deliver(self, rank: int, event: Any) -> bool:
        return self.launcher.deliver(rank, event)


def misdirected_job(target: Target, src: str, np: int = 2) -> tuple[Job, Misdirected]:
    """A job whose ranks cannot reach the driver's event server (see :class:`Misdirected`)."""
    launcher = Misdirected(choose_launcher(np, target.backend)[0])
    payload: CallPayload = {"kind": "call", "fn": define(src), "args": (), "kwargs": {}}
    return Job(payload, np, launcher).start(), launcher


UNREACHABLE = """
def f():
    import torch
    import torch.distributed as dist
    import nbdist
    dist.init_process_group("gloo")
    for step in nbdist.progress(range(3)):
        print(f"rank {dist.get_rank()} step {step}", flush=True)
    nbdist.report(loss=0.5)
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} done", flush=True)
    return dist.get_rank(), int(total.item())
"""

FAILS_UNREACHABLE = """
def f():
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    print("about to fail", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("bad shard 7")
    dist.all_reduce(torch.ones(1))  # loses rank 1: "Connection closed by peer"
    return 0
"""


def unreachable_event_server(target: Target) -> None:
    pytest.importorskip("torch")
    job, launcher = misdirected_job(target, UNREACHABLE)
    with pytest.warns(OutputLostWarning) as warned:
        assert job.results == [(0, 2), (1, 2)]  # the world was planned, the collective ran
    lost = job.lost_output
    assert lost is not None and str(warned[0].message) == lost == job.state.reason
    where = f"{job.address.advertise}:{launcher.port}"
    assert re.search(r"output lost from ranks 0, 1: 8 lines of output and [1-9]\d* "
                     r"progress/metrics updates never reached the notebook", lost), lost
    assert f"cannot reach the driver's event server at {where}: ConnectionRefusedError" in lost
    assert job.state.status == nbdist.state.DONE
    for r in job.state.ranks:  # each rank's last lines came back with its outcome
        assert [line.text for line in r.log][-2:] == [f"rank {r.rank} step 2",
                                                        f"rank {r.rank} done"]
    # A failure is reported as usual, through the backend, with the same note. Nothing is
    # heard over the channel, and a Spark collect() hands rank 0's outcome over first: still
    # rank 1's error is named, not rank 0's lost peer that followed from it (nbdist.blame).
    job, _ = misdirected_job(target, FAILS_UNREACHABLE)
    err = failure(job)
    assert str(err).startswith("rank 1 of 2 failed: ValueError: bad shard 7"), str(err)
    assert 'File "<fault>", line 8, in f' in err.failures[1]
    # Rank 0 printed its line, or was stopped before it could.
    assert re.search(r"output lost from ranks 0, 1: (1 line|2 lines) of output", str(err))
    all_gone(target)


LIVE = """
def f(gate):
    import os
    print("live", flush=True)
    gate.wait()
    return int(os.environ["RANK"])
"""


def streams_live(target: Target, tmp_path: Path, name: str) -> None:
    """A 2-rank job whose output reaches the notebook while it runs: it waits for a gate that
    opens only once both ranks' first line has arrived."""
    gate = Gate(tmp_path / name)
    job = job_of(target, LIVE, gate=gate)
    try:
        wait_for(lambda: all(r.last_line == "live" for r in job.state.ranks), 120,
                 "both ranks' line, live, before the job ends")
    finally:
        gate.open()
    assert job.results == [0, 1]
    assert job.lost_output is None


def hostile_input_then_a_live_job(target: Target, tmp_path: Path) -> None:
    from .. import hostile

    ended = job_of(target, "def f():\n    return 0\n", np=1)
    assert ended.results == [0]
    server = events.shared_server(ended.launcher.driver_address())
    before = server.rejected
    cases = hostile.malformed(ended.id)
    cases.append(("a signed hello for the job that just ended",
                  lambda nonce: channel.encode({"t": "hello", "job": ended.id, "rank": 0,
                                               "mac": channel.sign(ended._secret, nonce,
                                                                  ended.id, 0)})))
    assert hostile.send_each(server.address, cases) == []
    wait_for(lambda: server.rejected == before + len(cases), 10, "every connection counted")
    streams_live(target, tmp_path, "after-hostile-input")


def fifo_log_then_a_live_job(target: Target, tmp_path: Path) -> None:
    """A job whose ``--log-dir`` holds a FIFO named ``rank-0.log`` (nobody reads it) ends with
    its log error said, and a job after it streams live: the FIFO is refused, never opened to
    block the event server that serves every job (HARDENING.md rule 3)."""
    import os

    from nbdist import job as jobs
    from nbdist.options import JobOptions

    from .. import hostile

    folder = tmp_path / "logs"
    folder.mkdir()
    pipe = hostile.fifo(str(folder / "rank-0.log"))
    payload: CallPayload = {"kind": "call", "code": None, "kwargs": {}, "args": (),
                            "fn": define("def f():\n    print('to a fifo', flush=True)\n"
                                         "    return 7\n")}
    try:
        job = jobs.start(payload, 1, JobOptions(backend=target.backend, log_dir=str(folder)))
        assert job.result(timeout=120) == 7
        assert job.state.log_error is not None and pipe in job.state.log_error, \
            job.state.log_error
        streams_live(target, tmp_path, "after-a-fifo-log")
    finally:
        # Unblocks an event server stuck opening the FIFO (before the fix): a writer waiting
        # in open() goes on once a reader opened, even one gone at once.
        os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))


def a_job_among_idle_strangers(target: Target, tmp_path: Path) -> None:
    from .. import hostile

    server = events.shared_server(choose_launcher(1, target.backend)[0].driver_address())
    before = server.rejected
    with hostile.IdleStrangers(server.address, 1000) as strangers:
        streams_live(target, tmp_path, "among-strangers")
        held = strangers.held
        # Each one is cut within AUTH_DEADLINE_S of connecting (or earlier, for a newer one).
        wait_for(lambda: strangers.cut >= 1000, 60, "the server cutting the strangers")
    assert held > 900, f"only {held} strangers were connected when the job ended"
    assert server.rejected - before >= strangers.cut

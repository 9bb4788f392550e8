"""When a distributed cell goes wrong: complete per-rank logs, and why a rank died (issue 29)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist import job as jobs
from nbdist import logfiles
from nbdist.errors import DistributedError
from nbdist.launch import local
from nbdist.rank import death
from nbdist.settings import settings
from nbdist.views import status

from .helpers import GONE_WITHIN_S, Gate, running_job, wait_for


def test_tail_reads_the_last_lines_across_blocks(tmp_path: Path) -> None:
    """``logfiles.tail`` returns the last N lines of a file read backwards in small blocks."""
    path = tmp_path / "rank-0.log"
    path.write_text("".join(f"line {i}\n" for i in range(1000)) + "bar 1\rbar 2\n")
    assert logfiles.tail(str(path), 3, block=7) == ["line 998", "line 999", "bar 2"]
    assert logfiles.tail(str(path), 5000)[0] == "line 0"
    assert logfiles.tail(str(path), 0) == []


def test_rank_logs_append_per_rank_and_say_when_they_cannot(tmp_path: Path) -> None:
    """Each rank's text goes to its own file, appended; an unwritable folder is reported once."""
    logs = logfiles.RankLogs(str(tmp_path / "logs"))
    logs.write(1, "a\nb")
    logs.write(1, "c\n")
    logs.write(0, "zero\n")
    logs.close()
    assert (tmp_path / "logs" / "rank-1.log").read_text() == "a\nbc\n"
    assert (tmp_path / "logs" / "rank-0.log").read_text() == "zero\n"
    (tmp_path / "file").write_text("")
    bad = logfiles.RankLogs(str(tmp_path / "file" / "logs"))
    bad.write(0, "x\n")
    bad.close()  # written by a thread of its own: what was given is written (or failed) now
    assert bad.error is not None and "cannot write the ranks' log files" in bad.error


def test_status_names_the_logs_and_how_ranks_ended() -> None:
    """``%dist_status JOB`` names the log folder, each rank's peaks and how a failed rank died."""
    job = running_job(2)
    job.log_dir = "/tmp/x/j77"
    job.apply(1, {"t": "res", "rss": 10_000_000, "peak": 1_700_000_000, "cpu": 150.0})
    job.set_rank(1, "failed", -9)
    job.set_end(1, "killed by the kernel's out-of-memory killer, peak RSS 21.7 GB")
    text = status.ranks_table(job)
    assert "rank 1: killed by the kernel's out-of-memory killer, peak RSS 21.7 GB" in text
    assert "peak RSS 1.7 GB · CPU 150%" in text
    assert "/tmp/x/j77/rank-R.log" in text and "%dist_status j77 --rank R" in text
    assert "out-of-memory killer" in status.RanksReport(job)._repr_html_()


def test_status_rank_options_are_checked() -> None:
    """``--lines`` needs ``--rank``, both take whole numbers, and both need a job."""
    from nbdist.magics import parse_status

    assert parse_status("j3 --rank 1 --lines 50")[4:] == (1, 50)
    assert parse_status("j3 --rank=2")[4:] == (2, 20)
    for line, words in [("j3 --lines 5", "add --rank R"), ("--rank 1", "need a job"),
                        ("j3 --rank x", "whole number")]:
        with pytest.raises(UsageError, match=words):
            parse_status(line)


CELL_MANY_LINES = """
import os
for i in range(2500):
    print(f"rank {os.environ['RANK']} line {i}")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_line_of_every_rank_is_in_its_log_file(
        ip: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--log-dir`` gets all 2500 lines of each rank although the panel keeps 1000, and
    ``%dist_status JOB --rank R --lines N`` shows the end of one."""
    ip.run_cell_magic("distributed", f"-np 2 --quiet --log-dir {tmp_path}", CELL_MANY_LINES)
    job = jobs.jobs()[-1]
    assert job.state.log_dir == str(tmp_path)
    assert len(job.state.ranks[0].log) == 1000
    for rank in (0, 1):
        lines = (tmp_path / f"rank-{rank}.log").read_text().splitlines()
        assert lines == [f"rank {rank} line {i}" for i in range(2500)]
    capsys.readouterr()
    ip.run_line_magic("dist_status", f"{job.id} --rank 1 --lines 2")
    shown = capsys.readouterr().out
    assert shown.splitlines()[1:] == ["rank 1 line 2498", "rank 1 line 2499"]
    ip.run_line_magic("dist_status", job.id)
    assert f"{tmp_path}/rank-R.log" in capsys.readouterr().out
    with pytest.raises(UsageError, match="has ranks 0 to 1, not 5"):
        ip.run_line_magic("dist_status", f"{job.id} --rank 5")


def _killed_after_peak(release: Gate) -> int:
    import os
    import signal

    rank = int(os.environ["RANK"])
    if rank == 1:
        held = b"x" * (120 << 20)  # resident: bytes * n writes every page
        print("holding", len(held), flush=True)
        release.wait()  # the test saw the peak in a sample
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_named_with_its_peak_memory(tmp_path: Path) -> None:
    """A rank killed by SIGKILL (not the OOM killer) is named with the signal and its peak
    RSS, in the error and in the job's state, which keeps the peak after the job ended."""
    release = Gate(tmp_path / "release")
    job = nbdist.run(_killed_after_peak, release, np=2, backend="local")
    wait_for(lambda: (job.state.ranks[1].peak_rss or 0) > 120e6, 60, "rank 1's peak in a sample")
    release.open()
    with pytest.raises(DistributedError, match=r"rank 1 of 2 failed: rank 1 was killed by "
                       r"SIGKILL, peak RSS 1\d\d MB"):
        job.result(timeout=60)
    r1 = job.state.ranks[1]
    assert r1.end.startswith("killed by SIGKILL, peak RSS") and (r1.peak_rss or 0) > 120e6
    assert "out-of-memory" not in str(job.error)


def _segfaults_in_a_collective(gate: Gate) -> int:
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        import subprocess

        child = subprocess.Popen(["sleep", "600"])  # in the rank's process group
        print("child", child.pid, flush=True)
    print("in the group", flush=True)
    if dist.get_rank() == 0:
        gate.wait()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(t)  # rank 1: "Connection closed by peer" as rank 0 dies
    return 1


@pytest.mark.slow
@pytest.mark.fresh_pool
@pytest.mark.timeout(180)
def test_a_rank_whose_death_is_told_after_the_stop_it_caused_failed_and_was_not_stopped(
        gate: Gate, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop that rank 1's "Connection closed by peer" causes can reach rank 0's
    supervisor before rank 0's own death by SIGSEGV does (its parent reaps it and tells, a
    beat later on a busy machine: held here with SIGSTOP). Rank 0 is still the rank that
    failed, killed by SIGSEGV, not a rank nbdist stopped."""
    pytest.importorskip("torch")
    monkeypatch.setattr(local, "ZYGOTE", False)  # each rank's parent: its own guardian
    job = nbdist.run(_segfaults_in_a_collective, gate, np=2, backend="local")
    wait_for(lambda: all(r.last_line == "in the group" for r in job.state.ranks), 120,
             "both ranks in the process group")
    (child,) = [int(ln.text.split()[1]) for ln in job.state.ranks[0].log
                if ln.text.startswith("child ")]
    launcher = job.launcher
    assert isinstance(launcher, local.LocalLauncher)
    guardian = psutil.Process(job.state.ranks[0].pid)
    (rank0,) = guardian.children()
    guardian.suspend()  # rank 0's end is not reaped, nor told to its supervisor, until resumed
    try:
        gate.open()
        wait_for(lambda: rank0.status() == psutil.STATUS_ZOMBIE, 60, "rank 0's death")
        # Rank 1's failure was heard (its guardian was not held) and both supervisors were
        # told to stop, while rank 0's end is still to be told.
        wait_for(lambda: all(s._cancelled.is_set() for s in launcher._supervisors), 60,
                 "the stop that rank 1's failure causes")
        assert guardian.is_running()
    finally:
        guardian.resume()
    with pytest.raises(DistributedError) as caught:
        job.result(timeout=60)
    err = caught.value
    assert str(err).startswith("rank 0 of 2 failed: rank 0 was killed by SIGSEGV"), str(err)
    assert "nbdist stopped" not in str(err), str(err)
    assert sorted(err.failures) == [0, 1]
    assert job.state.ranks[0].status == "failed"
    # Not signalled by the stop (it had died), its process group still went with it.
    wait_for(lambda: not psutil.pid_exists(child) or
             psutil.Process(child).status() == psutil.STATUS_ZOMBIE, GONE_WITHIN_S,
             "rank 0's child to die with it")


def test_an_old_oom_record_of_a_reused_pid_is_not_this_ranks(tmp_path: Path) -> None:
    """The kernel log keeps every OOM kill since boot and pids are reused (32768 of them on
    many hosts): a record logged before the rank's watch began is another process's."""
    now = death.log_clock()
    log = tmp_path / "kmsg"
    # An hour before now, or boot itself on a machine up for less (a negative time is no record).
    old, new = int(max(0.0, now - 3600) * 1e6), int((now + 5) * 1e6)
    log.write_text(
        f"3,101,{old},-;Memory cgroup out of memory: Killed process 4242 (python) "
        "total-vm:185724kB, anon-rss:94720kB, file-rss:5692kB, shmem-rss:0kB\n"
        " SUBSYSTEM=memory\n"
        f"3,102,{new},-;Memory cgroup out of memory: Killed process 4343 (python) "
        "total-vm:185724kB, anon-rss:1024kB, file-rss:1024kB, shmem-rss:0kB\n")
    assert death.kernel_log_kill(4242, str(log), since=now) is None
    assert death.kernel_log_kill(4242, str(log)) is not None  # no start given: any record
    kill = death.kernel_log_kill(4343, str(log), since=now)
    assert kill is not None and kill.rss == 2048 * 1024 and "4343" in kill.evidence


def _memory_cgroup_parent() -> Path | None:
    """A memory cgroup folder this process may create children in (root on cgroup v1 or v2)."""
    own = death.memory_cgroup(os.getpid())
    if own is None or not os.access(own, os.W_OK):
        return None
    return Path(own)


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A fresh memory cgroup limited to 64 MB (no swap), removed after the test."""
    parent = _memory_cgroup_parent()
    if parent is None:
        pytest.skip("no writable memory cgroup here (needs root on cgroup v1 or v2)")
    folder = parent / f"nbdist-oom-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        limits = (["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
                  if (folder / "memory.limit_in_bytes").exists()
                  else ["memory.max", "memory.swap.max"])
        for name in limits:  # memory, then memory + swap (v1) or swap alone (v2)
            if (folder / name).exists():
                (folder / name).write_text("0" if name == "memory.swap.max" else str(64 << 20))
        yield folder
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                folder.rmdir()
                break
            except OSError:  # its last process is still being torn down
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _oom_on_rank_1(cgroup: str) -> int:
    import os

    rank = int(os.environ["RANK"])
    if rank == 1:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        chunks = []
        for _ in range(64):  # 512 MB, 8 MB at a time, far over the cgroup's 64 MB
            chunks.append(b"x" * (8 << 20))
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_oom_killed_under_a_memory_limit_is_named_as_such(memory_cgroup: Path) -> None:
    """A rank that the kernel's OOM killer kills (a cgroup's memory limit) is named as killed
    by the out-of-memory killer, with its peak memory, not as a bare SIGKILL."""
    job = nbdist.run(_oom_on_rank_1, str(memory_cgroup), np=2, backend="local")
    with pytest.raises(DistributedError) as info:
        job.result(timeout=60)
    text = str(info.value) + "".join(info.value.failures.values())
    assert "rank 1 was killed by the kernel's out-of-memory killer, peak RSS" in text, text
    assert job.state.ranks[1].end.startswith("killed by the kernel's out-of-memory killer")
    assert "rank 1: killed by the kernel's out-of-memory killer" in status.ranks_table(job.state)
    assert job.state.ranks[0].status == "done" or job.state.ranks[0].status == "cancelled"
    assert signal.SIGKILL == -(job.state.ranks[1].exit_code or 0)


# -- stacks ---------------------------------------------------------------------------------------
def _dump(*threads: list[tuple[str, int, str]]) -> str:
    """faulthandler's text for threads given outermost call first (it writes innermost first)."""
    out = []
    for i, frames in enumerate(threads):
        out.append(f"Thread 0x00007f00000{i:05x} (most recent call first):")
        out += [f'  File "{f}", line {n} in {fn}' for f, n, fn in reversed(frames)]
        out.append("")
    return "\n".join(out)


#: nbdist's own frames: files under the folder this nbdist is installed in.
PACKAGE = os.path.dirname(nbdist.__file__)
RUNTIME = os.path.join(PACKAGE, "rank", "runtime.py")
NBDIST_THREAD = [("/usr/lib/python3.11/threading.py", 995, "_bootstrap"),
                 ("/usr/lib/python3.11/threading.py", 1038, "_bootstrap_inner"),
                 ("/usr/lib/python3.11/threading.py", 975, "run"),
                 (RUNTIME, 640, "watch"), (os.path.join(PACKAGE, "protocol.py"), 129, "read_frame")]


def _cell_thread(*inner: tuple[str, int, str]) -> list[tuple[str, int, str]]:
    return [("<string>", 1, "<module>"), (RUNTIME, 660, "main"), (RUNTIME, 520, "_serve"),
            (RUNTIME, 137, "_run_cell"), *inner]


def test_stacks_fold_equal_ranks_and_leave_out_nbdist() -> None:
    """Equal stacks fold into ``ranks 0–2, 4–7``; nbdist's frames and threads are left out;
    the cell's frames keep the cell's line numbers."""
    from nbdist import stacks

    reduce = _cell_thread(("<cell In[3]>", 41, "<module>"), ("<cell In[3]>", 12, "step"),
                          ("/torch/distributed/distributed_c10d.py", 2501, "all_reduce"))
    loader = _cell_thread(("<cell In[3]>", 27, "<module>"),
                          ("/torch/utils/data/dataloader.py", 630, "__next__"))
    dumps = {r: _dump(NBDIST_THREAD, loader if r == 3 else reduce) for r in range(8)}
    got = stacks.Stacks.from_dumps("j5", dumps, {8: "did not answer within 3 s; its last "
                                                     "lines:\nstep 9"})
    assert got.summary().splitlines() == [
        "ranks 0–2, 4–7: all_reduce ← step ← <module> (cell line 12)",
        "rank 3: __next__ ← <module> (cell line 27)",
        "rank 8: did not answer within 3 s; its last lines:",
    ]
    text = got.text()
    assert 'File "<cell In[3]>", line 41, in <module>' in text and "runtime.py" not in text
    assert "watch" not in text and "    step 9" in text
    assert stacks.rank_ranges([5, 1, 2]) == "ranks 1, 2, 5"
    assert stacks.rank_ranges([0, 1, 2, 3]) == "ranks 0–3"


def test_nbdist_frames_are_known_by_where_it_is_installed_not_by_a_folder_name() -> None:
    """Frames under the folder nbdist is installed in on the rank's host are left out; a user's
    files in a folder that is merely named ``nbdist`` (a clone of this repository, a package of
    the user's) keep theirs."""
    from nbdist import stacks

    elsewhere = "/opt/venv/lib/python3.11/site-packages/nbdist"  # the rank's host's install
    theirs = [("<string>", 1, "<module>"), (f"{elsewhere}/rank/runtime.py", 660, "main"),
              (f"{elsewhere}/rank/runtime.py", 520, "_serve"),
              (f"{elsewhere}/rank/runtime.py", 137, "_run_cell"),
              ("<cell In[2]>", 3, "<module>"), ("/home/ann/nbdist/tests/test_x.py", 12, "step"),
              ("/home/ann/nbdist/nbdist_user.py", 7, "inner")]
    [g] = stacks.group({0: _dump(theirs)}, packages={0: elsewhere})
    assert g.summary() == "inner ← step ← <module> (cell line 3)", g.summary()
    [thread] = g.threads
    assert [f.file for f in thread.frames] == [
        "<cell In[2]>", "/home/ann/nbdist/tests/test_x.py", "/home/ann/nbdist/nbdist_user.py"]
    # Without the rank's answer, this process's own install is nbdist's: the other one is not.
    [mine] = stacks.group({0: _dump(theirs)})
    assert f"{elsewhere}/rank/runtime.py" in {f.file for t in mine.threads for f in t.frames}


def _waits_in_a_module_of_a_folder_named_nbdist(folder: str, gate: Gate) -> None:
    import importlib
    import sys

    sys.path.insert(0, folder)
    importlib.import_module("nbdist_user_waits").wait_here(gate)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dist_stacks_keeps_a_user_module_in_a_folder_named_nbdist(tmp_path: Path, gate: Gate
                                                                  ) -> None:
    """A rank waiting in a user's module that lives in a folder named ``nbdist`` shows that
    module's frames in its stacks: only where nbdist is installed makes a frame nbdist's."""
    folder = tmp_path / "nbdist"
    folder.mkdir()
    module = folder / "nbdist_user_waits.py"
    module.write_text("def wait_here(gate):\n    print('in', flush=True)\n    gate.wait()\n")
    job = nbdist.run(_waits_in_a_module_of_a_folder_named_nbdist, str(folder), gate, np=1,
                     backend="local", gpu=False)
    try:
        wait_for(lambda: job.state.ranks[0].lines >= 1, 60, "the rank to be in wait_here")
        got = job.stacks()
        assert "wait_here" in got.summary(), got.text()
        assert f'File "{module}", line 3, in wait_here' in got.text(), got.text()
    finally:
        gate.open()
        job.wait(60)


def test_native_frames_show_once_per_group() -> None:
    """py-spy's native frames of one rank stand for its group (their Python stacks are equal),
    cut after NATIVE_LINES lines."""
    from nbdist import stacks

    locked = _cell_thread(("<cell In[3]>", 5, "<module>"))
    native = "Thread 7 (idle): \"MainThread\"\n" + "\n".join(
        f"    frame_{i} (libpython3.11.so.1.0)" for i in range(stacks.NATIVE_LINES + 5))
    got = stacks.Stacks.from_dumps("j6", {0: _dump(locked), 1: _dump(locked)},
                                   native={1: native})
    text = got.text()
    assert "  native frames of rank 1 (py-spy, most recent call first):" in text
    assert text.count("native frames") == 1 and "    frame_0 (libpython3.11.so.1.0)" in text
    assert "    ... 6 more lines" in text and "frame_44" not in text


def _stuck_in_c() -> None:
    import threading

    lock = threading.Lock()
    lock.acquire()
    print("locked", flush=True)
    lock.acquire()  # for ever, in C


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stacks_carry_the_native_frames_where_py_spy_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where py-spy is installed (the dev set-up installs it), a rank stuck in C code shows its
    native frames (CPython's lock acquire); a py-spy that cannot run is said, not hidden."""
    from nbdist.rank import supervisor

    if supervisor.py_spy() is None:
        pytest.skip("py-spy is not installed here (pip install py-spy)")
    job = nbdist.run(_stuck_in_c, np=1, backend="local", gpu=False)
    try:
        wait_for(lambda: job.state.ranks[0].lines >= 1, 60, "the rank to hold its lock")
        got = job.stacks()
        assert got.native, got.text()
        assert "PyThread_acquire_lock" in got.native[0], got.native[0]
        assert "native frames of rank 0 (py-spy" in got.text()
        monkeypatch.setenv("NBDIST_PY_SPY", "/nonexistent/py-spy")
        broken = job.stacks()
        assert broken.native[0].startswith("(py-spy could not run: "), broken.native
    finally:
        job.cancel()
        job.wait(60)


def test_an_idle_session_rank_has_no_frames_of_its_own() -> None:
    """A session rank waiting for its next cell shows as no Python frame, not nbdist's loop."""
    from nbdist import stacks

    idle = [("<string>", 1, "<module>"), (RUNTIME, 660, "main"), (RUNTIME, 510, "_serve"),
            ("/usr/lib/python3.11/queue.py", 171, "get"),
            ("/usr/lib/python3.11/threading.py", 320, "wait")]
    [group] = stacks.group({0: _dump(idle), 1: _dump(idle)})
    assert group.ranks == [0, 1] and group.summary().startswith("no Python frame")


CELL_STUCK = """import os, threading, time
rank = int(os.environ["RANK"])
lock = threading.Lock()
lock.acquire()
print("ready", flush=True)
if rank == 2:
    while True:
        time.sleep(0.05)
elif rank == 1:
    import signal
    signal.signal(signal.SIGUSR2, lambda *a: None)
    print("deaf", flush=True)
    lock.acquire()
else:
    lock.acquire()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dist_stacks_shows_where_each_local_rank_is_stuck(
        ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``%dist_stacks`` on 4 local ranks: ranks stuck in a lock (C code) fold into one group
    at the cell's line, a rank sleeping in a loop is another, a rank that cannot answer is
    named with its last lines; on an ended job or an unknown one it is a usage error."""
    job = ip.run_cell_magic("distributed", "-np 4 --bg --quiet", CELL_STUCK)
    try:
        wait_for(lambda: all(r.lines >= 1 for r in job.state.ranks)
                 and job.state.ranks[1].lines >= 2, 60, "every rank at its line")
        capsys.readouterr()
        ip.run_line_magic("dist_stacks", job.id)
        shown = capsys.readouterr().out
        lines = shown.splitlines()
        assert "ranks 0, 3: <module> (cell line 16)" in lines, shown
        assert "rank 2: <module> (cell line 9)" in lines, shown
        assert any(ln.startswith("rank 1: no stack dump within") for ln in lines), shown
        assert "    deaf" in lines, shown
    finally:
        ip.run_line_magic("dist_cancel", job.id)
    with pytest.raises(UsageError, match=f"job {job.id} already ended"):
        ip.run_line_magic("dist_stacks", job.id)
    with pytest.raises(UsageError, match="no job 'j999'"):
        ip.run_line_magic("dist_stacks", "j999")


def _hung_collective() -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if int(os.environ["RANK"]) == 1:
        while True:  # never joins the collective the others wait in
            time.sleep(0.05)
    dist.all_reduce(torch.ones(4))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_timeout_takes_the_stacks_of_a_hung_collective_first() -> None:
    """When ``--timeout`` fires on a job hung in a collective, the error carries where every
    rank was (ranks in ``all_reduce`` folded, the rank that never joined on its own line), and
    so do the job's state and the panel's saved summary."""
    job = nbdist.run(_hung_collective, np=3, backend="local", timeout=20)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=100)
    err = info.value
    assert err.reason == "timeout"
    summary = [ln for ln in err.stacks.splitlines() if ln.startswith("rank")]
    assert summary[0].startswith("ranks 0, 2: all_reduce ← "), err.stacks
    assert summary[1].startswith("rank 1: _hung_collective ("), err.stacks
    assert "test_bad_hour.py" in err.stacks
    rendered = "\n".join(err._render_traceback_())
    assert "where the ranks were when nbdist stopped them" in rendered
    assert "all_reduce" in job.state.forensics
    assert "all_reduce" in status.summary_text(job.state)
    assert "all_reduce" in status.summary_html(job.state)


CELL_SESSION_STUCK = """import threading
lock = threading.Lock()
lock.acquire()
print("in", flush=True)
lock.acquire()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dist_stacks_on_a_session_cell(
        ip: Any, no_session: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``%dist_stacks`` on a session's cell shows its ranks at the cell's line, labelled with
    the cell, and a session's logs go to the folder given at its start."""
    ip.run_line_magic("dist_session", "start -np 2")
    cell = ip.run_cell_magic("distributed", "--bg --quiet", CELL_SESSION_STUCK)
    try:
        wait_for(lambda: all(r.lines >= 1 for r in cell.state.ranks), 60, "both ranks in")
        got = cell.stacks()
        assert got.job_id == cell.id
        assert got.summary() == "ranks 0, 1: <module> (cell line 6)", got.text()
    finally:
        ip.run_line_magic("dist_cancel", cell.id)
    assert cell.state.log_dir is not None
    assert "in" in Path(cell.state.log_dir, "rank-0.log").read_text().splitlines()


def _quiet_rank_1(gate: str) -> int:
    import os
    import time

    rank = int(os.environ["RANK"])
    while not os.path.exists(gate):
        if rank == 0:
            print("busy", flush=True)  # rank 0 keeps talking, rank 1 is quiet
        time.sleep(0.1)
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stacks_are_taken_once_a_rank_is_quiet_when_configured(
        ip: Any, tmp_path: Path) -> None:
    """With ``%config DistMagics.stacks_when_quiet = 1`` a rank that prints nothing for 1 s
    gets the job's stacks taken and kept in its state and ``%dist_status``; the job runs on."""
    gate = tmp_path / "gate"
    ip.run_line_magic("config", "DistMagics.stacks_when_quiet = 1.0")
    try:
        job = nbdist.run(_quiet_rank_1, str(gate), np=2, backend="local")
        wait_for(lambda: bool(job.state.forensics), 60, "the stacks of the quiet rank")
        assert job.state.forensics.startswith("rank 1 printed nothing for 1 s")
        assert "_quiet_rank_1 (" in job.state.forensics
        gate.write_text("")
        assert job.results == [0, 1]
        assert "rank 1 printed nothing for 1 s" in status.ranks_table(job.state)
        ip.run_line_magic("config", "DistMagics.stacks_when_quiet = -1")  # refused, logged
        assert settings.stacks_when_quiet == 1.0
    finally:
        ip.run_line_magic("config", "DistMagics.stacks_when_quiet = None")
    assert settings.stacks_when_quiet is None


# -- the debugger ---------------------------------------------------------------------------------
CELL_BREAKPOINT = """%%distributed -np 2 --quiet
import os
rank = int(os.environ["RANK"])
x = rank * 10
if rank == 1:
    breakpoint()
    x += 1
x
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_breakpoint_on_a_rank_is_answered_through_the_kernels_stdin() -> None:
    """``breakpoint()`` on rank 1 asks the notebook's input box (the kernel's stdin channel, as
    JupyterLab answers it) with a prompt naming the rank; the commands typed run on that rank
    and ``c`` lets the cell finish with its value."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(Path(__file__).parent.parent))
    try:
        kc.execute_interactive("%load_ext nbdist", timeout=60)
        msg_id = kc.execute(CELL_BREAKPOINT, allow_stdin=True)
        prompts, answers = [], ["p x", "n", "p x", "c"]
        out: list[str] = []
        result = None
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            try:
                req = kc.get_stdin_msg(timeout=0.05)
            except Exception:  # queue.Empty: no question now
                req = None
            if req is not None and req["msg_type"] == "input_request":
                prompts.append(req["content"]["prompt"])
                kc.input(answers[len(prompts) - 1])
            try:
                msg = kc.get_iopub_msg(timeout=0.05)
            except Exception:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "execute_result":
                result = msg["content"]["data"]["text/plain"]
            elif kind == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = "".join(out)
    assert prompts == ["[rank 1] (Pdb) "] * 4, (prompts, text)
    assert "-> x += 1" in text and "\n10\n" in text and "\n11\n" in text, text
    assert result == "0"


CELL_FAILS_ON_RANK_1 = """import os
rank = int(os.environ["RANK"])
secret = rank * 7
if rank == 1:
    raise ValueError("boom")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dist_debug_opens_a_post_mortem_on_the_failed_rank_of_a_session_cell(
        ip: Any, no_session: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """After a session cell failed on rank 1, ``%dist_debug`` opens pdb on that rank in the
    failed frame with its live variables, asking through the notebook's ``input()``; without
    a failed session cell it is a usage error."""
    with pytest.raises(UsageError, match="no failed session cell"):
        ip.run_line_magic("dist_debug", "")
    ip.run_line_magic("dist_session", "start -np 2")
    with pytest.raises(DistributedError, match="boom"):
        ip.run_cell_magic("distributed", "--quiet", CELL_FAILS_ON_RANK_1)
    with pytest.raises(UsageError, match="rank 0 did not fail"):
        ip.run_line_magic("dist_debug", "--rank 0")
    prompts: list[str] = []
    answers = iter(["p secret", "p rank", "q"])

    def typed(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", typed)
    capsys.readouterr()
    ip.run_line_magic("dist_debug", "")
    out = capsys.readouterr().out
    assert prompts == ["[rank 1] (Pdb) "] * 3, (prompts, out)
    assert "raise ValueError" in out and "\n7\n1\n" in out, out


def _breakpoint_on_rank_1() -> int:
    import os

    rank = int(os.environ["RANK"])
    if rank == 1:
        breakpoint()
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_debugger_nobody_answers_does_not_hold_the_job_past_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped in ``breakpoint()`` with nobody typing is ended by the job's timeout:
    the job fails as timed out, with the rank's stacks in the debugger, while the input box
    still waits."""
    holder: dict[str, Any] = {}

    def nobody(prompt: str = "") -> str:
        wait_for(lambda: holder["job"].done(), 60, "the job's timeout")
        return "c"

    monkeypatch.setattr("builtins.input", nobody)
    job = holder["job"] = nbdist.run(_breakpoint_on_rank_1, np=2, backend="local", timeout=8)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=90)
    assert info.value.reason == "timeout"
    stacks = info.value.stacks
    assert "rank 1: wait ← get ← cmdloop ← " in stacks and "_breakpoint_on_rank_1" in stacks


def test_the_panel_points_to_the_log_files_for_the_lines_it_does_not_show() -> None:
    """A log pane that shows only the last lines says where every line is."""
    from nbdist.views import widget

    pane = widget._log_html([("", "x")], 5, log_dir="/tmp/logs/j1")
    assert "5 earlier lines not shown here (every line is in the ranks&#x27; log files in " \
           "/tmp/logs/j1)" in pane


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_breakpoint_in_a_job_that_restarts_is_asked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that restarts (``--max-restarts``) asks its current attempt's debuggers in the
    waiting thread as a plain job does."""
    answers, prompts = iter(["p rank", "c"]), []

    def typed(prompt: str = "") -> str:
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("builtins.input", typed)
    job = nbdist.run(_breakpoint_on_rank_1, np=2, backend="local", timeout=60, max_restarts=1)
    assert job.results == [0, 1]
    assert prompts == ["[rank 1] (Pdb) "] * 2

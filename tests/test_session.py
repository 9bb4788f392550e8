"""Persistent sessions on local ranks (``%dist_session``), through a real IPython shell."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbdist import session as sessions
from nbdist.capture import capture_cell
from nbdist.errors import DistributedError, PullWarning, SessionError
from nbdist.protocol import Frame
from nbdist.rank.supervisor import RankProcess

from .helpers import GONE_WITHIN_S, Gate, rank_processes, run

pytestmark = pytest.mark.usefixtures("no_session")


@pytest.fixture
def live(ip: Any) -> Iterator[sessions.Session]:
    """A two-rank local session, stopped after the test."""
    run(ip, "%dist_session start -np -2")
    live = sessions.current()
    assert live is not None and live.alive
    yield live
    if live.alive:
        live.stop()


@pytest.mark.slow
@pytest.mark.torch
def test_state_and_process_group_persist_across_cells(ip: Any, live: sessions.Session) -> None:
    """A model and a gloo process group made in one cell are used by the next two."""
    run(ip, "%%distributed\n"
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Linear(2, 1)\n"
            "calls = 1")
    total = run(ip, "%%distributed\n"
                    "t = torch.tensor([float(dist.get_rank() + 1)])\n"
                    "dist.all_reduce(t)\n"
                    "calls += 1\n"
                    "t.item()")
    assert total == 3.0
    ranks = run(ip, "%%distributed -o per_rank\n"
                    "calls += 1\n"
                    "(dist.get_rank(), calls, tuple(model.weight.shape))")
    assert ranks == (0, 3, (1, 2))
    assert [r[0] for r in ip.user_ns["per_rank"]] == [0, 1]
    assert {"model", "calls", "dist", "torch"} <= live.defined_names()


def test_rank_names_are_not_shipped_or_shadowed(ip: Any, live: sessions.Session) -> None:
    """A name the ranks defined wins over the notebook's; notebook helpers still travel."""
    run(ip, "%%distributed\nimport os\nlr = 0.1 * (int(os.environ['RANK']) + 1)")
    run(ip, "lr = 'the notebook value'\ndef double(v):\n    return 2 * v")
    assert run(ip, "%%distributed -o values\ndouble(lr)") == pytest.approx(0.2)
    assert ip.user_ns["values"] == [pytest.approx(0.2), pytest.approx(0.4)]


def test_error_on_one_rank_keeps_the_session(ip: Any, live: sessions.Session) -> None:
    """An exception names its rank, the other rank is interrupted, the state survives."""
    run(ip, "%%distributed\nimport os\nrank = int(os.environ['RANK'])\nkept = 'yes'")
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed\n"
                "import time\n"
                "if rank == 1:\n"
                "    raise ValueError('bad batch')\n"
                "while True:\n"
                "    time.sleep(0.01)  # rank 0 would wait for rank 1 forever")
    assert "rank 1 of 2 failed: ValueError: bad batch" in str(err.value)
    assert "still running" in str(err.value)
    assert "bad batch" in err.value.failures[1]
    assert live.alive
    assert run(ip, "%%distributed -o both\nkept + str(rank)") == "yes0"
    assert ip.user_ns["both"] == ["yes0", "yes1"]


def test_interrupt_stops_the_cell_not_the_session(ip: Any, live: sessions.Session) -> None:
    """%dist_cancel interrupts a running cell with KeyboardInterrupt; variables stay."""
    run(ip, "%%distributed\nsteps = 0")
    cell = run(ip, "%%distributed --bg --quiet\n"
                   "import time\n"
                   "while True:\n"
                   "    steps += 1\n"
                   "    time.sleep(0.01)")
    from .helpers import wait_for

    wait_for(lambda: cell.state.counts().get("running") == 2, what="both ranks running")
    run(ip, f"%dist_cancel {cell.id}")
    assert cell.done() and cell.error is not None
    assert cell.error.reason == "cancelled"
    assert live.alive
    assert run(ip, "%%distributed\nsteps > 0") is True


@pytest.mark.slow
def test_rank_that_ignores_the_interrupt_ends_the_session(ip: Any, live: sessions.Session
                                                          ) -> None:
    """A rank that swallows KeyboardInterrupt is torn down within the 10 s bound."""
    cell = run(ip, "%%distributed --bg --quiet\n"
                   "import time\n"
                   "while True:\n"
                   "    try:\n"
                   "        time.sleep(0.01)\n"
                   "    except KeyboardInterrupt:\n"
                   "        pass")
    from .helpers import wait_for

    wait_for(lambda: cell.state.counts().get("running") == 2, what="both ranks running")
    started = time.monotonic()
    cell.cancel("interrupted from the notebook")
    assert cell.wait(GONE_WITHIN_S)
    assert live.wait(GONE_WITHIN_S)
    assert time.monotonic() - started < GONE_WITHIN_S
    assert live.broken is not None and "did not stop" in live.broken
    assert not rank_processes()
    with pytest.raises(sessions.SessionError, match="is broken.*%dist_session start -np 2"):
        run(ip, "%%distributed\n1")


def test_killed_rank_breaks_the_session(ip: Any, live: sessions.Session) -> None:
    """A rank killed by a signal fails the cell naming it; the next cell says how to restart."""
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed\n"
                "import os, signal, time\n"
                "if os.environ['RANK'] == '1':\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
                "time.sleep(60)")
    assert "SIGKILL" in str(err.value) or "SIGKILL" in "".join(err.value.failures.values())
    assert live.wait(GONE_WITHIN_S)
    assert live.broken is not None and "rank 1" in live.broken
    with pytest.raises(sessions.SessionError, match="broken"):
        run(ip, "%%distributed\n1")
    assert not rank_processes()


UNPRINTABLE = """%%distributed
import os
rank = int(os.environ['RANK'])
class NoStr(Exception):
    def __str__(self):
        raise RuntimeError('no str')
class NoRepr(NoStr):
    def __repr__(self):
        raise RuntimeError('no repr')
class BadNotes(Exception):
    @property
    def __notes__(self):  # read while the traceback is formatted
        raise RuntimeError('no notes')
kept = 41
"""


@pytest.mark.parametrize(("raised", "message"), [
    ("NoStr('x')", "NoStr: NoStr('x') (its __str__ raised RuntimeError)"),
    ("NoRepr()", "NoRepr: <unprintable NoRepr: its __str__ raised RuntimeError and its "
                 "__repr__ raised RuntimeError>"),
    ("BadNotes('boom')", "BadNotes: boom"),
])
def test_an_exception_that_cannot_be_printed_keeps_the_session(
    ip: Any, live: sessions.Session, raised: str, message: str, tmp_path: Path
) -> None:
    """An exception whose str, repr or traceback formatting raises fails the cell naming the
    rank and the type; the session and its variables stay."""
    run(ip, UNPRINTABLE)
    # Rank 1 raises once rank 0 is done with the cell: on a busy machine rank 0 could still
    # be running, be interrupted, and the message would say so (another test's subject).
    flag = str(tmp_path / "rank0-done")
    with pytest.raises(DistributedError) as err:
        run(ip, f"%%distributed\n"
                f"if rank == 1:\n"
                f"    while not os.path.exists({flag!r}):\n"
                f"        import time; time.sleep(0.01)\n"
                f"    raise {raised}\n"
                f"kept += 1\n"
                f"open({flag!r}, 'w').close()")
    assert str(err.value).startswith(f"rank 1 of 2 failed: {message}; session {live.id} is "
                                     f"still running")
    assert f"raise {raised}" in err.value.failures[1]  # the user's line, whatever failed
    assert live.alive
    assert run(ip, "%%distributed -o values\n(rank, kept)") == (0, 42)
    assert ip.user_ns["values"] == [(0, 42), (1, 41)]


def test_sys_exit_fails_the_cell_and_keeps_the_session(ip: Any, live: sessions.Session) -> None:
    """sys.exit(3) on a rank fails the cell once, naming the rank and the call; the session,
    like a Jupyter kernel after sys.exit in a cell, stays with its variables."""
    run(ip, "%%distributed\nimport os, sys, time\nrank = int(os.environ['RANK'])")
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed\n"
                "if rank == 1:\n"
                "    sys.exit(3)\n"
                "time.sleep(600)  # rank 0 is interrupted, as for any failing rank")
    assert str(err.value) == (f"rank 1 of 2 failed: SystemExit: called sys.exit(3) (rank 0 was "
                              f"interrupted after it); session {live.id} is still running")
    assert "sys.exit(3)" in err.value.failures[1] and "line 3" in err.value.failures[1]
    assert live.alive
    assert run(ip, "%%distributed -o ranks\nrank") == 0
    assert ip.user_ns["ranks"] == [0, 1]


@pytest.mark.parametrize("call", ["sys.exit(0)", "sys.exit()", "exit()"])
def test_a_successful_exit_ends_the_cell_on_its_rank(
    ip: Any, live: sessions.Session, call: str
) -> None:
    """sys.exit(0), sys.exit() and exit() end the cell on that rank with no value, as exit
    status 0 ends a job's rank; the session stays."""
    run(ip, "%%distributed\nimport os, sys\nrank = int(os.environ['RANK'])")
    assert run(ip, f"%%distributed -o values\nif rank == 1:\n    {call}\n'went on'") == "went on"
    assert ip.user_ns["values"] == ["went on", None]
    assert live.alive
    assert run(ip, "%%distributed\nrank + 1") == 1


def test_a_rank_that_exits_outright_breaks_the_session(ip: Any, live: sessions.Session) -> None:
    """os._exit(3) ends the rank's process: the cell fails naming the rank and the exit code,
    the session is broken with that reason, and no rank is left."""
    with pytest.raises(DistributedError) as err:
        run(ip, "%%distributed\n"
                "import os, time\n"
                "if os.environ['RANK'] == '1':\n"
                "    os._exit(3)\n"
                "time.sleep(600)")
    assert "rank 1 exited with code 3 before returning a result" in str(err.value)
    assert live.wait(GONE_WITHIN_S)
    assert live.broken == "rank 1 exited with code 3 before returning a result"
    with pytest.raises(sessions.SessionError, match="broken: rank 1 exited with code 3"):
        run(ip, "%%distributed\n1")
    assert not rank_processes()


def test_a_cell_that_closes_the_ranks_stdout_and_stderr_does_not_break_the_next(
    ip: Any, live: sessions.Session, capsys: pytest.CaptureFixture[str],
) -> None:
    """A cell that closes fds 1 and 2 (or points them elsewhere) is told they were restored,
    and the next cells print and return (before: each failed after 2 s with "Bad file
    descriptor" while the session said it was running)."""
    assert run(ip, "%%distributed\nimport os\nos.close(1)\nos.close(2)\n5") == 5
    assert "closed or replaced the rank's stdout and stderr; restored" in capsys.readouterr().out
    assert run(ip, "%%distributed\nprint('printed again', flush=True)\n6") == 6
    out = capsys.readouterr().out
    assert "[rank 0] printed again" in out and "[rank 1] printed again" in out
    run(ip, "%%distributed\nos.dup2(os.open(os.devnull, os.O_WRONLY), 1)")
    assert "the rank's stdout; restored" in capsys.readouterr().out
    assert run(ip, "%%distributed\nprint('and again', flush=True)\n7") == 7
    assert "[rank 1] and again" in capsys.readouterr().out
    assert live.alive


def test_a_cells_end_carries_each_ranks_memory(ip: Any, live: sessions.Session) -> None:
    """Once a cell is over, the session knows each rank's memory with what the cell left."""
    run(ip, "%%distributed\nblob = b'x' * (100 * 1024 * 1024)")
    assert sorted(live.rss) == [0, 1] and min(live.rss.values()) > 100e6


def test_a_local_rank_takes_the_drivers_messages_as_a_call_while_its_channel_is_up(
        ip: Any, live: sessions.Session) -> None:
    """A local session's supervisors take a message (a cell) from the notebook's thread; a
    rank the backend does not have, or whose channel closed, does not (the driver then sends
    on the event channel, and learns the rank is not connected)."""
    assert live.launcher.deliver(0, {"t": "interrupt", "id": 10**6})  # no such cell: ignored
    assert not live.launcher.deliver(live.np, {"t": "interrupt", "id": 1})
    assert run(ip, "%%distributed -o both\nimport os\n40 + int(os.environ['RANK'])") == 40
    assert ip.user_ns["both"] == [40, 41]
    live.stop()
    assert not live.launcher.deliver(0, {"t": "interrupt", "id": 1})


def test_a_large_payload_never_waits_in_the_notebook_for_ranks_that_cannot_read(
        ip: Any, live: sessions.Session) -> None:
    """A push larger than a rank's control pipe (1 MiB) leaves the notebook's thread at once
    while the ranks are stopped (before: it blocked writing into their full pipes for as long
    as they were), and arrives whole once they go on."""
    blob = bytes(range(256)) * 4096
    payload = {"kind": "push", "name": "blob", "data": capture_cell("blob", {"blob": blob}).data}
    ranks = rank_processes()
    assert ranks
    sent: list[sessions.SessionCell] = []
    done = threading.Event()

    def push() -> None:
        sent.append(live.run_cell(payload))  # type: ignore[arg-type]
        done.set()

    for p in ranks:
        p.suspend()
    try:
        threading.Thread(target=push, daemon=True).start()
        assert done.wait(30), "the notebook's thread waited for ranks that could not read"
    finally:
        for p in ranks:
            p.resume()
    sent[0].result(timeout=60)
    assert run(ip, "%%distributed -o got\nlen(blob), blob[:3]") == (1 << 20, bytes([0, 1, 2]))
    assert ip.user_ns["got"] == [(1 << 20, bytes([0, 1, 2]))] * 2
    assert live.alive


@pytest.mark.slow
def test_a_frame_stopped_half_written_closes_the_control_pipe_and_the_rank_ends() -> None:
    """An exception (the stop button's KeyboardInterrupt) while a frame to a rank's
    interpreter is half written closes its control pipe, so that it ends as without its
    supervisor (before: it waited for the rest of the frame for ever, and would have read the
    frames after it as garbage)."""

    class Stop(BaseException):
        pass

    rp = RankProcess(sys.executable, {}, None)
    os.killpg(rp.pid, signal.SIGSTOP)  # the pipe fills: the write blocks, half done
    raised = threading.Event()
    main = threading.get_ident()

    def stop(signum: int, frame: Any) -> None:
        if not raised.is_set() and frame is not None and frame.f_code.co_name == "write_frame":
            raised.set()
            raise Stop

    def poke() -> None:  # until one lands in the blocked write (the first only cuts it short)
        while not raised.wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, stop)
    poker = threading.Thread(target=poke, daemon=True)
    try:
        poker.start()
        with pytest.raises(Stop):
            rp.send(Frame.PAYLOAD, b"x" * (1 << 20))
        assert rp.ctl_in.closed
        assert not rp.send(Frame.QUIT, b"")  # nothing more goes to it
        os.killpg(rp.pid, signal.SIGCONT)
        rp.proc.wait(timeout=60)  # it saw its supervisor gone and took its group along
    finally:
        raised.set()
        poker.join()
        signal.signal(signal.SIGUSR1, old)
        try:
            os.killpg(rp.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        rp.discard()


def test_pull_and_push_round_trip(ip: Any, live: sessions.Session) -> None:
    """%dist_push sends a notebook value to every rank; %dist_pull brings one back."""
    run(ip, "weights = {'w': [1.0, 2.0]}")
    run(ip, "%dist_push weights")
    run(ip, "%%distributed\nimport os\nweights['rank'] = int(os.environ['RANK'])")
    run(ip, "%dist_pull weights --rank 1")
    assert ip.user_ns["weights"] == {"w": [1.0, 2.0], "rank": 1}
    with pytest.raises(DistributedError, match="rank 0 has no variable 'nothing'"):
        run(ip, "%dist_pull nothing")
    assert live.alive


def test_pulling_a_value_threads_of_the_rank_may_be_changing_warns(
    ip: Any, live: sessions.Session,
) -> None:
    """%dist_pull while a thread a session cell started runs on that rank warns that the value
    may mix moments, naming the thread (before: it came back torn without a word); once the
    thread is done, the pull is silent."""
    run(ip, "%%distributed\n"
            "import threading, time\n"
            "stop = threading.Event()\n"
            "x = [0] * 1000\n"
            "def churn():\n"
            "    i = 0\n"
            "    while not stop.is_set():\n"
            "        i += 1\n"
            "        x[i % 1000] = i\n"
            "        time.sleep(0.0001)\n"
            "feeder = threading.Thread(target=churn, name='churn', daemon=True)\n"
            "feeder.start()")
    with pytest.warns(PullWarning, match=r"rank 1 was running threads that the session's "
                                         r"cells started \(churn\) while x was read"):
        run(ip, "%dist_pull x --rank 1")
    assert len(ip.user_ns["x"]) == 1000
    run(ip, "%%distributed\nstop.set()\nfeeder.join()")
    run(ip, "%dist_pull x --rank 1")  # no thread left: no warning (warnings are errors here)
    assert live.alive


def test_pulling_while_a_background_cell_runs_is_refused_until_it_ends(
    ip: Any, live: sessions.Session, gate: Gate,
) -> None:
    """%dist_pull while a --bg cell of the session runs is refused, naming the cell and how to
    wait for it (never a value read mid-cell); once the cell ended, the pull has its value."""
    run(ip, "%%distributed\nx = 0")
    cell = run(ip, f"%%distributed --bg\n{gate.code()}\nx = 1")
    with pytest.raises(SessionError, match=f"still running cell {cell.id}; wait for it"):
        run(ip, "%dist_pull x")
    gate.open()
    cell.result(timeout=60)
    run(ip, "%dist_pull x")
    assert ip.user_ns["x"] == 1
    assert live.alive


def test_show_and_stop_leave_nothing_running(ip: Any) -> None:
    """%dist_session shows ranks and names; stop ends every rank; a new cell needs -np."""
    run(ip, "%dist_session start -np -2 --idle-timeout 600")
    run(ip, "%%distributed\nalpha = 1")
    report = repr(run(ip, "%dist_session"))
    assert "2 ranks on local, live" in report and "alpha" in report
    assert "idle timeout 600 s" in report
    assert len(rank_processes()) == 2
    run(ip, "%dist_session stop")
    assert not rank_processes()
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="needs -np N.*%dist_session start"):
        run(ip, "%%distributed\n1")
    assert run(ip, "%%distributed -np -1 --quiet\n41 + 1") == 42


def test_idle_timeout_warns_then_stops(ip: Any, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """After --idle-timeout without a cell, a warning is printed, then the session stops."""
    monkeypatch.setattr(sessions, "IDLE_WARNING_S", 1.0)
    run(ip, "%dist_session start -np -1 --idle-timeout 2")
    live = sessions.current()
    assert live is not None
    # 2 s idle, then the stop: generous on a loaded machine (10 s failed there once).
    assert live.wait(60)
    out = capsys.readouterr().out
    assert "will be stopped in" in out and "was idle for 2 s (--idle-timeout): stopping" in out
    assert not rank_processes()


def test_session_usage_errors(ip: Any, live: sessions.Session) -> None:
    """Options that belong to the session's start are refused on its cells, by name."""
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="--backend, --gpu, --env and --log-dir are set once"):
        run(ip, "%%distributed --env A=1\n1")
    with pytest.raises(sessions.SessionError, match="already running"):
        run(ip, "%dist_session start -np -2")
    with pytest.raises(UsageError, match="--rank 5: session .* has ranks 0 to 1"):
        run(ip, "%dist_pull x --rank 5")

"""The fault matrix on the local backend: every way a distributed job can go wrong.

Each test injects one fault into real rank processes and checks what the user gets: a clear
error naming the rank, and nothing left running (the autouse guard in tests/conftest.py fails
any test that leaves a process behind for more than 10 s). The rows shared with the Spark
backend are in ``rows.py``. Run alone with ``pytest tests/faults``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

import nbdist
from nbdist import job as jobs

from ..helpers import is_rank, rank_processes, wait_for
from . import rows

pytestmark = pytest.mark.timeout(180)


LOCAL = rows.Target("local", rank_processes)


@pytest.mark.slow
def test_exception_while_others_wait_in_a_collective() -> None:
    """Rank 1 raising while rank 0 waits in all_reduce: its traceback, and rank 0 torn down."""
    rows.exception_in_a_collective(LOCAL)


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "signal_name"), rows.SIGNALS)
def test_rank_killed_by_a_signal_in_a_collective(fault: str, signal_name: str) -> None:
    """A rank dying of SIGKILL or a segfault is named with its signal; its peer is stopped."""
    rows.killed_by_a_signal(LOCAL, fault, signal_name)


@pytest.mark.parametrize(("fault", "expected"), rows.EARLY_EXITS)
def test_rank_exits_early_without_a_result(fault: str, expected: str) -> None:
    """sys.exit(3) and os._exit(0) before the end are failures naming the rank and the code."""
    rows.exits_early(LOCAL, fault, expected)


@pytest.mark.slow
def test_hung_collective_with_timeout() -> None:
    """A deadlock (rank 1 never joins the collective) ends at --timeout naming both ranks."""
    rows.hung_collective(LOCAL, timeout=15)


@pytest.mark.parametrize("how", list(rows.LINGERING))
def test_processes_a_rank_starts_die_with_it(how: str, tmp_path: Path) -> None:
    """Children the rank leaves running (same group, own session, daemonized) are killed."""
    rows.lingering_children_die(LOCAL, how, tmp_path)


@pytest.mark.parametrize("death", list(rows.SUDDEN_DEATHS))
@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "NBDIST_ZYGOTE=0"])
@pytest.mark.fresh_pool
def test_a_child_in_its_own_session_dies_with_a_rank_that_died_at_once(
    death: str, zygote: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """os._exit, SIGKILL, segfault: the rank's setsid child is killed, its pipes let go."""
    from nbdist.launch import local

    monkeypatch.setattr(local, "ZYGOTE", zygote)
    rows.escaped_child_dies_with_its_rank(LOCAL, death, tmp_path)
    # The supervisor read the rank's pipes to their end: no pump is left waiting on them.
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.endswith("(_pump)")],
             10, "the output pumps to end")


def _hand_over_stdout(path: str) -> int:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        socket.send_fds(s, [b"x"], [1, 2])  # the rank's stdout and stderr pipes
    print("handed over", flush=True)
    return 7


def test_pipes_held_by_a_process_out_of_reach_do_not_hold_the_job(tmp_path: Path) -> None:
    """A process nbdist cannot kill (here: the test itself, given the rank's stdout and
    stderr over a Unix socket) holds the rank's pipes open after the rank ended: the
    supervisor reads on for PUMP_GRACE_S, then stops; the job ends with its result and the
    rank's output, and no pump thread is left."""
    import socket

    from nbdist.rank.supervisor import PUMP_GRACE_S

    path = str(tmp_path / "s")
    held: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen()
        job = nbdist.run(_hand_over_stdout, path, np=1, backend="local")
        conn, _ = server.accept()
        with conn:
            _, held, _, _ = socket.recv_fds(conn, 1, 2)
    try:
        assert len(held) == 2
        assert job.result(timeout=60 + PUMP_GRACE_S) == 7  # without the grace: never
        assert job.state.ranks[0].last_line == "handed over"
        wait_for(lambda: not [t for t in threading.enumerate() if t.name.endswith("(_pump)")],
                 10, "the output pumps to end")
    finally:
        for fd in held:
            os.close(fd)


def test_cancel_kills_escaped_children_too(tmp_path: Path) -> None:
    """Cancelling a job kills what its ranks started in their own sessions."""
    rows.cancel_kills_escaped_children(LOCAL, tmp_path)


def test_too_many_gpu_ranks_fail_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for more GPU ranks than GPUs is a CapacityError with the numbers, before launch."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(nbdist.CapacityError, match=r"asked for 2 ranks with one GPU each.*has 1"):
        nbdist.run(print, np=2, gpu=True)
    assert not rank_processes()


@pytest.mark.slow
def test_output_flood_keeps_driver_memory_bounded() -> None:
    """Huge lines, no newlines, invalid UTF-8 and \\r storms: the job ends, memory stays small."""
    rows.output_flood(LOCAL, mib=256)


def test_strangers_on_the_event_server_do_not_disturb_a_job(tmp_path: Path) -> None:
    """Garbage, a wrong MAC and a replayed hello are rejected while a real job runs on."""
    rows.strangers_are_rejected(LOCAL, tmp_path)


@pytest.mark.slow
def test_unreachable_event_server_still_returns_results() -> None:
    """Ranks that cannot reach the event server still meet, run and return; the loss is told."""
    rows.unreachable_event_server(LOCAL)


def test_result_that_cannot_be_unpickled_on_the_driver(tmp_path: Path) -> None:
    """A value whose class exists only on the ranks is an error naming the rank and the type."""
    rows.result_cannot_be_unpickled(LOCAL, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_interrupt_in_a_real_kernel_stops_the_ranks(tmp_path: Path) -> None:
    """The stop button (SIGINT to the kernel) cancels the job, and the next cell works."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        kc.execute_interactive("%load_ext nbdist", timeout=60)
        # stop_on_error=False: ipykernel aborts the requests that arrive while it handles a
        # cell's error (its stop_on_error), and the next cell below is sent at once, where a
        # user clicks later (a fresh clone saw it "aborted" on a fast machine).
        msg_id = kc.execute("%%distributed -np 2\nimport os, time\n"
                            f"open({str(tmp_path)!r} + '/up' + os.environ['RANK'], 'w').close()\n"
                            "time.sleep(600)", stop_on_error=False)
        wait_for(lambda: len(list(tmp_path.glob("up*"))) == 2, 120, "both ranks up")
        kernel = psutil.Process(km.provisioner.process.pid)  # type: ignore[union-attr]
        ranks = [p for p in kernel.children(recursive=True) if is_rank(p)]
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

    def live_jobs() -> set[str]:
        gc.collect()  # a job in a reference cycle is garbage, not a leak
        # type(), not isinstance(): isinstance reads __class__, which some objects warn on
        # (torch.distributed.reduce_op), and filterwarnings turns that into an error.
        return {getattr(o, "id", "") for o in gc.get_objects() if issubclass(type(o), jobs.Job)}

    def snapshot() -> dict[str, Any]:
        from nbdist.launch.local import pool

        pool.clear()  # warm interpreters are by design; the question is what accumulates
        wait_for(lambda: not rank_processes(), 10, "the last ranks to exit")
        return {
            "threads": me.num_threads(),
            "fds": me.num_fds(),
            "listening": sum(1 for c in me.net_connections("tcp") if c.status == "LISTEN"),
            # as a set: what another test of this worker left running is not this test's
            "children": {c.pid for c in me.children(recursive=True)
                         if c.status() != psutil.STATUS_ZOMBIE},
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
    earlier = live_jobs()  # not this test's to judge (IPython's Out keeps the --bg jobs returned)
    for i in range(5, 105):
        one(i)
    wait_for(lambda: not rank_processes(), 10, "the last ranks to exit")
    after = snapshot()
    new_children = sorted(after["children"] - before["children"])
    before["children"], after["children"] = len(before["children"]), len(after["children"])
    report = {k: {"before": before[k], "after": after[k]} for k in before}
    Path("test-artifacts").mkdir(exist_ok=True)
    Path("test-artifacts/soak.json").write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"soak: {report}\n")
    assert after["threads"] <= before["threads"] + 2
    assert after["fds"] <= before["fds"] + 4
    assert after["listening"] <= before["listening"]
    assert not new_children, f"processes the jobs left running: {new_children}"
    assert after["rss_mb"] - before["rss_mb"] < 50
    # The kernel keeps its last settings.history jobs (%dist_status); every older one, with its
    # state,
    # logs and values, must be freed: a reference left anywhere (the event server, a thread, a
    # view) would grow the kernel with each job, too slowly for rss to show in 100 small ones.
    leaked = sorted(live_jobs() - earlier - {j.id for j in jobs.jobs()})
    assert not leaked, f"{len(leaked)} jobs left the history but are still alive: {leaked[:5]}"


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


def test_hostile_input_leaves_the_event_server_serving(tmp_path: Path) -> None:
    """Every malformed input to the kernel's event server is closed and counted, and a job
    started after them streams its output live."""
    rows.hostile_input_then_a_live_job(LOCAL, tmp_path)


def test_a_fifo_log_file_blocks_neither_its_job_nor_the_next(tmp_path: Path) -> None:
    """A FIFO at ``rank-0.log`` is refused and said; a job after it streams live."""
    rows.fifo_log_then_a_live_job(LOCAL, tmp_path)


def test_a_job_runs_while_1000_idle_strangers_are_connected(tmp_path: Path) -> None:
    """A job's ranks get in and stream live while 1000 strangers hold idle connections; the
    strangers are all cut and counted."""
    rows.a_job_among_idle_strangers(LOCAL, tmp_path)

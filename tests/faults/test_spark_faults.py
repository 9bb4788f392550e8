"""The fault matrix on the Spark backend: the rows of ``rows.py`` on a real ``local[2]`` session,
and what only Spark has (a killed Spark task, a stage that cannot get its slots).

Every test shares the run's one Spark session (``tests/sparks.py``). After each test the Spark
variant of the leak guard checks that no rank process of this run is left anywhere, also
outside this process's tree (a rank whose Spark worker was killed is re-parented).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import job as jobs
from nbdist import state
from nbdist.rank import executor_zygote

from ..helpers import GONE_WITHIN_S, is_rank, wait_for
from ..sparks import marked_rank_processes, spark_job_ids
from . import rows

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def spark(spark_local: SparkSession, spark_mark: str) -> rows.Target:
    """The rows' target: ranks as barrier tasks of the shared ``local[2]`` session."""
    return rows.Target("spark", lambda: marked_rank_processes(spark_mark))


HANG = """
def f():
    import time
    print("up", flush=True)
    time.sleep(600)
"""


def test_exception_while_others_wait_in_a_collective(spark: rows.Target) -> None:
    """Rank 1 raising while rank 0 waits in all_reduce: its traceback, and rank 0 torn down."""
    rows.exception_in_a_collective(spark)


@pytest.mark.parametrize(("fault", "signal_name"), rows.SIGNALS)
def test_rank_killed_by_a_signal_in_a_collective(
    spark: rows.Target, fault: str, signal_name: str
) -> None:
    """A rank dying of SIGKILL or a segfault is named with its signal; its peer is stopped."""
    rows.killed_by_a_signal(spark, fault, signal_name)


@pytest.mark.parametrize(("fault", "expected"), rows.EARLY_EXITS)
def test_rank_exits_early_without_a_result(
    spark: rows.Target, fault: str, expected: str
) -> None:
    """sys.exit(3) and os._exit(0) before the end are failures naming the rank and the code."""
    rows.exits_early(spark, fault, expected)


def test_hung_collective_with_timeout(spark: rows.Target) -> None:
    """A deadlock (rank 1 never joins the collective) ends at --timeout naming both ranks."""
    rows.hung_collective(spark, timeout=10)


def test_stop_button_cancels_the_job_and_the_next_cell_works(
    ip: Any, spark: rows.Target
) -> None:
    """SIGINT to the kernel while a cell waits on Spark ranks: cancelled, ranks gone, next ok."""

    def press_stop() -> None:
        wait_for(lambda: (job := jobs.get_job()) is not None and not job.done()
                 and all(r.last_line == "up" for r in job.state.ranks), 120, "both ranks up")
        os.kill(os.getpid(), signal.SIGINT)  # what the notebook's stop button sends

    presser = threading.Thread(target=press_stop, daemon=True)
    presser.start()
    result = ip.run_cell("%%distributed -np 2 --quiet\nimport time\n"
                         "print('up', flush=True)\ntime.sleep(600)\n")
    presser.join()
    err = result.error_in_exec
    assert isinstance(err, nbdist.DistributedError), repr(err)
    assert err.reason == "cancelled" and "interrupted from the notebook" in str(err)
    rows.all_gone(spark)
    assert ip.run_cell("%%distributed -np 2 --quiet\n6 * 7\n").result == 42


@pytest.mark.parametrize("how", list(rows.LINGERING))
def test_processes_a_rank_starts_die_with_it(
    spark: rows.Target, how: str, tmp_path: Path
) -> None:
    """Children the rank leaves running (same group, own session, daemonized) are killed."""
    rows.lingering_children_die(spark, how, tmp_path)


@pytest.mark.parametrize("death", list(rows.SUDDEN_DEATHS))
def test_a_child_in_its_own_session_dies_with_a_rank_that_died_at_once(
    spark: rows.Target, death: str, tmp_path: Path
) -> None:
    """os._exit, SIGKILL, segfault: the rank's setsid child is killed with it."""
    rows.escaped_child_dies_with_its_rank(spark, death, tmp_path)


def test_cancel_kills_escaped_children_too(spark: rows.Target, tmp_path: Path) -> None:
    """Cancelling a job kills what its ranks started in their own sessions."""
    rows.cancel_kills_escaped_children(spark, tmp_path)


def _pipes(proc: psutil.Process) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            out.add(link)
    return out


def _task_worker(rank_pid: int) -> psutil.Process:
    """The Spark Python worker running a rank's task: the rank's parent for a fresh rank (its
    guardian), else (forked from the executor's zygote) the worker holding its pipes."""
    rank = psutil.Process(rank_pid)
    parent = rank.parent()
    if parent is not None and "pyspark" in " ".join(parent.cmdline()):
        return parent
    mine = _pipes(rank)
    for proc in psutil.process_iter():
        try:
            if "pyspark" in " ".join(proc.cmdline()) and proc.pid != rank_pid \
                    and _pipes(proc) & mine:
                return proc
        except (psutil.Error, OSError):
            pass
    raise AssertionError(f"no Spark worker holds the pipes of rank process {rank_pid}")


@pytest.mark.parametrize("zygote", ["fresh", "forked"])
def test_killed_spark_worker_takes_its_rank_along(
    spark: rows.Target, zygote: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGKILL to a rank's Spark Python worker fails the job and no rank process survives,
    whether the rank started fresh or was forked from the executor's zygote."""
    if zygote == "fresh":
        monkeypatch.setenv("NBDIST_ZYGOTE", "0")  # the driver's switch, read at each launch
    else:
        for _ in range(3):  # the first run leaves the executor's zygote behind
            warm = rows.job_of(spark, "def f():\n    return 1\n")
            warm.result(timeout=120)
            if all("forked" in r.marks for r in warm.state.ranks):
                break
    job = rows.job_of(spark, HANG)
    wait_for(lambda: all(r.last_line == "up" for r in job.state.ranks), 120, "ranks up")
    if zygote == "forked":
        assert all("forked" in r.marks for r in job.state.ranks)
    pids = [r.pid for r in job.state.ranks]
    assert pids[0] is not None
    worker = _task_worker(pids[0])
    worker.kill()  # what an OOM killer or a lost executor does to the task
    err = rows.failure(job)
    assert "rank 0 of 2 failed" in str(err)
    assert "Python worker exited unexpectedly" in err.failures[0]
    rows.all_gone(spark)


def test_spark_killing_the_tasks_takes_the_ranks_along(spark: rows.Target) -> None:
    """Ranks nbdist cannot tell to stop (no channel) are stopped by Spark killing their tasks."""
    job, _ = rows.misdirected_job(spark, HANG)

    def ranks_up() -> int:  # ranks: the child of its guardian (also a rank's process), or
        up = 0               # forked from the executor's zygote
        for p in spark.processes():
            try:
                parent = p.parent()
                up += parent is not None and (
                    is_rank(parent) or executor_zygote.COMMAND in " ".join(parent.cmdline()))
            except psutil.Error:
                pass
        return up

    wait_for(lambda: ranks_up() == 2, 120, "both ranks up")
    pids = [p.pid for p in spark.processes()]  # the ranks and their guardians
    job.cancel()  # reaches no supervisor: after CANCEL_GRACE_S Spark kills the tasks
    assert rows.failure(job).reason == "cancelled"
    assert [r.status for r in job.state.ranks] == [state.CANCELLED] * 2
    wait_for(lambda: not any(rows.alive(p) for p in pids), GONE_WITHIN_S, "the ranks to end")


def test_too_many_ranks_fail_before_any_spark_job(spark_local: SparkSession) -> None:
    """Three ranks on two slots are refused with the numbers, and no Spark job is submitted."""
    tracker = spark_local.sparkContext.statusTracker()
    # A job an earlier test cancelled may still be ending (Spark kills its tasks in the
    # background, slower on a busy machine): it is not this test's.
    earlier = set(tracker.getActiveJobsIds())
    before = spark_job_ids(spark_local, "nbdist-test-probe-1")
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(print, np=3)
    probe = spark_job_ids(spark_local, "nbdist-test-probe-2")
    assert probe == before + 1  # none submitted
    # and none pending (the probe itself may still be listed as active a moment after count()
    # returned: Spark's listener marks a job ended in the background)
    assert set(tracker.getActiveJobsIds()) - {probe} <= earlier
    message = str(info.value)
    assert "asked for 3 ranks" in message and "only 2 barrier tasks at once" in message
    assert "limited by CPU cores: 1 executor with 2 cores in all, spark.task.cpus=1" in message
    assert "-np 2 or fewer" in message and "-np -3 for 3 local ranks" in message


def test_unshippable_capture_is_refused_before_any_spark_job(
    ip: Any, spark_local: SparkSession
) -> None:
    """A lock the cell uses is refused before launch, naming it; no Spark job starts."""
    before = spark_job_ids(spark_local, "nbdist-test-probe-3")
    ip.run_cell("import threading\nguard = threading.Lock()\n")
    try:
        result = ip.run_cell("%%distributed -np 2\nwith guard:\n    pass\n")
    finally:
        ip.user_ns.pop("guard", None)
    assert isinstance(result.error_in_exec, nbdist.CaptureError), repr(result.error_in_exec)
    assert "a lock (_thread.lock)" in str(result.error_in_exec)
    assert "'guard'" in str(result.error_in_exec)
    assert spark_job_ids(spark_local, "nbdist-test-probe-4") == before + 1


def test_output_flood_keeps_driver_memory_bounded(spark: rows.Target) -> None:
    """Huge lines, no newlines, invalid UTF-8 and \\r storms: the job ends, memory stays small."""
    rows.output_flood(spark, mib=64)


def test_strangers_on_the_event_server_do_not_disturb_a_job(
    spark: rows.Target, tmp_path: Path
) -> None:
    """Garbage, a wrong MAC and a replayed hello are rejected while a real job runs on."""
    rows.strangers_are_rejected(spark, tmp_path)


def test_unreachable_event_server_still_returns_results(spark: rows.Target) -> None:
    """Ranks that cannot reach the event server meet through allGather, run and return."""
    rows.unreachable_event_server(spark)


def test_result_that_cannot_be_unpickled_on_the_driver(
    spark: rows.Target, tmp_path: Path
) -> None:
    """A value whose class exists only on the ranks is an error naming the rank and the type."""
    rows.result_cannot_be_unpickled(spark, tmp_path)


def test_hostile_input_leaves_the_event_server_serving(
    spark: rows.Target, tmp_path: Path
) -> None:
    """Every malformed input to the Spark jobs' event server is closed and counted, and a job
    started after them streams its output live."""
    rows.hostile_input_then_a_live_job(spark, tmp_path)


def test_a_fifo_log_file_blocks_neither_its_job_nor_the_next(
    spark: rows.Target, tmp_path: Path
) -> None:
    """A FIFO at a Spark rank's ``rank-0.log`` (written on the driver) is refused and said;
    a job after it streams live."""
    rows.fifo_log_then_a_live_job(spark, tmp_path)


def test_a_job_runs_while_1000_idle_strangers_are_connected(
    spark: rows.Target, tmp_path: Path
) -> None:
    """Spark ranks get in and stream live while 1000 strangers hold idle connections."""
    rows.a_job_among_idle_strangers(spark, tmp_path)

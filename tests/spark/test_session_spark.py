"""Persistent sessions on a real ``local[2]`` SparkSession: the ranks are one long barrier stage."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist import job as jobs
from nbdist import session as sessions
from nbdist.errors import DistributedError

from ..helpers import GONE_WITHIN_S, Gate, run, wait_for
from ..sparks import marked_rank_processes
from .test_local_session import OtherSparkJob

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("no_session")]


@pytest.fixture
def spark_session_ranks(ip: Any, spark_local: SparkSession) -> Iterator[sessions.Session]:
    """A two-rank nbdist session whose ranks are tasks of one Spark barrier stage."""
    run(ip, "%dist_session start -np 2")
    live = sessions.current()
    assert live is not None and live.launcher.name == "spark"
    yield live
    if live.alive:
        live.stop()


def test_state_persists_and_errors_keep_the_session(
    ip: Any, spark_session_ranks: sessions.Session
) -> None:
    """A process group and a model outlive their cell; an error on one rank keeps them."""
    run(ip, "%%distributed\n"
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "model = torch.nn.Linear(3, 1)\n"
            "seen = [dist.get_rank()]")
    with pytest.raises(DistributedError, match="rank 0 of 2 failed: KeyError"):
        run(ip, "%%distributed\nif dist.get_rank() == 0:\n    {}['missing']\nseen.append(1)")
    assert spark_session_ranks.alive
    total = run(ip, "%%distributed -o all_seen\n"
                    "t = torch.ones(1) * (dist.get_rank() + 1)\n"
                    "dist.all_reduce(t)\n"
                    "(t.item(), tuple(model.weight.shape))")
    assert total == (3.0, (1, 3))
    # rank 1 appended before it was interrupted or after rank 0 failed; rank 0 never did
    assert run(ip, "%%distributed\nseen") == [0]


def test_killed_rank_breaks_the_spark_session(
    ip: Any, spark_session_ranks: sessions.Session, spark_mark: str
) -> None:
    """A rank killed inside its barrier task ends the stage and marks the session broken."""
    with pytest.raises(DistributedError, match="SIGKILL|rank 1"):
        run(ip, "%%distributed\n"
                "import os, signal, time\n"
                "if os.environ['RANK'] == '1':\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
                "time.sleep(60)")
    assert spark_session_ranks.wait(GONE_WITHIN_S)
    assert spark_session_ranks.broken is not None
    with pytest.raises(sessions.SessionError, match="broken"):
        run(ip, "%%distributed\n1")
    assert not marked_rank_processes(spark_mark)


def test_other_spark_jobs_run_beside_a_session(ip: Any, spark_local: SparkSession,
                                               spark_mark: str) -> None:
    """A one-rank session holds one of two slots; the notebook's Spark jobs use the other."""
    run(ip, "%dist_session start -np 1")
    live = sessions.current()
    assert live is not None
    try:
        run(ip, "%%distributed\nimport os\nowner = os.environ['NBDIST_JOB_ID']")
        assert spark_local.range(1000).selectExpr("sum(id)").collect()[0][0] == 499500
        assert run(ip, "%%distributed\nowner") == live.id
        assert marked_rank_processes(spark_mark)
    finally:
        run(ip, "%dist_session stop")
    assert live.done() and live.broken is None
    assert not marked_rank_processes(spark_mark)
    # the stage is over: both slots are free for the next job
    assert run(ip, "%%distributed -np 2 --quiet\n7") == 7


def test_killed_kernel_takes_its_spark_session_ranks_along(spark_mark: str) -> None:
    """A kernel killed outright (SIGKILL) with a live Spark session leaves no rank behind."""
    from jupyter_client.manager import start_new_kernel

    from ..test_kernel_live import ROOT, execute

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        execute(kc, "from pyspark.sql import SparkSession\n"
                    "spark = (SparkSession.builder.master('local[2]')"
                    ".config('spark.ui.enabled', 'false').getOrCreate())\n"
                    "%load_ext nbdist", timeout=120)
        execute(kc, "%dist_session start -np 2", timeout=120)
        execute(kc, "%%distributed\nimport os\nalive = os.getpid()")
        assert len(marked_rank_processes(spark_mark)) >= 2
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    deadline = time.monotonic() + GONE_WITHIN_S
    while marked_rank_processes(spark_mark):
        assert time.monotonic() < deadline, "Spark session ranks outlived their kernel"
        time.sleep(0.05)


def test_interrupt_keeps_the_spark_session(ip: Any, spark_session_ranks: sessions.Session
                                           ) -> None:
    """%dist_cancel interrupts a cell in the Spark tasks' ranks; the next cell sees its state."""
    from ..helpers import wait_for

    run(ip, "%%distributed\nticks = 0")
    cell = run(ip, "%%distributed --bg --quiet\n"
                   "import time\n"
                   "while True:\n"
                   "    ticks += 1\n"
                   "    time.sleep(0.01)")
    wait_for(lambda: cell.state.counts().get("running") == 2, what="both ranks running")
    run(ip, f"%dist_cancel {cell.id}")
    assert cell.error is not None and "interrupted" in str(cell.error)
    assert spark_session_ranks.alive
    assert run(ip, "%%distributed -o all_ticks\nticks > 0") is True
    assert ip.user_ns["all_ticks"] == [True, True]


def test_stop_button_on_a_session_cell_spares_other_spark_jobs(
    ip: Any, spark_local: SparkSession, gate: Gate
) -> None:
    """SIGINT during a Spark session cell interrupts that cell only: a Spark job of someone
    else's, running in a background thread, finishes, and the session keeps its variables."""
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # pyspark's
    other = OtherSparkJob(spark_local, gate)
    run(ip, "%dist_session start -np 1")  # one slot of two: the other job takes the second
    live = sessions.current()
    assert live is not None and live.launcher.name == "spark"
    try:
        other.thread.start()
        wait_for(lambda: other.running_tasks() == 1, 120, "the other job's task to run")
        run(ip, "%%distributed\nticks = 0")

        def press_stop() -> None:
            wait_for(lambda: (cell := jobs.get_job()) is not None and not cell.done()
                     and cell.state.ranks[0].last_line == "up", 120, "the cell to run")
            os.kill(os.getpid(), signal.SIGINT)  # what the notebook's stop button sends

        presser = threading.Thread(target=press_stop, daemon=True)
        presser.start()
        result = ip.run_cell("%%distributed\n"
                             "import time\n"
                             "print('up', flush=True)\n"
                             "while True:\n"
                             "    ticks += 1\n"
                             "    time.sleep(0.01)\n")
        presser.join()
        err = result.error_in_exec
        assert isinstance(err, DistributedError), repr(err)
        assert err.reason == "cancelled" and "interrupted from the notebook" in str(err)
        assert live.alive
        assert other.thread.is_alive() and other.running_tasks() == 1  # untouched
        gate.open()
        other.thread.join(60)
        assert other.error is None and other.result == [42]
        assert run(ip, "%%distributed\nticks > 0") is True
    finally:
        gate.open()
        if live.alive:
            live.stop()


def test_unload_puts_pysparks_stop_button_back(ip: Any, spark_local: SparkSession) -> None:
    """%unload_ext nbdist restores pyspark's own SIGINT handler; %load_ext nbdist guards again."""
    assert run(ip, "%%distributed -np 1 --quiet\n1") == 1  # a Spark job installs the guard
    guard = signal.getsignal(signal.SIGINT)
    assert getattr(guard, "_nbdist_guard", False)
    pysparks = guard._nbdist_previous  # type: ignore[union-attr]
    assert pysparks.__module__.startswith("pyspark")
    try:
        run(ip, "%unload_ext nbdist")
        assert signal.getsignal(signal.SIGINT) is pysparks
    finally:
        run(ip, "%load_ext nbdist")
    assert run(ip, "%%distributed -np 1 --quiet\n6 * 7") == 42
    assert getattr(signal.getsignal(signal.SIGINT), "_nbdist_guard", False)

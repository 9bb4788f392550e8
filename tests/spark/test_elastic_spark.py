"""Restarts on a real standalone cluster: an executor JVM killed mid-training, the job goes on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from pyspark.sql import SparkSession

import nbdist
from nbdist import state

from ..helpers import wait_for
from ..sparks import MARK, WORKERS, Sparks
from ..test_elastic import _fails_first, trainer

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.usefixtures("no_leftover_spark_ranks")]


def _executor(host: str, mark: str) -> psutil.Process:
    """The executor JVM of this test run on ``host`` (a worker's address); other test runs on
    the machine may have their own, on the same loopback addresses."""
    found = []
    for proc in psutil.process_iter():
        try:
            cmd = proc.cmdline()
            if proc.environ().get(MARK) != mark:
                continue
        except psutil.Error:
            continue
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd and \
                cmd[cmd.index("--hostname") + 1] == host:
            found.append(proc)
    assert len(found) == 1, f"executors on {host}: {found}"
    return found[0]


def test_killed_executor_restarts_the_job_to_the_same_parameters(
    spark_cluster: SparkSession, spark_mark: str, tmp_path: Path,
) -> None:
    """Rank 1's executor JVM SIGKILLed mid-training: the job restarts on the executors there
    are (Spark starts a new one on that worker), resumes from its checkpoint and ends with the
    parameters of an uninterrupted run."""
    train = trainer()
    steps, every, stop_at = 24, 5, 13
    started = time.monotonic()
    expected = nbdist.run(train, steps, every, None, str(tmp_path / "unused"), np=4,
                          checkpoint_dir=str(tmp_path / "plain")).result(timeout=300)
    baseline = time.monotonic() - started

    ready = tmp_path / "ready"
    started = time.monotonic()
    job = nbdist.run(train, steps, every, stop_at, str(ready), np=4, max_restarts=2,
                     checkpoint_dir=str(tmp_path / "elastic"))
    wait_for(ready.exists, 300, "rank 1 to reach the step where its executor is killed")
    host = job.state.ranks[1].host
    assert host is not None
    _executor(host, spark_mark).kill()
    killed = time.monotonic()
    notes: set[str] = set()
    job.wait(timeout=400, on_tick=lambda: notes.add(job.state.note))
    after_kill = time.monotonic() - killed
    total = time.monotonic() - started
    waited = sorted(n.split(" (")[0] for n in notes if "waiting for" in n)
    print(f"figure: Spark executor kill -> completion {after_kill:.2f} s; whole restarted job "
          f"{total:.2f} s, uninterrupted {baseline:.2f} s (ratio {total / baseline:.2f}); "
          f"capacity waits seen: {waited or 'none'}; attempts: "
          f"{[(a.cause[:60], a.verdict) for a in job.attempts]}")

    got = job.result()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    first, *_, last = job.attempts
    assert f"the Spark executor on {host} was lost" in first.cause, first.cause
    assert first.verdict == "restarted (rule 'lost host')"
    assert last.cause == "done" and job.state.status == state.DONE
    texts = [line.text for line in job.state.merged]
    assert "attempt 0 from step 0" in texts and f"attempt {last.number - 1} from step 10" in texts


def test_a_bug_is_not_restarted_on_spark_unless_asked(spark_cluster: SparkSession) -> None:
    """The same exception on every rank of a barrier stage: no restart, the error names the
    rule; with restart_on_error the next stage runs, its ranks seeing
    TORCHELASTIC_RESTART_COUNT=1 and TORCHELASTIC_MAX_RESTARTS=2."""
    job = nbdist.run(_fails_first("raise"), np=4, max_restarts=2)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=300)
    message = str(info.value)
    assert job.state.backend == "spark"
    assert "attempt 1 of 3 failed and was not restarted: rule 'same exception'" in message
    assert "ValueError: the same bug on every rank" in message
    assert len(job.attempts) == 1

    job = nbdist.run(_fails_first("raise"), np=4, max_restarts=2, restart_on_error=True)
    assert job.result(timeout=300) == 1
    assert job.results == [1, 1, 1, 1]
    assert [a.verdict for a in job.attempts] == ["restarted (rule 'same exception')", ""]


def _held(ready: str) -> Any:
    """Every rank of the first attempt waits to be killed (rank 1 says so in ``ready``);
    later attempts return their restart count."""

    def f() -> int:
        import os
        import time

        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if count == 0:
            if os.environ["RANK"] == "1":
                with open(ready + ".tmp", "w") as out:
                    out.write("running")
                os.replace(ready + ".tmp", ready)
            while True:
                time.sleep(0.05)
        return count

    return f


def test_lost_worker_waits_for_its_slots_then_gives_up_or_runs(
    spark_cluster: SparkSession, sparks: Sparks, tmp_path: Path,
) -> None:
    """A worker SIGKILLed with its executor (a lost host): the restart waits, showing
    "waiting for 4 slots, 2 free" live; with a short --capacity-wait it then fails naming the
    bound and the slots, and with a longer one it runs once the worker is back."""
    cluster = sparks.cluster
    assert cluster is not None
    try:
        # 1. The slots do not come back within --capacity-wait 3: a clear failure.
        ready = tmp_path / "ready1"
        job = nbdist.run(_held(str(ready)), np=4, max_restarts=1, capacity_wait=3)
        wait_for(ready.exists, 300, "the ranks to run")
        lost = _worker_of(job.state.ranks[1].host)
        cluster.kill_worker(lost)
        with pytest.raises(nbdist.DistributedError) as info:
            job.result(timeout=300)
        message = str(info.value)
        assert f"job {job.id} could not restart" in message, message
        assert "did not have the slots for 4 ranks within 3 s (--capacity-wait)" in message
        assert "restarted (rule 'lost host')" in message, message
        assert job.state.status == state.FAILED

        # 2. The worker comes back while the restart waits: the job runs on it.
        sparks.restore_worker(lost)
        ready = tmp_path / "ready2"
        job = nbdist.run(_held(str(ready)), np=4, max_restarts=1, capacity_wait=300)
        wait_for(ready.exists, 300, "the ranks to run")
        lost = _worker_of(job.state.ranks[1].host)
        cluster.kill_worker(lost)
        wait_for(lambda: "waiting for 4 slots, 2 free" in job.state.note, 120,
                 f"the live capacity wait (note: {job.state.note!r})")
        assert "of --capacity-wait 300" in job.state.note
        sparks.restore_worker(lost)
        assert job.result(timeout=300) == 1
        assert [a.verdict for a in job.attempts][0] == "restarted (rule 'lost host')"
        assert job.state.status == state.DONE
    finally:
        for i in range(len(WORKERS)):
            sparks.restore_worker(i)  # the next tests get the whole cluster


def _worker_of(host: str | None) -> int:
    """The index in WORKERS of the worker at ``host`` (a rank's host)."""
    assert host is not None
    return [w[0] for w in WORKERS].index(host)

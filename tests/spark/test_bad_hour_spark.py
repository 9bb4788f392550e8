"""When a job on Spark ranks goes wrong: their stacks, their complete logs (issue 29)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist.errors import DistributedError

from ..helpers import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


def _stuck_in_a_lock() -> None:
    import os
    import threading

    lock = threading.Lock()
    lock.acquire()
    print(f"rank {os.environ['RANK']} waits", flush=True)
    lock.acquire()


def test_spark_ranks_give_their_stacks_and_a_complete_log(spark_local: SparkSession) -> None:
    """Spark ranks stuck in a lock answer a stacks request through their supervisors on the
    executors, folded into one group; their output is in the driver's per-rank log files."""
    job = nbdist.run(_stuck_in_a_lock, np=2, backend="spark")
    try:
        wait_for(lambda: all(r.lines >= 1 for r in job.state.ranks), 200, "both ranks waiting")
        got = job.stacks()
        assert [g.ranks for g in got.groups] == [[0, 1]], got.text()
        assert got.groups[0].summary().startswith("_stuck_in_a_lock (")
        assert "test_bad_hour_spark.py" in got.text() and not got.missing
    finally:
        job.cancel()
    with pytest.raises(DistributedError) as info:
        job.result(timeout=120)
    assert "_stuck_in_a_lock" in info.value.stacks  # the cancel took them first
    assert job.state.log_dir is not None
    for rank in (0, 1):
        log = Path(job.state.log_dir, f"rank-{rank}.log").read_text()
        assert f"rank {rank} waits\n" in log

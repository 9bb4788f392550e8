"""The flight recorder and ``%dist_check`` on Spark ranks (issue 40): the same engine as the
local backend's, through the executors' supervisors."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import check
from nbdist.errors import DistributedError

from ..test_collectives_jobs import _collective_job, _no_collective

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


def _timed_out(mode: str, env: dict[str, str] | None = None) -> DistributedError:
    job = nbdist.run(_collective_job, mode, np=2, backend="spark", timeout=40, env=env)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=240)
    assert info.value.reason == "timeout"
    return info.value


def test_a_spark_rank_that_stops_before_the_third_all_reduce_is_named(
        spark_local: SparkSession) -> None:
    """Rank 0 waits in all_reduce #3; rank 1 never entered it: said in the error."""
    message = str(_timed_out("stop"))
    assert "collectives: rank 0 waits in all_reduce #3 (4 float32, gloo) since " in message, \
        message
    assert "rank 1 never entered it (its last: all_reduce #2, completed)" in message, message


def test_a_desync_and_a_mismatch_on_spark_are_named(spark_local: SparkSession) -> None:
    """All-reduce against broadcast, and int32 against float32, at #3 are named."""
    assert "desync at #3: rank 0 calls all_reduce, rank 1 calls broadcast" \
        in str(_timed_out("desync"))
    assert "mismatch at all_reduce #3: rank 0 4 float32, rank 1 4 int32" \
        in str(_timed_out("dtype"))


def test_spark_recorder_off_and_no_collective_say_nothing(spark_local: SparkSession) -> None:
    """The recorder turned off, and a job without collectives: no collectives line."""
    assert "collectives" not in str(_timed_out("off", {"TORCH_FR_BUFFER_SIZE": "0"}))
    job = nbdist.run(_no_collective, np=2, backend="spark", timeout=30)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=240)
    assert "collectives" not in str(info.value)


def test_dist_check_on_spark_names_the_slow_rank(spark_local: SparkSession) -> None:
    """``%dist_check``'s engine on 2 Spark ranks, rank 1 made slow: named as the slowest
    (among the other problems a machine may have: little free disk, a skewed clock)."""
    got = check.run_check(2, backend="spark", env={"NBDIST_CHECK_DELAY": "1:0.3"},
                          largest=64 << 10)
    assert len(got.rows) == 2, got.text()
    slowest = [p for p in got.problems if "is the slowest" in p]
    assert len(slowest) == 1 and slowest[0].startswith("rank 1 on "), got.text()

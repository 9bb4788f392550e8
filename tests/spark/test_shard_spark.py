"""``nbdist.shard(df)`` of a real Spark DataFrame (docs/data.md): the executors export it once,
each rank reads its rows, on Spark's barrier tasks and on local ranks beside an active session,
on ``local[2]`` and on the standalone cluster (two hosts); bad DataFrames refused before launch.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist import data
from nbdist import job as jobs
from nbdist.errors import CaptureError

from ..helpers import run

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]

CELL = """%%distributed -np {np} -o parts
import os, nbdist
s = nbdist.shard(df, batch_size=1000{extra})
ids = [v for b in s for v in b.column("id").to_pylist()]
ids2 = [v for b in s for v in b.column("id").to_pylist()]   # the next epoch
(ids, ids2, len(s), os.environ.get("SPARK_LOCAL_IP") or os.uname().nodename)
"""


@pytest.fixture
def nb(ip: Any) -> Iterator[Any]:
    """The shared shell; the names a test defines are removed afterwards, and their exports."""
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]
    ip.run_cell("pass")
    gc.collect()


def _check_parts(parts: list[Any], total: int, *, equal: bool = False) -> None:
    ids = [p[0] for p in parts]
    assert [p[1] for p in parts] == ids  # a second epoch reads the same rows, in order
    flat = sorted(v for r in ids for v in r)
    if equal:
        assert len({len(r) for r in ids}) == 1 and len({p[2] for p in parts}) == 1
        assert len(set(flat)) == len(flat) and total - len(flat) < len(parts)
    else:
        assert flat == list(range(total))
    assert all(r == sorted(r) for r in ids)


def test_barrier_tasks_and_local_ranks_read_their_rows(nb: Any, spark_local: SparkSession
                                                        ) -> None:
    """On local[2] the two barrier tasks, and then two local ranks (-np -2) beside the session,
    each read a disjoint part of a Spark DataFrame, together every row once; the export is
    written once and removed with the DataFrame."""
    nb.user_ns["df"] = spark_local.range(0, 12_345, numPartitions=3).selectExpr(
        "id", "cast(id as double) * 2 as x", "concat('row', id) as name")
    run(nb, CELL.format(np=2, extra=""))
    _check_parts(nb.user_ns["parts"], 12_345)
    assert jobs.jobs()[-1].state.backend == "spark"
    (directory,) = data.exports()
    run(nb, CELL.format(np=-2, extra=", equal=True"))
    _check_parts(nb.user_ns["parts"], 12_345, equal=True)
    assert jobs.jobs()[-1].state.backend == "local"
    assert data.exports() == [directory]  # the same export, not a second one
    del nb.user_ns["df"]
    nb.run_cell("pass")
    gc.collect()
    assert not os.path.exists(directory) and data.exports() == []


def test_bad_dataframes_are_refused_before_launch(nb: Any, spark_local: SparkSession) -> None:
    """A column Arrow has no type for, an empty DataFrame, one of another SparkSession and
    fewer rows than ranks are refused before any job, naming the column or the reason."""
    started = len(jobs.jobs())
    nb.user_ns.update(
        odd=spark_local.sql("select id, interval '1' year as span from range(5)"),
        none=spark_local.range(0),
        other=spark_local.newSession().range(10),
        few=spark_local.range(1),
    )
    cases = {
        "odd": (CaptureError, "nbdist.shard(odd): column 'span' (interval year) has no Arrow "
                              "type"),
        "none": (CaptureError, "nbdist.shard(none): Spark DataFrame 'none' is empty"),
        "other": (CaptureError, "nbdist.shard(other): other belongs to another SparkSession"),
        "few": (Exception, "nbdist.shard(few): Spark DataFrame 'few' has 1 rows for 2 ranks"),
    }
    for name, (kind, says) in cases.items():
        result = nb.run_cell(f"%%distributed -np 2\nimport nbdist\nnbdist.shard({name})\n")
        error = result.error_in_exec
        assert isinstance(error, kind) and says in str(error), error
    assert len(jobs.jobs()) == started
    assert len(data.exports()) == 1  # only few's, kept while few lives: no half-made ones


def test_ranks_on_two_hosts_read_equal_shards_under_ddp(nb: Any, spark_cluster: SparkSession
                                                         ) -> None:
    """On the standalone cluster four ranks on two workers read disjoint parts of a DataFrame
    the executors exported (never collected to the driver), and with equal=True a gloo
    all_reduce per batch ends on every rank at the same step."""
    nb.user_ns["df"] = spark_cluster.range(0, 20_003, numPartitions=4).selectExpr(
        "id", "cast(id % 7 as double) as x")
    run(nb, """%%distributed -np 4 -o parts --no-gpu --timeout 200
import os, torch, torch.distributed as dist, nbdist
dist.init_process_group("gloo")
s = nbdist.shard(df, equal=True, batch_size=1000)
ids, steps = [], torch.zeros(1)
for batch in s:
    ids += batch.column("id").to_pylist()
    steps += 1
    dist.all_reduce(steps)   # every rank must take this step
dist.destroy_process_group()
(ids, ids, len(s), os.environ.get("SPARK_LOCAL_IP"))
""")
    parts = nb.user_ns["parts"]
    _check_parts(parts, 20_003, equal=True)
    assert [len(p[0]) for p in parts] == [5000] * 4
    assert len({p[3] for p in parts}) == 2

"""Several GPUs per Spark task (``spark.task.resource.gpu.amount = 2``, one task per worker, as
for node-level launch): each barrier task runs one rank per GPU of the task, on the standalone
cluster with fake GPUs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import state
from nbdist.launch import backends

from ..helpers import run, wait_for
from ..test_elastic import _fails_first
from .test_warm_executors import _until_forked

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.usefixtures("no_leftover_spark_ranks")]


def _rank_env() -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    dist.destroy_process_group()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "CUDA_VISIBLE_DEVICES", "NBDIST_GPU", "SPARK_LOCAL_IP")
    return {"sum": int(total.item()), "pid": os.getpid(), "ppid": os.getppid(),
            **{k: os.environ.get(k) for k in keys}}


def test_each_task_runs_one_rank_per_gpu_as_torchrun_would(
    ip: Any, spark_nodes: SparkSession,
) -> None:
    """-np 4 on two tasks of two GPUs: ranks 2t and 2t+1 share task t's host, LOCAL_RANK,
    LOCAL_WORLD_SIZE and CUDA_VISIBLE_DEVICES as torchrun sets them, a GPU each; later runs
    fork from the executors' zygotes, and a session runs on such ranks."""
    job = nbdist.run(_rank_env, np=4)
    envs = job.results
    assert job.gpu and job.state.status == state.DONE
    assert [e["sum"] for e in envs] == [6] * 4
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    by_host: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in envs:
        by_host[e["SPARK_LOCAL_IP"]].append(e)
    assert len(by_host) == 2
    for ranks in by_host.values():
        assert [int(e["RANK"]) // 2 for e in ranks] == [int(ranks[0]["RANK"]) // 2] * 2
        assert [e["LOCAL_RANK"] for e in ranks] == ["0", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in ranks} == {"2"}
        (visible,) = {e["CUDA_VISIBLE_DEVICES"] for e in ranks}
        assert sorted(visible.split(",")) == ["0", "1"]
        for e in ranks:
            assert visible.split(",")[int(e["LOCAL_RANK"])] == e["NBDIST_GPU"]
    (status,) = [c for b, c in backends.capacities() if b == "spark"]
    assert status.slots == 4 and "2 ranks each (one per GPU)" in status.detail, status
    forked = _until_forked(4, fn=_rank_env)
    assert len({e["ppid"] for e in forked.results}) == 2  # one zygote per executor
    run(ip, "%dist_session start -np 4")
    try:
        run(ip, "%%distributed\nimport os\nmine = os.environ['NBDIST_GPU']\n")
        assert run(ip, "%%distributed\nint(os.environ['RANK']) * 10 + int(mine)\n") in (0, 1)
    finally:
        run(ip, "%dist_session stop")


def test_np_must_be_a_multiple_of_the_gpus_per_task(spark_nodes: SparkSession) -> None:
    """-np 3 with two GPUs per task, and -np 6 on two tasks of two, are refused at once with
    the numbers and what to do."""

    def noop() -> None:
        return None

    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(noop, np=3)
    assert "-np 3 is not a multiple of 2" in str(info.value)
    assert "Use -np 2 or -np 4, or --no-gpu" in str(info.value)
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(noop, np=6)
    message = str(info.value)
    assert "asked for 6 ranks (3 barrier tasks of 2 GPUs)" in message
    assert "only 2 barrier tasks at once" in message and "Use -np 4 or fewer" in message


def _dies_on_rank_1() -> None:
    import os
    import signal

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _forever() -> None:
    import time

    while True:
        time.sleep(0.1)


def test_one_rank_of_a_task_dying_fails_the_job_and_cancel_stops_all(
    spark_nodes: SparkSession,
) -> None:
    """Rank 1 (task 0's second rank) killed: the job fails naming it and every rank is gone,
    or, with ``max_restarts``, the job restarts and ends well; a cancelled job of such tasks
    ends cancelled with every rank gone."""
    job = nbdist.run(_dies_on_rank_1, np=4)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=300)
    assert "rank 1 of 4" in str(info.value), str(info.value)
    restarted = nbdist.run(_fails_first("kill"), np=4, max_restarts=2)
    assert restarted.result(timeout=300) == 1 and len(restarted.attempts) == 2
    job = nbdist.run(_forever, np=4)
    wait_for(lambda: all(r.status == state.RUNNING for r in job.state.ranks), timeout=300)
    job.cancel()
    assert job.wait(timeout=60)
    assert job.state.status == state.CANCELLED

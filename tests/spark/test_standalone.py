"""The Spark backend on a real standalone cluster: two workers (two hosts), fake GPUs."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import state
from nbdist.rank import executor_zygote

from ..sparks import WORKERS, Sparks, spark_job_ids

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


def test_four_ranks_over_two_hosts_get_their_gpus_and_one_master(
    spark_cluster: SparkSession,
) -> None:
    """Four ranks on two workers: per-host LOCAL_RANK and GPUs, NODE_RANK by host, one master."""

    def rank_env() -> dict[str, Any]:
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total)  # the rendezvous really connects the two hosts
        dist.destroy_process_group()
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                "NBDIST_GPU", "SPARK_LOCAL_IP")
        return {"sum": int(total.item()), **{k: os.environ.get(k) for k in keys}}

    job = nbdist.run(rank_env, np=4)  # --gpu by default: the cluster has a gpu task resource
    envs = job.results
    assert job.gpu and job.state.status == state.DONE
    assert [e["sum"] for e in envs] == [0 + 1 + 2 + 3] * 4
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    by_host: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in envs:
        by_host[e["SPARK_LOCAL_IP"]].append(e)
    assert sorted(by_host) == sorted(host for host, _, _ in WORKERS)
    master = envs[0]["SPARK_LOCAL_IP"]
    assert envs[0]["MASTER_ADDR"] == master
    for host, ranks in by_host.items():
        assert sorted(e["LOCAL_RANK"] for e in ranks) == ["0", "1"]
        assert {e["LOCAL_WORLD_SIZE"] for e in ranks} == {"2"}
        assert {e["GROUP_WORLD_SIZE"] for e in ranks} == {"2"}
        assert {e["NODE_RANK"] for e in ranks} == {"0" if host == master else "1"}
        (visible,) = {e["CUDA_VISIBLE_DEVICES"] for e in ranks}  # one list per host
        assert sorted(visible.split(",")) == ["0", "1"]
        for e in ranks:  # cuda:LOCAL_RANK is the rank's own GPU, as under torchrun
            assert visible.split(",")[int(e["LOCAL_RANK"])] == e["NBDIST_GPU"]
        assert len({e["NBDIST_GPU"] for e in ranks}) == 2


def test_too_many_ranks_name_the_gpu_limit(spark_cluster: SparkSession) -> None:
    """Five ranks on four GPU slots are refused with the numbers, before any Spark job."""

    def noop() -> None:
        return None

    before = spark_job_ids(spark_cluster, "nbdist-test-probe-1")
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(noop, np=5)
    assert spark_job_ids(spark_cluster, "nbdist-test-probe-2") == before + 1
    message = str(info.value)
    assert "asked for 5 ranks" in message and "only 4 barrier tasks at once" in message
    assert "limited by GPUs: 2 executors with 4 GPUs in all" in message
    assert "spark.task.resource.gpu.amount=1" in message
    assert "the CPU cores alone would allow 6" in message


def test_dist_status_shows_the_spark_capacity(
    ip: Any, spark_cluster: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    """``%dist_status`` lists the cluster's slots and GPUs next to the local capacity."""
    ip.run_line_magic("dist_status", "")
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("capacity (spark)")]
    assert "Spark spark://127.0.0.1:" in line
    assert "2 executors, 6 cores (spark.task.cpus=1), 4 GPUs" in line
    assert "4 barrier task slots" in line


def test_dynamic_allocation_is_explained_not_waited_on(spark_cluster: SparkSession) -> None:
    """With dynamic allocation on, the refusal says why barrier stages cannot run and what to do."""

    def noop() -> None:
        return None

    conf = spark_cluster.sparkContext._conf  # the context's live configuration
    conf.set("spark.dynamicAllocation.enabled", "true")
    try:
        with pytest.raises(nbdist.CapacityError) as info:
            nbdist.run(noop, np=2)
    finally:
        conf.set("spark.dynamicAllocation.enabled", "false")
    message = str(info.value)
    assert "spark.dynamicAllocation.enabled=true" in message
    assert "cannot run barrier stages" in message and "-np -2 for 2 local ranks" in message


@pytest.mark.skipif(not executor_zygote.supported(), reason="Linux only")
def test_two_executors_on_one_machine_each_get_their_own_zygote(
    spark_cluster: SparkSession, spark_mark: str, sparks: Sparks,
) -> None:
    """The two workers share this machine's /tmp: each executor still gets its own zygote,
    named by its JVM's pid, and forks the ranks of its own tasks (none crosses executors)."""
    from .test_warm_executors import _executor_jvms, _until_forked, fresh_application, zygotes

    fresh_application(sparks, spark_mark, "standalone")
    job = _until_forked(4)
    jvms = {}  # executor JVM pid -> its host
    for proc in _executor_jvms(spark_mark):
        cmd = proc.cmdline()
        jvms[proc.pid] = cmd[cmd.index("--hostname") + 1]
    owner: dict[int, int] = {}  # zygote pid -> the executor JVM its files are named by
    for zygote in zygotes(spark_mark):
        for held in zygote.open_files():  # its lock file, held for its whole life
            name = os.path.basename(held.path)
            if name.startswith("z-") and name.endswith(".lock"):
                owner[zygote.pid] = int(name.split("-")[1])
    assert set(owner.values()) == set(jvms), (owner, jvms)
    assert len(set(jvms.values())) == len(WORKERS)
    for rank, result in zip(job.state.ranks, job.results, strict=True):
        assert jvms[owner[result["ppid"]]] == rank.host, \
            f"rank {rank.rank} on {rank.host} was forked by another executor's zygote"


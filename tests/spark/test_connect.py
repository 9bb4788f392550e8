"""The Spark backend on a Spark Connect session: a real Connect server on the standalone cluster
(two workers, fake GPUs), barrier stages through ``mapInArrow(..., barrier=True)``."""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import state
from nbdist.job import Job
from nbdist.launch import backends
from nbdist.launch import spark as spark_backend
from nbdist.protocol import CallPayload
from nbdist.rank import localcode

from ..faults.rows import Misdirected
from ..helpers import Gate, run, wait_for
from ..test_elastic import _fails_first
from .test_warm_executors import _until_forked

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.usefixtures("no_leftover_spark_ranks")]

CELL = """%%distributed -np 4 -o envs
import os
import torch, torch.distributed as dist
import nbdist_cc_helpers
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank()])
dist.all_reduce(total)
dist.destroy_process_group()
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "NBDIST_GPU", "SPARK_LOCAL_IP")
{"sum": int(total.item()), "helper": nbdist_cc_helpers.twice(total.item()),
 "file": nbdist_cc_helpers.__file__, **{k: os.environ.get(k) for k in keys}}
"""


@pytest.fixture
def nb(ip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The shell, with a module of the notebook's own on ``sys.path``."""
    (tmp_path / "nbdist_cc_helpers.py").write_text("def twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]
    sys.modules.pop("nbdist_cc_helpers", None)


def test_a_cell_on_connect_runs_over_two_hosts_with_gpus_and_local_code(
    nb: Any, spark_connect: SparkSession,
) -> None:
    """``%%distributed -np 4`` on a Connect session: one barrier stage over both workers, the
    torchrun environment and one GPU per rank by host, an all_reduce, the notebook's own
    module from the shipped copy; ``%dist_status`` counts the slots from the configuration."""
    assert spark_backend.is_connect(SparkSession.getActiveSession())
    run(nb, CELL)
    envs = nb.user_ns["envs"]
    assert [e["sum"] for e in envs] == [6] * 4 and [e["helper"] for e in envs] == [12] * 4
    assert all(e["file"].startswith(localcode.code_root()) for e in envs)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    by_host: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in envs:
        by_host[e["SPARK_LOCAL_IP"]].append(e)
    assert len(by_host) == 2
    for ranks in by_host.values():
        assert sorted(e["LOCAL_RANK"] for e in ranks) == ["0", "1"]
        (visible,) = {e["CUDA_VISIBLE_DEVICES"] for e in ranks}
        for e in ranks:
            assert visible.split(",")[int(e["LOCAL_RANK"])] == e["NBDIST_GPU"]
    (status,) = [c for b, c in backends.capacities() if b == "spark"]
    assert status.slots == 4 and status.gpus == 4, status
    assert "2 executors, 6 cores" in status.detail and "estimated from the configuration" \
        in status.detail, status.detail


def test_too_many_ranks_on_connect_fail_at_once(spark_connect: SparkSession) -> None:
    """Five ranks on four GPU slots are refused with the numbers, before any stage."""

    def noop() -> None:
        return None

    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(noop, np=5)
    message = str(info.value)
    assert "asked for 5 ranks" in message and "only 4 barrier tasks at once" in message
    assert "limited by GPUs" in message


def test_sessions_restarts_and_warm_executors_on_connect(
    nb: Any, spark_connect: SparkSession,
) -> None:
    """On Connect: later runs fork their ranks from the executors' zygotes, a session keeps
    its namespace across cells, and a job whose rank fails restarts (``max_restarts``)."""
    job = _until_forked(2)
    assert job.state.backend == "spark"
    run(nb, "%dist_session start -np 2")
    try:
        run(nb, "%%distributed\nx = 20\n")
        assert run(nb, "%%distributed\nx + 1\n") == 21
    finally:
        run(nb, "%dist_session stop")
    restarted = nbdist.run(_fails_first("kill"), np=2, max_restarts=2)  # rank 1 SIGKILLed
    assert restarted.result(timeout=300) == 1
    assert len(restarted.attempts) == 2


def test_cancel_interrupts_this_jobs_tag_only(
    spark_connect: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gate: Gate,
) -> None:
    """A cancelled job's stage is interrupted through its own tag, while another query of the
    same session, running beside it, finishes. Its ranks cannot reach the event server, so
    nbdist cannot stop them over the channel: only Spark's interrupt ends them, and the ids
    of the operations it interrupted are kept."""
    started = tmp_path / "started"

    def other_query(batches: Any) -> Any:
        for batch in batches:
            open(str(started), "w").close()
            gate.wait()
            yield batch

    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.append(
        spark_connect.range(1, numPartitions=1).mapInArrow(other_query, "id long").collect()))
    thread.start()
    wait_for(started.exists, timeout=300)
    up = str(tmp_path / "up")

    def forever() -> None:
        import os
        import time

        open(f"{up}-{os.environ['RANK']}", "w").close()
        while True:
            time.sleep(0.1)

    monkeypatch.setattr(spark_backend, "CANCEL_GRACE_S", 0.0)
    spark = spark_backend.SparkLauncher()
    launcher = Misdirected(spark)
    payload: CallPayload = {"kind": "call", "fn": forever, "args": (), "kwargs": {}}
    job = Job(payload, 2, launcher).start()
    wait_for(lambda: all(Path(f"{up}-{r}").exists() for r in range(2)), timeout=300)
    job.cancel()
    assert job.wait(timeout=120), "the ranks outlived the cancel: Spark did not interrupt them"
    assert job.state.status == state.CANCELLED
    assert [r.status for r in job.state.ranks] == [state.CANCELLED] * 2
    assert spark.interrupted, "interruptTag interrupted no operation"
    gate.open()
    thread.join(timeout=300)
    assert [tuple(r) for r in other[0]] == [(0,)], other

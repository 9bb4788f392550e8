"""The Spark backend on a real ``local[2]`` SparkSession: ranks are Spark barrier tasks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import job as jobs
from nbdist import state
from nbdist.rank import executor_zygote

from ..helpers import GONE_WITHIN_S, Gate, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]

ENV_KEYS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NBDIST_JOB_ID", "CUDA_VISIBLE_DEVICES",
)

DDP_CELL = """
import os
import psutil
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own shard
for _ in range(steps):
    x = torch.randn(16, 4, generator=data)
    loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"rank {dist.get_rank()} final loss {loss.item():.4f}")
weights = [p.detach().flatten().tolist() for p in model.parameters()]
dist.destroy_process_group()
{"env": {k: os.environ.get(k) for k in ENV_KEYS}, "weights": weights,
 "parent": " ".join(psutil.Process(os.getppid()).cmdline()),
 "grandparent": " ".join(psutil.Process(os.getppid()).parent().cmdline())}
"""


def _alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_magic_trains_ddp_on_two_spark_ranks(ip: Any, spark_local: SparkSession) -> None:
    """With a session active, ``%%distributed -np 2`` trains gloo DDP in two barrier tasks."""
    ip.user_ns.update(steps=20, ENV_KEYS=ENV_KEYS)
    value = ip.run_cell_magic("distributed", "-np 2 -o spark_ranks --quiet", DDP_CELL)
    ranks = ip.user_ns["spark_ranks"]
    job = jobs.jobs()[-1]
    assert job.state.backend == "spark" and job.state.status == state.DONE
    assert value == ranks[0]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # DDP kept the replicas identical
    # Run by Spark's Python workers (through the rank's guardian, the worker's child), or
    # forked from the executor's zygote that an earlier job's task left behind.
    assert all("pyspark.daemon" in r["grandparent"] or executor_zygote.COMMAND in r["parent"]
               for r in ranks)
    envs = [r["env"] for r in ranks]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["NBDIST_JOB_ID"] == job.id
        assert env["CUDA_VISIBLE_DEVICES"] is None  # no GPU task resource on local[2]
    assert envs[0]["MASTER_ADDR"] == job.state.ranks[0].host == "127.0.0.1"
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_RUN_ID"]) for e in envs}) == 1
    assert job.state.ranks[1].last_line.startswith("rank 1 final loss")


def _parent() -> Callable[[], int]:
    def parent() -> int:  # nested: shipped by value, the rank does not import this module
        import os

        return os.getppid()

    return parent


def test_negative_np_runs_local_ranks_even_with_spark_active(spark_local: SparkSession) -> None:
    """``-np -2`` means local ranks on the driver whatever session is active (HorovodRunner)."""
    job = nbdist.run(_parent(), np=-2)
    assert job.state.backend == "local"
    # Started by this process (or forked by its zygote), not by Spark's Python workers.
    assert {r if r == os.getpid() else psutil.Process(r).ppid() for r in job.results} == {
        os.getpid()}
    with pytest.raises(ValueError, match="-np -N means local ranks"):
        nbdist.run(_parent(), np=-2, backend="spark")


def test_a_local_master_event_server_listens_on_loopback_only(
        spark_local: SparkSession) -> None:
    """With a ``local[N]`` master every rank is on this machine: the job's event server listens
    on loopback (it listened on every interface, as for a cluster without bindAddress)."""
    job = nbdist.run(os.getpid, np=2, backend="spark")
    assert len(job.results) == 2
    assert job.address.bind == "127.0.0.1", job.address
    port = job._server.address[1]
    listening = {c.laddr.ip for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening == {"127.0.0.1"}, listening


def test_gpu_without_a_gpu_task_resource_names_the_settings(spark_local: SparkSession) -> None:
    """``--gpu`` on a session without a ``gpu`` task resource says which settings give one."""
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(_parent(), np=1, gpu=True)
    message = str(info.value)
    assert "spark.task.resource.gpu.amount is not set" in message
    assert "spark.executor.resource.gpu.amount" in message and "--no-gpu" in message


def test_failing_rank_raises_its_traceback_and_stops_the_other(
    spark_local: SparkSession,
) -> None:
    """Rank 1 raising ends the job with its traceback while rank 0 was still running."""

    def fail_on_rank_1() -> None:
        import os
        import time

        if os.environ["RANK"] == "1":
            raise ValueError("bad shard 7")
        print("rank 0 waits", flush=True)
        time.sleep(600)

    job = nbdist.run(fail_on_rank_1, np=2)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    err = info.value
    assert "rank 1 of 2 failed: ValueError: bad shard 7" in str(err)
    assert list(err.failures) == [1]
    assert 'raise ValueError("bad shard 7")' in err.failures[1]
    assert [r.status for r in job.state.ranks] == [state.CANCELLED, state.FAILED]


class OtherSparkJob:
    """Someone else's Spark job in the same session: one task that runs until a gate opens."""

    GROUP = "someone-elses-job"

    def __init__(self, session: SparkSession, gate: Gate) -> None:
        self.sc = session.sparkContext
        self.gate = gate
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        gate = self.gate

        def wait_for_gate(x: int) -> int:
            gate.wait()  # in Spark's Python worker, which imports tests.helpers as a rank does
            return x + 1

        try:
            self.sc.setJobGroup(self.GROUP, "not nbdist's", interruptOnCancel=True)
            self.result = self.sc.parallelize([41], 1).map(wait_for_gate).collect()
        except BaseException as exc:
            self.error = exc

    def running_tasks(self) -> int:
        tracker = self.sc.statusTracker()
        running = 0
        for job_id in tracker.getJobIdsForGroup(self.GROUP):
            info = tracker.getJobInfo(job_id)
            for stage_id in info.stageIds if info is not None else ():
                stage = tracker.getStageInfo(stage_id)
                running += stage.numActiveTasks if stage is not None else 0
        return running


def test_cancel_stops_only_this_job_and_every_rank(
    ip: Any, spark_local: SparkSession, gate: Gate
) -> None:
    """%dist_cancel and the stop button end nbdist's jobs; another job of the session goes on."""
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # pyspark's
    other = OtherSparkJob(spark_local, gate)
    other.thread.start()
    wait_for(lambda: other.running_tasks() == 1, 120, "the other job's task to run")

    def hang() -> None:
        import time

        print("up", flush=True)
        time.sleep(600)

    # Two ranks cannot start while the other job holds one of the two slots: the barrier stage
    # waits for slots, no supervisor is reachable, so only Spark can stop it (its job group).
    waiting = nbdist.run(hang, np=2)
    wait_for(lambda: len(spark_local.sparkContext.statusTracker().getActiveJobsIds()) == 2, 60,
             "nbdist's barrier stage to be submitted")
    ip.run_line_magic("dist_cancel", waiting.id)
    assert waiting.done()
    with pytest.raises(nbdist.DistributedError) as info:
        waiting.result()
    assert info.value.reason == "cancelled"
    assert [r.status for r in waiting.state.ranks] == [state.CANCELLED] * 2

    # One rank fits next to the other job. The stop button is a SIGINT to the kernel, where
    # pyspark's own handler would cancel every Spark job of the session.
    running = nbdist.run(hang, np=1)
    wait_for(lambda: running.state.ranks[0].last_line == "up", 120, "the rank to start")
    pid = running.state.ranks[0].pid

    pressed: list[bool] = []

    def stop_button() -> None:  # pressed once: a second press during the teardown would cut
        if not pressed:         # its wait short (the stop button pressed twice)
            pressed.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        running.wait(on_tick=stop_button)
    assert running.done() and running.error is not None
    assert getattr(running.error, "reason", None) == "cancelled"
    wait_for(lambda: not _alive(pid), GONE_WITHIN_S, "the rank process to end")

    assert other.thread.is_alive() and other.running_tasks() == 1  # untouched so far
    gate.open()
    other.thread.join(60)
    assert other.error is None and other.result == [42]


def test_executors_without_nbdist_get_a_clear_error(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """When the executors' Python cannot import nbdist, the error says so and how to fix it."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    sc = spark_local.sparkContext
    saved = sc.pythonExec
    sc.pythonExec = str(bare / "bin" / "python")  # what PYSPARK_PYTHON on the cluster sets
    # Spark's Python workers start in this checkout, where `import nbdist` would find the
    # sources through the working directory; a cluster's executors have no such luck.
    sc.environment["PYTHONSAFEPATH"] = "1"
    try:
        job = nbdist.run(_parent(), np=1)
        with pytest.raises(nbdist.DistributedError) as info:
            job.result(timeout=120)
    finally:
        sc.pythonExec = saved
        del sc.environment["PYTHONSAFEPATH"]
    message = str(info.value)
    assert "nbdist cannot be imported by the Spark executors' Python" in message
    assert str(bare / "bin" / "python") in message and "No module named 'nbdist'" in message


def test_files_shipped_with_add_py_file_are_importable_on_ranks(
    spark_local: SparkSession, tmp_path: Path
) -> None:
    """A module shipped with ``sc.addPyFile`` imports in the rank's fresh interpreter."""
    helper = tmp_path / "nbdist_shipped_helper.py"
    helper.write_text("ANSWER = 42\n")
    spark_local.sparkContext.addPyFile(str(helper))

    def use_helper() -> int:
        import nbdist_shipped_helper  # not on the driver's path: only Spark shipped it

        return int(nbdist_shipped_helper.ANSWER)

    assert nbdist.run(use_helper, np=1).result(timeout=120) == 42


def test_a_spark_context_stopped_mid_job_ends_the_job_naming_it(
    spark_local: SparkSession, gate: Gate, sparks: Any, spark_mark: str,
) -> None:
    """``spark.stop()`` while a job's ranks run: the job ends, with an error that says the
    SparkContext went, the ranks are gone, and a job on the next session runs."""
    from nbdist.errors import DistributedError

    from ..sparks import marked_rank_processes

    job = nbdist.run(gate.wait, np=2, backend="spark", timeout=240)
    try:
        wait_for(lambda: job.state.status == state.RUNNING, 120, "the ranks to run")
        spark_local.stop()
        with pytest.raises(DistributedError) as caught:
            job.result(timeout=180)
        assert "SparkContextStopped: the SparkContext was stopped while its task ran" in \
            str(caught.value), caught.value
    finally:
        gate.open()
        sparks.stop_session()  # forget the stopped session: the next test gets a new one
    wait_for(lambda: not marked_rank_processes(spark_mark), GONE_WITHIN_S * 3,
             "the ranks of the stopped session to go")
    sparks.local()
    assert nbdist.run(os.getpid, np=2, backend="spark").results

"""The Ray backend on a real two-node Ray cluster (``conftest.py``): placement over the nodes,
node-level launch, the capacity errors, cancel, a failing rank and a session, each leaving no
rank, actor or placement group behind (``no_leftover_ray``)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest

import nbdist
from nbdist import session as sessions
from nbdist import state
from nbdist.errors import CapacityError, DistributedError
from nbdist.launch import ray as ray_backend

from ..helpers import Gate, run, wait_for
from .conftest import groups_left, nodes

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


def torchrun_env() -> dict[str, str]:
    """The rank's torchrun variables, after an all-reduce over every rank (gloo)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
            "CUDA_VISIBLE_DEVICES", "NBDIST_GPU")
    return {"sum": str(int(t.item())), **{k: os.environ.get(k, "") for k in keys}}


@pytest.mark.torch
def test_ranks_are_placed_over_both_nodes_with_their_gpus(on_ray: Any) -> None:
    """An initialized Ray picks the Ray backend: 4 ranks with one logical GPU each land on
    both nodes, numbered together per node, meet at rank 0's node and all-reduce."""
    job = nbdist.run(torchrun_env, np=4, timeout=240)
    results = job.results
    assert job.launcher.name == "ray" and job.gpu
    hosts = [job.state.ranks[r].host for r in range(4)]
    assert set(hosts) == {ip for ip, _, _ in nodes()}
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3]  # PACK: a node's ranks together
    assert [r["sum"] for r in results] == ["4"] * 4
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert {r["MASTER_ADDR"] for r in results} == {hosts[0]}
    for r in results:  # each node's two GPUs, in LOCAL_RANK order; the rank's own among them
        assert sorted(r["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
        assert r["CUDA_VISIBLE_DEVICES"].split(",")[int(r["LOCAL_RANK"])] == r["NBDIST_GPU"]
    assert not groups_left()


@pytest.mark.torch
def test_node_level_launch_runs_k_ranks_per_bundle(on_ray: Any) -> None:
    """Bundles of 2 GPUs run 2 ranks each, one bundle per node: LOCAL_WORLD_SIZE 2 and
    NODE_RANK from where the bundles landed; -np 3 is refused naming the sizes."""
    ray_backend.settings.gpus_per_bundle = 2
    with pytest.raises(CapacityError, match=r"-np 3 is not a multiple of 2.*-np 2 or -np 4"):
        nbdist.run(torchrun_env, np=3, backend="ray")
    results = nbdist.run(torchrun_env, np=4, backend="ray", timeout=240).results
    assert [r["LOCAL_WORLD_SIZE"] for r in results] == ["2"] * 4
    assert [r["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r["sum"] for r in results] == ["4"] * 4


def test_too_many_ranks_are_refused_at_once_naming_the_nodes(on_ray: Any) -> None:
    """6 GPU ranks on 4 logical GPUs fail before any group is made, naming the nodes and
    --no-gpu; 3 bundles STRICT_SPREAD over 2 nodes too."""
    with pytest.raises(CapacityError, match=r"asked for 6 ranks with one GPU each.*"
                       rf"{nodes()[1][0]}.*--no-gpu") as caught:
        nbdist.run(os.getpid, np=6, backend="ray")
    assert "can hold only 4 such bundles" in str(caught.value)
    ray_backend.settings.strategy = "STRICT_SPREAD"
    with pytest.raises(CapacityError, match="placed STRICT_SPREAD.*only 2 such bundles"):
        nbdist.run(os.getpid, np=3, backend="ray", gpu=False)
    assert not groups_left()


def test_cancel_stops_the_ranks_and_leaves_no_group(on_ray: Any, gate: Gate) -> None:
    """A cancelled Ray job ends CANCELLED with its actors killed and its group removed, while
    its ranks were held running."""
    job = nbdist.run(gate.wait, np=2, backend="ray", gpu=False)
    try:
        wait_for(lambda: job.state.status == "running", 120, "the Ray ranks to run")
        assert groups_left() == [f"nbdist-{job.id}"]
        job.cancel()
        with pytest.raises(DistributedError, match="cancel"):
            job.result(timeout=120)  # the 10 s contract is bench_faults.py's to measure
        assert [r.status for r in job.state.ranks] == [state.CANCELLED] * 2
    finally:
        gate.open()
    wait_for(lambda: not groups_left(), 10, "the job's group to be removed")


def fail_on_rank_1() -> int:
    if os.environ["RANK"] == "1":
        raise KeyError("missing")
    import time

    time.sleep(120)  # stopped by the job when rank 1 fails
    return 0


def test_a_failing_rank_fails_the_job_and_stops_the_others(on_ray: Any) -> None:
    """A rank's exception fails the job naming it, with its traceback; the other rank is
    stopped and nothing of the job stays on the nodes."""
    job = nbdist.run(fail_on_rank_1, np=2, backend="ray", gpu=False)
    with pytest.raises(DistributedError, match="rank 1 of 2 failed: KeyError") as caught:
        job.result(timeout=300)
    assert list(caught.value.failures) == [1]  # rank 0 was stopped, not failed on its own
    assert "fail_on_rank_1" in caught.value.failures[1]  # the rank's own traceback
    assert job.state.ranks[0].status == state.CANCELLED  # stopped, not finished its sleep


def test_a_busy_cluster_fails_within_the_placement_wait(on_ray: Any, ip: Any,
                                                        no_session: Any) -> None:
    """A session holds the cluster's 4 GPUs between cells (its actors and group stay); a job
    that then needs 2 more fails after the placement wait naming what is free, and its group
    is removed while the session's stays."""
    run(ip, "%dist_session start -np 4 --backend ray")
    live = sessions.current()
    try:
        assert live is not None and live.launcher.name == "ray"
        run(ip, "%%distributed\nx = int(__import__('os').environ['RANK'])")
        assert run(ip, "%%distributed -o all_x\nx * 10") == 0
        assert ip.user_ns["all_x"] == [0, 10, 20, 30]
        assert len(groups_left()) == 1  # the session's, between cells
        ray_backend.settings.placement_wait = 3.0
        with pytest.raises(CapacityError, match=r"could not place 2 bundles of \{GPU: 1, "
                           r"CPU: 1\}.*within 3 s.*free now 4 CPUs and no GPU.*--no-gpu"):
            nbdist.run(os.getpid, np=2, backend="ray", gpu=True)
        assert len(groups_left()) == 1
    finally:
        if live is not None and live.alive:
            live.stop()
    wait_for(lambda: not groups_left(), 10, "the session's group to be removed")


@pytest.mark.torch
@pytest.mark.timeout(400)
def test_the_ray_notebook_runs_its_cells_on_the_cluster(on_ray: Any, monkeypatch: Any) -> None:
    """notebooks/08-ray.ipynb in a real kernel: its ray.init() joins this cluster (RAY_ADDRESS,
    no second Ray), two CPU ranks all-reduce on it and %dist_status lists its capacity."""
    from ..test_notebooks import execute

    monkeypatch.setenv("RAY_ADDRESS", on_ray.address)
    texts = execute("08-ray.ipynb")
    assert "Ray nodes: 2" in texts[0]
    assert "[rank 0] node rank 0, local rank 0, sum 3" in texts[1]
    assert "[rank 1]" in texts[1] and "sum 3" in texts[1].split("[rank 1]")[1]
    assert texts[1].rstrip().endswith("3")  # rank 0's value is the cell's result
    assert "Ray cluster: 2 nodes, 8 CPUs" in texts[2]


def test_shard_of_a_ray_dataset_gives_each_rank_its_rows(on_ray: Any, ip: Any) -> None:
    """``nbdist.shard(ds)`` of a Ray Dataset: Ray's workers write it once (Parquet), the four
    Ray ranks each read a part, every row once (equal parts with ``equal=True``), and an empty
    Dataset is refused before launch naming it."""
    import gc

    import ray

    from nbdist import data
    from nbdist.errors import CaptureError

    ip.user_ns["ds"] = ray.data.range(5_000, override_num_blocks=3).map_batches(
        lambda b: {"id": b["id"], "x": b["id"] * 2.0})
    from ray.data.expressions import col

    ip.user_ns["empty"] = ray.data.range(10).filter(expr=col("id") < 0)
    try:
        cell = ("%%distributed -np 4 --backend ray -o parts\nimport nbdist\n"
                "s = nbdist.shard(ds, batch_size=700{extra})\n"
                "[v for b in s for v in b.column('id').to_pylist()]")
        run(ip, cell.format(extra=""))
        parts = ip.user_ns["parts"]
        assert sorted(v for p in parts for v in p) == list(range(5_000))
        assert all(p for p in parts) and all(p == sorted(p) for p in parts)
        (directory,) = data.exports()
        run(ip, cell.format(extra=", equal=True"))
        parts = ip.user_ns["parts"]
        assert len({len(p) for p in parts}) == 1 and data.exports() == [directory]
        with pytest.raises(CaptureError, match="nbdist.shard\\(empty\\): Ray Dataset 'empty' "
                                               "is empty"):
            result = ip.run_cell("%%distributed -np 2 --backend ray\nimport nbdist\n"
                                 "nbdist.shard(empty)\n")
            result.raise_error()
    finally:
        for name in ("ds", "empty", "parts"):
            ip.user_ns.pop(name, None)
        ip.run_cell("pass")
        gc.collect()
    assert data.exports() == []


def _attempt(ready: str) -> Any:
    def attempt() -> str:
        import os
        import time

        count = os.environ["TORCHELASTIC_RESTART_COUNT"]
        if count == "0":  # the first attempt runs until its node goes
            with open(f"{ready}.{os.environ['RANK']}", "w"):
                pass
            time.sleep(600)
        return count

    return attempt


@pytest.mark.timeout(600)
def test_a_node_lost_during_a_job_restarts_it_once_the_cluster_can_place_it(
    on_ray: Any, tmp_path: Any
) -> None:
    """One rank per node (STRICT_SPREAD); the second node is removed while both run: its rank
    is lost with its node, the job names the node, waits while one node cannot place two
    bundles, and with ``--max-restarts 1`` runs again once a node is back."""
    from .conftest import node_args, registered

    ray_backend.settings.strategy = "STRICT_SPREAD"
    ip = nodes()[1][0]
    job = nbdist.run(_attempt(str(tmp_path / "ready")), np=2, backend="ray", gpu=False,
                     max_restarts=1, capacity_wait=400)
    back = None
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready.*"))) == 2, 180, "both ranks to run")
        (node,) = [n for n in on_ray.list_all_nodes() if n.node_ip_address == ip]
        on_ray.remove_node(node)
        wait_for(lambda: "waiting for" in (job.state.note or ""), 180,
                 "the restart to wait for a second node")
        back = on_ray.add_node(wait=False, **node_args(*nodes()[1]))
        registered(on_ray.address, back)
        assert job.result(timeout=300) == "1"
    finally:
        if back is None:  # the next tests need both nodes
            registered(on_ray.address, on_ray.add_node(wait=False, **node_args(*nodes()[1])))
    first = job.attempts[0]
    assert ip in first.cause and "lost" in first.cause, first.cause
    assert first.verdict == "restarted (rule 'lost host')", first.verdict
    assert len({job.state.ranks[r].host for r in range(2)}) == 2


def parent_and_torch() -> tuple[int, bool]:
    import os
    import sys

    return os.getppid(), "torch" in sys.modules


def test_later_runs_fork_their_ranks_from_each_nodes_zygote(on_ray: Any) -> None:
    """The first run on a node starts its rank fresh and leaves a zygote there (the executor
    zygote's rules: ``rank/executor_zygote.py``); a later run's ranks are forked from it, one
    zygote per node, with what the earlier run imported already loaded."""
    from nbdist.rank.executor_zygote import COMMAND

    from .conftest import stop_ray_zygotes

    stop_ray_zygotes()  # the earlier tests' (other environments) fill the nodes' places
    ray_backend.settings.strategy = "STRICT_SPREAD"  # one rank on each node
    for _ in range(6):  # the first run leaves them; a zygote still importing is not waited for
        job = nbdist.run(parent_and_torch, np=2, backend="ray", gpu=False, timeout=240)
        results = job.results
        if [r.start for r in job.state.ranks] == ["forked", "forked"]:
            break
    else:
        whys = [(r.start, r.start_why) for r in job.state.ranks]
        raise AssertionError(f"no run's ranks were forked: {whys}")
    parents = {p for p, _ in results}
    assert len(parents) == 2, "not one zygote per node"
    for pid in parents:
        assert COMMAND in " ".join(psutil.Process(pid).cmdline())
    assert len({job.state.ranks[r].host for r in range(2)}) == 2
    again = nbdist.run(parent_and_torch, np=2, backend="ray", gpu=False, timeout=240)
    assert {p for p, _ in again.results} == parents, "the zygotes were not used again"
    stop_ray_zygotes()


def had_then_import(name: str) -> bool:
    import importlib
    import sys

    had = name in sys.modules
    importlib.import_module(name)
    return had


def test_a_nodes_zygote_loads_what_its_ranks_imported_lazily(on_ray: Any) -> None:
    """What a rank imported as it ran (a subpackage its code does not name) is loaded in its
    node's zygote for the next runs: from the first run's
    rank, which starts the zygote, and from a forked rank, whose task hands it over as the rank
    reports it. The zygote imports it once no rank of its runs, and stops for a task that
    connects meanwhile: a run right after may not find it yet, a later one does."""
    from .conftest import stop_ray_zygotes

    def until_loaded(name: str) -> list[tuple[bool, bool]]:
        runs: list[tuple[bool, bool]] = []  # (found loaded, forked) per run
        for _ in range(8):
            job = nbdist.run(had_then_import, name, np=2, backend="ray", gpu=False,
                             timeout=240)
            results = job.results
            forked = [r.start for r in job.state.ranks] == ["forked", "forked"]
            runs.append((results == [True, True], forked))
            if runs[-1] == (True, True):
                return runs
        raise AssertionError(f"{name} was never found loaded in a forked rank: {runs}")

    stop_ray_zygotes()
    assert until_loaded("json.tool")[0] == (False, False)  # the first run starts fresh
    # A forked rank imports it first: it hands it over to the zygote.
    assert until_loaded("xmlrpc.client")[0] == (False, True)
    stop_ray_zygotes()


def parent_and_gpus() -> tuple[int, list[str], str]:
    import os

    return (os.getppid(), os.environ.get("CUDA_VISIBLE_DEVICES", "").split(","),
            os.environ["NBDIST_GPU"])


def test_ranks_of_gpu_tasks_fork_from_one_zygote_per_node(on_ray: Any) -> None:
    """Ray gives each GPU task its own ``CUDA_VISIBLE_DEVICES``, and a worker started for the
    job another ``RAY_JOB_ID`` than one started before it: a node's zygote serves them all
    (``ray_host.WORKER_VARS``, left out of its key), and each forked rank sees its node's GPUs
    as a fresh one does, its own among them."""
    from .conftest import stop_ray_zygotes

    stop_ray_zygotes()
    for _ in range(6):
        job = nbdist.run(parent_and_gpus, np=4, timeout=240)
        results = job.results
        if all(r.start == "forked" for r in job.state.ranks):
            break
    else:
        raise AssertionError(f"no run was forked: {[r.start_why for r in job.state.ranks]}")
    assert len({parent for parent, _, _ in results}) == 2, "not one zygote per node"
    for _, visible, gpu in results:
        assert sorted(visible) == ["0", "1"] and gpu in visible
    stop_ray_zygotes()


def host_pid() -> int:
    """The pid of the Ray worker running this rank's task (``ray::RankHost`` while it runs):
    a rank started fresh (no zygote) descends from it."""
    import psutil

    for proc in psutil.Process().parents():
        if proc.cmdline()[:1] == ["ray::RankHost"]:
            return proc.pid
    raise LookupError("no Ray worker above this rank")


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_a_later_job_runs_in_the_first_jobs_ray_workers(on_ray: Any, monkeypatch: Any,
                                                        gpu: bool) -> None:
    """A bundle's ranks run in a Ray task whose worker Ray keeps, idle, after the job (GPU
    tasks too: max_calls=0): the next job's task on the same bundle shape runs in the same
    worker process, not a new one, and the group is still removed after each job."""
    monkeypatch.setenv("NBDIST_ZYGOTE", "0")  # ranks started fresh: they descend from the host
    ray_backend.settings.strategy = "STRICT_SPREAD"  # one bundle on each node
    first = nbdist.run(host_pid, np=2, backend="ray", gpu=gpu, timeout=240).results
    assert not groups_left()
    workers = [psutil.Process(pid) for pid in first]
    assert all(p.is_running() for p in workers), "the first job's Ray workers went"
    again = nbdist.run(host_pid, np=2, backend="ray", gpu=gpu, timeout=240).results
    assert set(again) == set(first), "the later job's tasks ran in new Ray workers"
    assert len(set(first)) == 2


def ignore_term_then_wait(gate: Gate, where: str) -> None:
    import os
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the supervisor needs its SIGKILL grace
    with open(f"{where}.{os.environ['RANK']}", "w") as f:
        f.write(str(host_pid()))
    gate.wait()


def test_a_task_past_its_cancel_grace_is_force_cancelled(on_ray: Any, monkeypatch: Any,
                                                         gate: Gate, tmp_path: Any) -> None:
    """A cancel whose supervisors cannot stop their ranks within the grace (ranks ignoring
    SIGTERM, a grace of 0) force-cancels the tasks: the job ends CANCELLED, Ray kills the
    tasks' workers, and no rank or group is left."""
    monkeypatch.setenv("NBDIST_ZYGOTE", "0")
    monkeypatch.setattr(ray_backend, "CANCEL_GRACE_S", 0.0)
    job = nbdist.run(ignore_term_then_wait, gate, str(tmp_path / "host"), np=2,
                     backend="ray", gpu=False)
    try:
        # A rank creates its file before it writes its pid: wait for both pids, not the files.
        wait_for(lambda: [p.read_text().strip().isdigit() for p in tmp_path.glob("host.*")]
                 == [True, True], 120, "the Ray ranks to run")
        workers = [int(p.read_text()) for p in sorted(tmp_path.glob("host.*"))]
        job.cancel()
        with pytest.raises(DistributedError, match="cancel"):
            job.result(timeout=60)
        launcher = job.launcher
        assert isinstance(launcher, ray_backend.RayLauncher) and launcher._killed, (
            "the tasks were not force-cancelled")
    finally:
        gate.open()

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(lambda: all(gone(pid) for pid in workers), 30, "Ray to kill the tasks' workers")
    wait_for(lambda: not groups_left(), 10, "the job's group to be removed")

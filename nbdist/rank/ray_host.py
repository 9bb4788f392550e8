"""A Ray task's side of a job: one task per bundle of the job's placement group runs the
bundle's ranks, each under the same supervisor that local ranks and Spark barrier tasks use
(``rank/supervisor.py``), with the GPUs Ray gave the task and its node's address. The task is
submitted by the kernel's Ray backend (``launch/ray.py``) as :data:`TASK_NAME`; Ray imports
this module by name on the node, so nbdist must be installed there.

The task's process is one of Ray's pooled workers: it stays, idle, when the task returns, and
a later job of the same driver runs its task there again (no new worker process to start, and
the same environment, so the same node zygote). So nothing here may leave state behind in the
worker: no change to ``os.environ``, no CUDA, no thread that outlives :func:`host_ranks`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from nbdist.protocol import LaunchRequest, RankOutcome, RankStatus

#: The task's name in Ray (its worker's process title while it runs: ``ray::RankHost``).
TASK_NAME = "RankHost"
#: What Ray sets differently in its worker processes (``RankSpec.volatile``): a worker started
#: before the job has ``RAY_JOB_ID`` ffffffff and ``PYTHONIOENCODING``, one started for the job
#: (after Ray reaped idle ones) has the job's id and not the other; a GPU task's
#: ``CUDA_VISIBLE_DEVICES`` lists its own GPUs (the rank's are set by the rendezvous anyway).
#: A node's zygote serves ranks of every worker; each rank has its own task's values.
WORKER_VARS = ("RAY_JOB_ID", "PYTHONIOENCODING", "CUDA_VISIBLE_DEVICES")


def where() -> dict[str, Any]:
    """The node's address and id, the GPUs Ray assigned this task and the worker's pid."""
    import ray

    host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    node = ray.get_runtime_context().get_node_id()
    # As the driver names the node (``RayLauncher``): a lost node's ranks are found by it.
    return {"host": host, "node": f"{host} ({node[:12]})",
            "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}


def host_ranks(ranks: list[int], request: dict[str, Any], version: str,
               warm: tuple[str, str, float] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """The task of one bundle: run ``ranks`` (one per GPU of the task with ``--gpu``, in the
    order Ray lists them), side by side, to their end; their outcomes as plain fields
    (``RankOutcome.fields``) in the order given. ``warm``: the Ray job's id, secret and idle
    time, for the node's zygote (``rank/executor_zygote.py``)."""
    scheduled = time.time()
    from nbdist._version import __version__

    if __version__ != version:
        return _all_failed(ranks, "ImportError", (
            f"the notebook has nbdist {version} but the Ray node's Python "
            f"({sys.executable}) has nbdist {__version__}: install the same "
            f"version on both"))
    launch = LaunchRequest(**request)
    here = where()
    gpus: list[str] = here["gpus"] if launch.gpu else []
    if launch.gpu and len(gpus) < len(ranks):
        return _all_failed(ranks, "LaunchError", (
            f"the Ray task of ranks {ranks} was given {len(gpus)} GPUs ({gpus}) for "
            f"{len(ranks)} ranks"))
    from nbdist.rank.task import side_by_side

    return side_by_side(ranks, lambda j, rank: run_rank(
        launch, rank, here["host"], here["node"], (gpus[j],) if gpus else (), scheduled, warm),
        "nbdist-ray-rank")


def run_rank(launch: LaunchRequest, rank: int, host: str, node: str, gpus: tuple[str, ...],
             scheduled: float, warm: tuple[str, str, float] | None = None) -> dict[str, Any]:
    """One rank under the shared supervisor, forked from the node's zygote where there is one
    (as on a Spark executor: ``rank/task.py``); its outcome's plain fields. The ranks need the
    event channel (no fallback rendezvous): Ray offers no barrier to meet through."""
    from nbdist.rank.supervisor import RankSpec
    from nbdist.rank.task import supervise

    spec = RankSpec.for_rank(launch, rank, env=worker_pythonpath(), host=host, gpus=gpus,
                             python=sys.executable, executor=node, scheduled=scheduled,
                             volatile=WORKER_VARS)
    # The worker stays after the task, but Ray kills its children when it goes (a cancel,
    # Ray's idle-worker reaping, ray.shutdown()): the zygote it leaves must be on its own.
    return supervise(spec, warm, launch.modules, settle=True).fields()


def worker_pythonpath() -> dict[str, str]:
    """PYTHONPATH for the rank: what the Ray worker imports from besides its installation
    (the driver's directories Ray put on its ``sys.path``, a ``runtime_env`` working
    directory), which a fresh interpreter would not see otherwise."""
    from nbdist.rank.host import installation_dirs, is_installed

    dirs = installation_dirs()
    keep = [entry for entry in sys.path
            if entry and os.path.isdir(entry) and not is_installed(entry, dirs)]
    old = os.environ.get("PYTHONPATH", "")
    paths = list(dict.fromkeys([*keep, *(p for p in old.split(os.pathsep) if p)]))
    return {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}


def _all_failed(ranks: list[int], kind: str, message: str) -> list[tuple[int, dict[str, Any]]]:
    return [(r, RankOutcome(r, RankStatus.FAILED, error={
        "type": kind, "traceback": "", "message": message}).fields()) for r in ranks]

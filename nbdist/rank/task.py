"""A Spark barrier task's side of a rank: on the executor, work out the rank's host, GPUs and
Python path from ``BarrierTaskContext``, then hand over to the same supervisor that local ranks
use (``rank/supervisor.py``), forking the rank from the executor's zygote when there is one
(``rank/executor_zygote.py``). The closure that calls :func:`run_task` is built by the
kernel's Spark backend (``launch/spark.py``) and pickled by value.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from nbdist.protocol import HelloEvent, LaunchRequest, RankOutcome, RankStatus


def run_task(
    ctx: Any, rank: int, request: Mapping[str, Any], version: str, *, scheduled: float = 0.0,
    warm: tuple[str, str, float] | None = None, task: int | None = None,
    gpus: tuple[str, ...] | None = None, gather_ok: bool = True,
) -> dict[str, Any]:
    """Run one rank inside its barrier task with the shared supervisor; its outcome as plain
    fields (``RankOutcome.fields``).

    ``request``: the job's ``LaunchRequest`` as its plain fields (``LaunchRequest.fields``),
    rebuilt here once this executor's nbdist is known to be the notebook's ``version``. With
    ``warm`` (the application's id, secret and idle time) the rank is forked from the
    executor's zygote when there is one, and a rank started fresh leaves one behind for the
    next tasks (``executor_zygote.py``). ``task`` is the barrier task's partition when it is
    not the rank (a task of several ranks: :func:`run_ranks`), ``gpus`` the rank's own GPUs
    among the task's, and ``gather_ok`` whether the fallback rendezvous (one ``allGather`` per
    task) may stand for the event channel."""
    import json

    from nbdist._version import __version__
    from nbdist.rank.supervisor import RankSpec

    if __version__ != version:
        return {"status": RankStatus.FAILED.value, "error": {
            "type": "ImportError", "traceback": "",
            "message": f"the notebook has nbdist {version} but the Spark executors' Python "
            f"({sys.executable}) has nbdist {__version__}: install the same version on "
            f"both",
        }}
    launch = LaunchRequest(**request)
    index = rank if task is None else task
    if gpus is None:
        resources = ctx.resources()
        gpus = tuple(str(a) for a in resources["gpu"].addresses) \
            if launch.gpu and "gpu" in resources else ()
    spec = RankSpec.for_rank(
        launch, rank, env=_worker_pythonpath(), host=_task_host(ctx, index), gpus=gpus,
        python=sys.executable, executor=_executor_host(ctx, index), scheduled=scheduled,
    )

    def gather(hello: HelloEvent) -> list[HelloEvent]:
        # Only when the event server is out of reach: about a second, and every task takes
        # part (they all fail to reach the same driver address).
        return [json.loads(h) for h in ctx.allGather(json.dumps(hello))]

    return supervise(spec, warm, launch.modules, gather if gather_ok else None).fields()


def supervise(spec: Any, warm: tuple[str, str, float] | None, modules: tuple[str, ...],
              gather: Callable[[HelloEvent], list[HelloEvent]] | None = None,
              settle: bool = False) -> RankOutcome:
    """Run one rank under its supervisor, forked from this host's executor zygote where there
    is one (``warm``: the application's id, secret and idle time; a rank started fresh leaves
    a zygote behind, on its own before this returns with ``settle``); its outcome, also when
    nbdist itself fails. A Spark task's and a Ray actor's rank alike."""
    from nbdist.rank.supervisor import Supervisor

    zygote = executor_zygote(spec, warm, modules)
    sup = Supervisor(spec, take=zygote_take(zygote, warm is not None, lambda: sup),
                     gather=gather)
    if zygote is not None:
        sup.on_mark, sup.on_modules = zygote.on_mark, zygote.report
    try:
        outcome = sup.run()
        if zygote is not None:
            zygote.leave_behind(sup.modules, settle)
    except Exception as exc:  # a bug in nbdist must still end the rank with an outcome
        outcome = RankOutcome(spec.rank, RankStatus.FAILED, error={
            "type": type(exc).__name__, "traceback": traceback.format_exc(),
            "message": f"nbdist's supervisor of rank {spec.rank} failed: {exc!r}",
        })
    return outcome


def run_ranks(ctx: Any, task: int, per_task: int, run: Callable[..., dict[str, Any]]
              ) -> list[tuple[int, dict[str, Any]]]:
    """A barrier task of ``per_task`` ranks (``spark.task.resource.gpu.amount = k``): ranks
    ``task * k`` to ``task * k + k - 1``, each with one of the task's GPUs, in the order Spark
    lists them, under supervisors of their own, side by side; their outcomes, by rank.

    ``run(rank, gpus)`` runs one rank (:func:`run_task` with the job's arguments bound). The
    fallback rendezvous (``allGather``) takes one call per task, so these ranks need the event
    channel: the caller binds ``gather_ok=False``.
    """

    resources = ctx.resources()
    addresses = [str(a) for a in resources["gpu"].addresses] if "gpu" in resources else []
    ranks = [task * per_task + j for j in range(per_task)]
    if len(addresses) < per_task:
        message = (f"barrier task {task} was given {len(addresses)} GPUs ({addresses}) for its "
                   f"{per_task} ranks (spark.task.resource.gpu.amount={per_task})")
        return [(r, {"status": RankStatus.FAILED, "error": {
            "type": "LaunchError", "traceback": "", "message": message}}) for r in ranks]
    return side_by_side(ranks, lambda j, rank: run(rank, (addresses[j],)), "nbdist-task-rank")


def side_by_side(ranks: list[int], run: Callable[[int, int], dict[str, Any]],
                 name: str) -> list[tuple[int, dict[str, Any]]]:
    """``run(j, rank)`` for each of ``ranks`` on a thread of its own (a Spark task's or a Ray
    task's ranks); their outcomes' plain fields, by rank, in the order given. A supervisor
    that raises still gives its rank an outcome: FAILED, saying so."""
    import threading
    import traceback

    outcomes: dict[int, dict[str, Any]] = {}

    def one(j: int, rank: int) -> None:
        try:
            outcomes[rank] = run(j, rank)
        except BaseException as exc:  # every rank must end with an outcome
            outcomes[rank] = {"status": RankStatus.FAILED, "error": {
                "type": type(exc).__name__, "traceback": traceback.format_exc(),
                "message": f"nbdist's supervisor of rank {rank} failed: {exc!r}"}}

    threads = [threading.Thread(target=one, args=(j, r), name=f"{name}-{r}", daemon=True)
               for j, r in enumerate(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [(r, outcomes[r]) for r in ranks]


def executor_zygote(spec: Any, warm: tuple[str, str, float] | None,
                    modules: tuple[str, ...]) -> Any:
    """The task's (or Ray actor's) handle on its executor's zygote, already connecting; None
    when off."""
    if warm is None:
        return None
    from nbdist.rank.executor_zygote import ExecutorZygote, supported

    if not supported():
        return None
    zygote = ExecutorZygote(*warm, spec=spec)
    zygote.connect(modules)
    return zygote


def zygote_take(zygote: Any, wanted: bool, sup: Callable[[], Any]) -> Callable[[Any], Any]:
    """The supervisor's ``take``: a rank forked from the executor's zygote, with its marks; or
    why not (``wanted``: the driver asked for zygotes)."""
    from nbdist import timeline
    from nbdist.rank.supervisor import Taken

    def take(spec: Any) -> Any:
        if zygote is None and not wanted:
            return Taken(None, why="zygotes are off (NBDIST_ZYGOTE=0 or NBDIST_WARM_POOL=0 in "
                         "the notebook)")
        if zygote is None:
            return Taken(None, why="this executor cannot keep a zygote (it needs Linux 5.3 or "
                         "later: pidfd_open)")
        # torch's TCPStore client backs off about half a second when rank 0's store is not
        # listening yet: where rank 0 runs on this host too, its fork comes first.
        rp = zygote.take(spec, rank0_here=sup().world().get("MASTER_ADDR") == spec.host)
        if rp is None:
            return Taken(None, why=zygote.why or "the executor's zygote did not fork the rank")
        sup().mark(timeline.ZYGOTE, zygote.ready_at)
        sup().mark(timeline.FORKED, zygote.forked_at)
        return Taken(rp, "forked")

    return take


def _task_host(ctx: Any, rank: int) -> str:
    """This executor's address as the other ranks should use it (MASTER_ADDR, host grouping).

    ``SPARK_LOCAL_IP`` when the cluster sets it (the address Spark itself was told to use on
    this machine), else the executor's address as the driver sees it (what TorchDistributor
    uses for MASTER_ADDR).
    """
    local_ip = os.environ.get("SPARK_LOCAL_IP", "")
    if local_ip and local_ip not in ("0.0.0.0", "::"):
        return local_ip
    return _executor_host(ctx, rank)


def _executor_host(ctx: Any, rank: int) -> str:
    """The host of this task's executor as the driver knows it (Spark's own messages use it)."""
    address = str(ctx.getTaskInfos()[rank].address)
    return address.rsplit(":", 1)[0].strip("[]")


def _worker_pythonpath() -> dict[str, str]:
    """PYTHONPATH for the rank: what the Python worker imports from besides its installation.

    Files shipped with ``addPyFile`` or ``--py-files`` are put on the worker's ``sys.path`` at
    run time, not in its environment; the rank's fresh interpreter would not see them.
    """
    from nbdist.rank.host import installation_dirs, is_installed

    dirs = installation_dirs()
    keep = [
        entry for entry in sys.path
        if entry and os.path.exists(entry) and not is_installed(entry, dirs)
    ]
    old = os.environ.get("PYTHONPATH", "")
    paths = list(dict.fromkeys([*keep, *(p for p in old.split(os.pathsep) if p)]))
    return {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}

"""The Ray backend: a placement group is the gang, a task per bundle runs its ranks.

The driver side (:class:`RayLauncher`) reserves one placement group for the job, all of it or
nothing (Ray's gang scheduling): one bundle of one GPU (and a CPU) per rank with ``--gpu``, one
bundle of a CPU per rank without, or, for node-level launch (``ray_gpus_per_bundle = k``),
bundles of k GPUs that run k ranks each. A group that cannot be placed within
``placement_wait`` seconds is removed and the job fails with a :class:`CapacityError` naming
what is missing. Then one Ray task per bundle (``rank/ray_host.py``), scheduled into its bundle,
runs the bundle's ranks under the same supervisor as local ranks and Spark barrier tasks: the
rendezvous and the live output go over nbdist's own event channel, ranks on one node are
numbered together (LOCAL_RANK, NODE_RANK from where the bundles landed), and each rank gets the
GPUs Ray assigned its task.

Why tasks, not actors: a task runs in one of Ray's pooled worker processes, which Ray keeps,
idle, once the task returns (``max_calls=0``: Ray would otherwise end a GPU task's worker after
each call), and gives to the next task of this driver. A later job's tasks so start in warm
workers, in the same environment (so the node's zygote is theirs), where an actor's worker
goes with the actor and each job waited for Ray to start new ones (seconds: ``import ray``).
What stays between jobs is only that: idle workers hold no resources, the group is the job's.

Stopping: the job tells every supervisor to stop its rank; tasks that have not returned after
``CANCEL_GRACE_S`` are force-cancelled (``ray.cancel(force=True)``: Ray kills their workers,
and the ranks with them). Whatever way the job ends, its group is removed: nothing of the job
stays on any node. A task whose worker or node died fails its ranks as a lost host, which
``--max-restarts`` restarts (``max_retries=0``: Ray never runs a bundle's ranks again itself).

Ray is imported lazily: this module is only imported when Ray is used.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbdist import events, launch
from nbdist._version import __version__
from nbdist.errors import CapacityError
from nbdist.launch import Capacity, gpus_text, no_gpu_hint
from nbdist.protocol import DriverEvent, LaunchRequest, RankOutcome, RankStatus

#: After a cancel, how long the supervisors get to stop their ranks and return (which keeps
#: every rank's outcome) before the tasks are force-cancelled; within the contract's 10 s.
CANCEL_GRACE_S = 4.0
#: Ray's placement strategies (``ray_strategy``).
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
INSTALL_HINT = "pip install 'nbdist[ray]'"


@dataclass
class RaySettings:
    """How Ray jobs are placed (``%config DistMagics.ray_<name>``; None: the environment
    variable ``NBDIST_RAY_<NAME>``, then the default)."""

    #: Node-level launch with ``--gpu``: bundles of k GPUs, k ranks each (1: a bundle a rank).
    gpus_per_bundle: int | None = None
    #: Ray's placement strategy for the job's bundles: PACK (default), SPREAD, STRICT_PACK,
    #: STRICT_SPREAD.
    strategy: str | None = None
    #: Seconds a job waits for its placement group before it fails (default 30).
    placement_wait: float | None = None
    #: CPUs each rank reserves in its bundle (default 1).
    cpus_per_rank: float | None = None


settings = RaySettings()
_DEFAULTS = {"gpus_per_bundle": "1", "strategy": "PACK", "placement_wait": "30",
             "cpus_per_rank": "1"}


def setting(name: str) -> str:
    value = getattr(settings, name)
    if value is not None and value != "":
        return str(value)
    return os.environ.get(f"NBDIST_RAY_{name.upper()}", "").strip() or _DEFAULTS[name]


def placement() -> tuple[int, str, float, float]:
    """(GPUs per bundle, strategy, placement wait, CPUs per rank), checked: a ValueError
    naming the setting when one is wrong."""
    try:
        k = int(setting("gpus_per_bundle"))
        wait = float(setting("placement_wait"))
        cpus = float(setting("cpus_per_rank"))
    except ValueError as exc:
        raise ValueError(f"a Ray setting is not a number ({exc}): see "
                         f"%config DistMagics (ray_gpus_per_bundle, ray_placement_wait, "
                         f"ray_cpus_per_rank)") from None
    strategy = setting("strategy").upper()
    if k < 1:
        raise ValueError(f"ray_gpus_per_bundle must be 1 or more, not {k}")
    if not wait > 0:
        raise ValueError(f"ray_placement_wait must be a positive number of seconds, not {wait}")
    if cpus < 0:
        raise ValueError(f"ray_cpus_per_rank must be 0 or more, not {cpus}")
    if strategy not in STRATEGIES:
        raise ValueError(f"ray_strategy must be one of {', '.join(STRATEGIES)}, not "
                         f"{strategy!r}")
    return k, strategy, wait, cpus


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            f"the Ray backend needs Ray: {INSTALL_HINT} (or run local ranks with "
            f"--backend local)") from None
    return ray


def is_active() -> bool:
    """Whether this kernel has an initialized Ray (never imports Ray to find out)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized())
    except Exception:  # a half-imported or broken Ray: not one to run on
        return False


def _client_mode(ray: Any) -> bool:
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())  # type: ignore[no-untyped-call]
    except Exception:  # a Ray without the client module
        return False


CLIENT_REFUSAL = (
    "the Ray backend cannot run through Ray Client (a ray:// address): the ranks run on the "
    "cluster and must reach this notebook's event server (live output, the rendezvous, "
    "cancel), which a notebook outside the cluster's network does not offer. Run the "
    "notebook on the cluster's network (its head node, a KubeRay Jupyter pod, Ray on Spark) "
    "and connect with ray.init(address='auto') or ray.init('HOST:6379'), or use "
    "--backend local"
)


def connected_ray() -> Any:
    """Ray, initialized in this kernel as a driver; else a clear error saying what to do."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address.startswith("ray://"):
        raise ValueError(f"{CLIENT_REFUSAL} (RAY_ADDRESS={address})")
    ray = import_ray()
    if _client_mode(ray):
        raise ValueError(CLIENT_REFUSAL)
    if not ray.is_initialized():
        raise ValueError(
            "the Ray backend (--backend ray) needs a connected Ray and there is none: call "
            "ray.init() first (ray.init(address='auto') on a cluster's node), or run local "
            "ranks with --backend local")
    return ray


@dataclass(frozen=True)
class NodeInfo:
    """One alive node of the cluster, as Ray lists it."""

    id: str
    host: str
    cpus: float
    gpus: float


def nodes(ray: Any) -> list[NodeInfo]:
    return [NodeInfo(str(n["NodeID"]), str(n.get("NodeManagerAddress", "?")),
                     float(n.get("Resources", {}).get("CPU", 0)),
                     float(n.get("Resources", {}).get("GPU", 0)))
            for n in ray.nodes() if n.get("Alive")]


def bundle_shape(gpu: bool, k: int, cpus: float) -> dict[str, float]:
    """One bundle: k ranks with a GPU each, or one CPU rank."""
    if gpu:
        shape = {"GPU": float(k)}
        if cpus:
            shape["CPU"] = cpus * k
        return shape
    return {"CPU": cpus} if cpus else {"CPU": 0.001}


def fits(node: NodeInfo, shape: dict[str, float]) -> int:
    """How many bundles of ``shape`` a node holds when nothing else runs there."""
    have = {"CPU": node.cpus, "GPU": node.gpus}
    return min(math.floor(have.get(r, 0.0) / n + 1e-9) for r, n in shape.items() if n > 0)


def _shape_text(shape: dict[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {n:g}" for r, n in shape.items()) + "}"


_task: Any = None
_task_lock = threading.Lock()


def host_task(ray: Any) -> Any:
    """The remote function of a bundle's ranks (``rank/ray_host.py``), made once: Ray
    exports it again by itself for each Ray job. ``max_calls=0``: the worker is kept for the
    next job (Ray's default for a GPU task is 1, a worker per call; the task never touches
    CUDA itself, its ranks are processes of their own); ``max_retries=0``: a lost worker is
    a lost host for ``--max-restarts``, never a silent second run of the ranks."""
    global _task
    with _task_lock:
        if _task is None:
            from nbdist.rank.ray_host import host_ranks

            _task = ray.remote(max_calls=0, max_retries=0)(host_ranks)
        return _task


class RayLauncher:
    """Ranks as the tasks of one placement group; see the module docstring."""

    name = "ray"
    remote = True

    def __init__(self) -> None:
        self._ray = connected_ray()
        self._lock = threading.Lock()
        self._pg: Any = None
        self._tasks: list[Any] = []  # the refs of the tasks that have not returned
        self._cancelled = False
        self._killed = False  # the tasks were force-cancelled by us: their ranks were cancelled
        self._finished = threading.Event()
        self._released = False

    # -- where and how much -----------------------------------------------------------------
    def driver_address(self) -> events.DriverAddress:
        """Listen on this node's address as Ray knows it (the one the other nodes reach it
        at), and tell the ranks that; or the configured address and port (NAT)."""
        host, host_from = launch.setting("driver_host")
        node_ip = str(self._ray.util.get_node_ip_address())
        if not host:
            host, host_from = node_ip, "this node's address in the Ray cluster"
        port_text, port_from = launch.setting("driver_port")
        try:
            port = int(port_text or 0)
        except ValueError:
            raise ValueError(f"{port_from} must be a port number, not {port_text!r}") from None
        if not 0 <= port <= 65535:
            raise ValueError(f"{port_from} must be a port number (1-65535, or 0 for any), "
                             f"not {port}")
        # A configured address may be a forwarder's, not this machine's: listen everywhere.
        bind = "" if host_from != "this node's address in the Ray cluster" else node_ip
        source = (f"on {events.interface_text(bind)}"
                  f"{f', port {port} ({port_from})' if port else ''}, advertised as {host} "
                  f"({host_from})")
        return events.DriverAddress(bind, host, port, source)

    def capacity(self) -> Capacity:
        k, _, _, cpus = placement()
        total = self._ray.cluster_resources()
        free = self._ray.available_resources()
        alive = nodes(self._ray)
        gpus = int(total.get("GPU", 0))
        slots = int(total.get("CPU", 0) // cpus) if cpus else len(alive) * 64
        detail = (
            f"Ray cluster: {len(alive)} node{'s' if len(alive) != 1 else ''}, "
            f"{total.get('CPU', 0):g} CPUs ({free.get('CPU', 0):g} free), "
            f"{gpus_text(gpus)} ({free.get('GPU', 0):g} free) (ray.cluster_resources(), "
            f"ray.available_resources())"
            + (f", {k} ranks per bundle of {k} GPUs" if k > 1 else ""))
        return Capacity(slots=max(slots, 0), gpus=gpus, detail=detail)

    def ranks_per_bundle(self, gpu: bool) -> int:
        return placement()[0] if gpu else 1

    def check(self, np: int, gpu: bool) -> None:
        """Refuse at once what this cluster could not place even when idle: the numbers and
        the nodes. What is busy now is waited for, within ``placement_wait`` (``start``)."""
        k, strategy, _, cpus = placement()
        k = k if gpu else 1
        if np % k:
            below = np // k * k
            sizes = f"-np {below} or -np {below + k}" if below else f"-np {k}"
            raise CapacityError(
                f"-np {np} is not a multiple of {k}: each Ray bundle has {k} GPUs "
                f"(ray_gpus_per_bundle={k}) and runs {k} ranks, one per GPU. Use {sizes}, or "
                f"--no-gpu for one CPU rank per bundle.")
        shape = bundle_shape(gpu, k, cpus)
        alive = nodes(self._ray)
        per_node = [fits(n, shape) for n in alive]
        bundles = np // k
        placeable = (sum(1 for f in per_node if f) if strategy == "STRICT_SPREAD"
                     else max(per_node, default=0) if strategy == "STRICT_PACK"
                     else sum(per_node))
        if placeable >= bundles:
            return
        listed = "; ".join(f"{n.host} ({n.id[:8]}): {n.cpus:g} CPUs, {gpus_text(int(n.gpus))}"
                           for n in alive) or "no node alive"
        total_gpus = sum(n.gpus for n in alive)
        hint = (f" Or {no_gpu_hint(np)}." if gpu and total_gpus < np else "")
        what = (f"{np} ranks with one GPU each" if gpu and k == 1 else
                f"{np} ranks ({bundles} bundles of {k} GPUs)" if gpu else f"{np} CPU ranks")
        raise CapacityError(
            f"asked for {what}: {bundles} bundle{'s' if bundles != 1 else ''} of "
            f"{_shape_text(shape)} placed {strategy}, but this Ray cluster can hold only "
            f"{placeable} such bundle{'s' if placeable != 1 else ''} (nodes: {listed}), and "
            f"all must run together. Use -np {placeable * k or k} or fewer, add nodes, or "
            f"-np -{np} for {np} local ranks on this machine.{hint}")

    # -- running ----------------------------------------------------------------------------
    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group

        k, strategy, wait, cpus = placement()
        k = k if request.gpu else 1
        shape = bundle_shape(request.gpu, k, cpus)
        bundles = request.np // k
        pg = placement_group([dict(shape) for _ in range(bundles)], strategy=strategy,
                             name=f"nbdist-{request.job_id}")
        with self._lock:
            self._pg = pg
        _live.add(self)
        if not pg.wait(wait):
            free = ray.available_resources()
            self._release()
            raise CapacityError(
                f"Ray could not place {bundles} bundle{'s' if bundles != 1 else ''} of "
                f"{_shape_text(shape)} ({strategy}) for {request.np} ranks within {wait:g} s "
                f"(ray_placement_wait): free now {free.get('CPU', 0):g} CPUs and "
                f"{gpus_text(int(free.get('GPU', 0)))} (ray.available_resources()); the rest "
                f"is held by other jobs, sessions or actors. The placement group was removed. "
                f"Stop what holds them (%dist_session stop), wait, or use fewer ranks"
                + (f"; or {no_gpu_hint(request.np)}" if request.gpu else "") + ".")
        try:
            order, hosts = self._bundle_order(pg, bundles)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from nbdist.rank.ray_host import TASK_NAME

            task = host_task(ray)
            fields, warm = request.fields(), self._warmth()
            refs: dict[Any, tuple[list[int], str]] = {}
            for position, bundle in enumerate(order):
                ranks = list(range(position * k, position * k + k))
                ref = task.options(
                    num_cpus=shape.get("CPU", 0), num_gpus=shape.get("GPU", 0),
                    name=TASK_NAME, scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=bundle),
                ).remote(ranks, fields, __version__, warm)
                with self._lock:
                    self._tasks.append(ref)
                refs[ref] = (ranks, hosts[bundle])
        except BaseException:  # nothing of a job that did not start is left on the nodes
            self._release()
            raise
        threading.Thread(target=self._collect, args=(refs, on_outcome),
                         name=f"nbdist-ray-{request.job_id}", daemon=True).start()
        with self._lock:
            cancelled = self._cancelled
        if cancelled:  # cancelled while the group was being placed
            self._cancelled = False
            self.cancel()

    def _warmth(self) -> tuple[str, str, float] | None:
        """What the tasks need for their nodes' zygotes (``launch.warmth``, as on Spark's
        executors), for this Ray job."""
        return launch.warmth("ray-" + str(self._ray.get_runtime_context().get_job_id()))

    def _bundle_order(self, pg: Any, bundles: int) -> tuple[list[int], dict[int, str]]:
        """The bundles in rank order, those of one node together (nodes in the order of their
        first bundle), and each bundle's node as ``host (node id)``: what a rank's ``lost_host``
        names, and its hello's ``executor`` (``rank/ray_host.py``) too."""
        from ray.util.placement_group import placement_group_table

        placed = placement_group_table(pg).get("bundles_to_node_id", {})
        by_id = {n.id: n.host for n in nodes(self._ray)}
        node_of = {b: str(placed.get(b, "")) for b in range(bundles)}
        first: dict[str, int] = {}
        for b in range(bundles):
            first.setdefault(node_of[b], b)
        order = sorted(range(bundles), key=lambda b: (first[node_of[b]], b))
        return order, {b: f"{by_id.get(node_of[b], '?')} ({node_of[b][:12]})"
                       for b in range(bundles)}

    def _collect(self, refs: dict[Any, tuple[list[int], str]],
                 on_outcome: Callable[[RankOutcome], None]) -> None:
        ray = self._ray
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                with self._lock:
                    self._tasks = [ref for ref in self._tasks if ref not in done]
                if not pending:  # the job ends with these outcomes: nothing of it stays after
                    self._finished.set()
                    self._release()
                for ref in done:
                    ranks, node = refs[ref]
                    try:
                        rows = ray.get(ref)
                    except Exception as exc:  # its worker died: its node, a kill, a cancel
                        for rank in ranks:
                            on_outcome(self._lost(rank, node, exc))
                        continue
                    for rank, fields in rows:
                        on_outcome(RankOutcome.from_fields(rank, fields))
        finally:
            self._finished.set()
            self._release()

    def _lost(self, rank: int, node: str, error: BaseException) -> RankOutcome:
        """The outcome of a rank whose task ended without returning."""
        if self._killed:
            return RankOutcome(rank, RankStatus.CANCELLED)
        first = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {first[0] if first else ''}"[:1000]
        return RankOutcome(rank, RankStatus.FAILED, lost_host=node, error={
            "type": "RayWorkerDied",
            "message": f"its Ray task's worker on node {node} died: {cause}",
            "traceback": f"rank {rank}'s Ray task's worker on node {node} died: {cause}\n",
        })

    def deliver(self, rank: int, event: DriverEvent) -> bool:
        return False  # the supervisors run in the tasks: the event channel it is

    def cancel(self) -> None:
        """Stop the ranks: the supervisors first (the job has told them), then the tasks."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            started = self._pg is not None
        if started:
            threading.Thread(target=self._kill_late, name="nbdist-ray-cancel",
                             daemon=True).start()

    def _kill_late(self) -> None:
        if self._finished.wait(CANCEL_GRACE_S):
            return
        self._killed = True
        self._release()

    def _release(self) -> None:
        """Force-cancel the job's tasks that have not returned and remove its placement group
        (idempotent). A task that returned left its worker idle in Ray's pool: kept."""
        with self._lock:
            tasks, self._tasks = self._tasks, []
            pg, self._pg = self._pg, None
        for ref in tasks:
            try:
                self._ray.cancel(ref, force=True)
            except Exception:  # returned already, or Ray is shut down
                pass
        if pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:  # Ray is shut down: the group went with it
                pass
        _live.discard(self)

    @property
    def placement_group(self) -> Any:
        """The job's placement group while it holds one (None before and after)."""
        return self._pg


#: Launchers holding a group now: released at ``%unload_ext`` and at the kernel's exit.
_live: set[RayLauncher] = set()


def shutdown() -> None:
    """``%unload_ext nbdist`` and the kernel's end: every job's tasks and groups go."""
    for launcher in list(_live):
        launcher._killed = True
        launcher._release()


atexit.register(shutdown)


"""The Spark backend: one barrier task per rank, each handing over to the rank supervisor.

The driver side (:class:`SparkLauncher`) checks that the cluster can run the ranks at once,
submits one barrier stage from a thread of its own under a job group of its own, and turns the
stage's ``collect()`` into one :class:`~nbdist.rank.supervisor.RankOutcome` per rank. The task side
(:func:`run_task`) works out the rank, its host and its GPUs from ``BarrierTaskContext``
(``partitionId()``, ``getTaskInfos()`` and ``resources()`` cost nothing) and calls the same
supervisor as the local backend. Ports and host grouping are agreed over nbdist's own event
channel, not with ``barrier()``/``allGather()``, which cost about a second each; only when the
executors cannot reach the driver's event server do the ranks fall back to one ``allGather``
of their hellos, run without live output, and return their results through ``collect()``.

Stopping: the job tells every supervisor to stop its rank, and only tasks that have not ended
after ``CANCEL_GRACE_S`` are cancelled through this job's Spark job group. When a task's Python
worker dies however it happens (Spark kills it, an executor is lost), its rank sees its control
pipe close and kills its own process group (``rank/runtime.py``).

A Spark Connect session (no SparkContext) runs the same tasks through the DataFrame API:
``spark.range(N, numPartitions=N).mapInArrow(task, schema, barrier=True)``, each task's outcome
pickled into its one row; cancelled through this job's tag (``addTag``/``interruptTag``), and
counted from the server's configuration (:func:`read_connect_cluster`), which is all Connect
exposes.

pyspark is imported lazily: this module is only imported when Spark is used, and the task side
runs inside Spark's Python workers.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from nbdist import channel, events, launch
from nbdist._version import __version__
from nbdist.errors import CapacityError
from nbdist.launch import Capacity, gpus_text
from nbdist.protocol import DriverEvent, LaunchRequest, RankOutcome, RankStatus

#: Executors register a moment after a session starts: in a session younger than
#: ``YOUNG_SESSION_S``, ``check`` and ``capacity`` wait up to ``EXECUTOR_WAIT_S`` for enough
#: slots before counting what there is. An older session's count is taken as it stands.
EXECUTOR_WAIT_S = 5.0
YOUNG_SESSION_S = 120.0
#: After a cancel, how long the supervisors get to stop their ranks and end their tasks (which
#: keeps every rank's outcome, e.g. the failed rank's traceback) before Spark kills the tasks.
#: The supervisors' SIGKILL comes after ``rank.TERM_GRACE_S`` (2 s), Spark's kill of a task's
#: Python worker within about 4 s more: both inside the 10 s the contract allows.
CANCEL_GRACE_S = 4.0
#: Spark Connect: how often a running stage checks that its server still takes connections,
#: and how many refusals in a row mean it is gone. pyspark's client retries a lost server for
#: minutes (its retry policy), during which the stage's ``collect()`` neither ends nor fails:
#: the ranks are gone with the server's executors, and the job would wait for ever.
SERVER_PROBE_S = 1.0
SERVER_PROBES = 3
#: After a cancel (a timeout, the stop button), how long the stage's own end is waited for
#: beyond ``CANCEL_GRACE_S`` before its ranks are given up as lost with the backend (a Connect
#: server that answers no more, an interrupt that hangs): the job's bounded grace.
GIVE_UP_S = 10.0

#: One secret per Spark application: its executors' zygotes fork ranks only for those who know it.
#: A barrier task: its rank and how the rank ended.
_Task = Callable[[Iterable[Any]], Iterator[tuple[int, dict[str, Any]]]]


def active_session() -> Any:
    """The notebook's active SparkSession, or a clear error saying how to get one."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ImportError(
            "the Spark backend needs pyspark: pip install 'nbdist[spark]' (or run local ranks "
            "with --backend local)"
        ) from None
    session = SparkSession.getActiveSession()
    if session is None:
        raise ValueError(
            "the Spark backend (--backend spark) needs an active SparkSession and there is none: "
            "create one first (spark = SparkSession.builder.getOrCreate()), or run local ranks "
            "with --backend local"
        )
    return session


def is_connect(session: Any) -> bool:
    """Whether ``session`` is a Spark Connect session (``SparkSession.builder.remote(...)``,
    Databricks' standard access mode and serverless): it has no SparkContext."""
    return type(session).__module__.startswith("pyspark.sql.connect")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """What the cluster can run at once, and where the numbers come from."""

    master: str
    executors: int
    cores: int  # cores of all executors
    task_cpus: int  # spark.task.cpus
    gpus: int  # GPU addresses of all executors
    task_gpus: float  # spark.task.resource.gpu.amount; 0 when not set
    slots: int  # barrier tasks that fit at once: what Spark's own barrier check counts
    cpu_slots: int
    gpu_slots: int | None  # None without a task GPU resource
    estimated: bool = False  # Spark's own count was out of reach; slots is from the conf
    counted: bool = True  # False: not even the conf tells (Spark Connect), slots is 0

    def limit(self) -> str:
        """Which resource bounds ``slots``, in words."""
        cpu = (
            f"{self._executors()} with {self.cores} cores in all, "
            f"spark.task.cpus={self.task_cpus}"
        )
        if self.gpu_slots is not None and self.gpu_slots < self.cpu_slots:
            return (
                f"limited by GPUs: {self._executors()} with {gpus_text(self.gpus)} in all, "
                f"spark.task.resource.gpu.amount={self.task_gpus:g}; the CPU cores alone "
                f"would allow {self.cpu_slots}, but every task of this cluster takes a GPU, "
                f"with --no-gpu too"
            )
        return f"limited by CPU cores: {cpu}"

    def _executors(self) -> str:
        return f"{self.executors} executor{'s' if self.executors != 1 else ''}"

    def describe(self) -> str:
        gpus = (
            f", {gpus_text(self.gpus)} (spark.task.resource.gpu.amount={self.task_gpus:g})"
            if self.task_gpus else (f", {gpus_text(self.gpus)} not usable by tasks "
                                    f"(spark.task.resource.gpu.amount is not set)"
                                    if self.gpus else ", no GPUs")
        )
        how = "estimated from the configuration" if self.estimated else "as Spark counts them"
        if not self.counted:
            return (
                f"Spark Connect {self.master}: barrier task slots unknown (Spark Connect does "
                f"not list executors, and spark.executor.instances / spark.executor.cores are "
                f"not set; spark.task.cpus={self.task_cpus}{gpus})"
            )
        return (
            f"Spark {self.master}: {self._executors()}, {self.cores} cores "
            f"(spark.task.cpus={self.task_cpus}){gpus} -> {self.slots} barrier task slots "
            f"({how})"
        )


def read_cluster(sc: Any) -> ClusterInfo:
    """Count the cluster's barrier slots now (no waiting).

    ``slots`` is ``SparkContext.maxNumConcurrentTasks`` for the default resource profile: the
    very number Spark's barrier check (SPARK-24819) compares a stage with, so a stage that
    passes here is not caught in Spark's ten-minute retry loop. The per-executor numbers come
    from Spark's status store and only explain it. Both are JVM internals reached through py4j;
    when they are out of reach (another Spark build), the numbers come from the configuration.
    """
    conf = sc.getConf()
    task_cpus = max(1, int(conf.get("spark.task.cpus", "1") or 1))
    task_gpus = float(conf.get("spark.task.resource.gpu.amount", "0") or 0)
    master = str(sc.master)
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        slots = int(jsc.maxNumConcurrentTasks(profile))
        listed = jsc.statusStore().executorList(True)
        executors = cores = gpus = cpu_slots = 0
        gpu_slots = 0
        for i in range(listed.size()):
            summary = listed.apply(i)
            n_cores = int(summary.totalCores())
            if n_cores <= 0:  # the driver, in cluster mode: it runs no tasks
                continue
            found = summary.resources().get("gpu")
            n_gpus = len(list(found.get().addresses())) if found.isDefined() else 0
            executors += 1
            cores += n_cores
            gpus += n_gpus
            cpu_slots += n_cores // task_cpus
            if task_gpus:
                gpu_slots += math.floor(n_gpus / task_gpus + 1e-9)
        estimated = False
    except Exception:  # py4j errors: JVM internals this Spark build lacks or does not allow
        executors = 1
        try:  # the block managers: the driver's and one per executor (the same one locally)
            executors = max(1, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)
        except Exception:
            pass
        cores = int(sc.defaultParallelism)  # all executors' cores, unless set by the user
        gpus = 0
        cpu_slots = slots = cores // task_cpus
        gpu_slots = 0
        estimated = True
    return ClusterInfo(
        master=master, executors=executors, cores=cores, task_cpus=task_cpus, gpus=gpus,
        task_gpus=task_gpus, slots=slots, cpu_slots=cpu_slots,
        gpu_slots=gpu_slots if task_gpus else None, estimated=estimated,
    )


def read_connect_cluster(session: Any) -> ClusterInfo:
    """Count a Spark Connect session's barrier slots from what Connect exposes: the server's
    configuration. Connect has no SparkContext, hence no executor list and no
    ``maxNumConcurrentTasks``: the slots come from ``spark.master`` (``local[N]``) or from
    ``spark.executor.instances`` × ``spark.executor.cores`` (or ``spark.cores.max``) divided by
    ``spark.task.cpus``, and GPUs from ``spark.executor.resource.gpu.amount``. When none of
    these is set (a standalone cluster that gives each application every core), the count
    is unknown (``counted=False``), and said so rather than guessed."""

    def conf(key: str) -> str:
        try:
            return str(session.conf.get(key, None) or "")
        except Exception:  # a setting the server does not let clients read
            return ""

    def number(key: str) -> float:
        try:
            return float(conf(key) or 0)
        except ValueError:
            return 0.0

    master = conf("spark.master")
    task_cpus = max(1, int(number("spark.task.cpus") or 1))
    task_gpus = number("spark.task.resource.gpu.amount")
    executor_gpus = int(number("spark.executor.resource.gpu.amount"))
    local = re.fullmatch(r"local(?:-cluster)?\[(\d+)(?:,.*)?\]|local", master)
    executors = int(number("spark.executor.instances"))
    executor_cores = int(number("spark.executor.cores"))
    if local is not None and master != "local[*]":
        executors, cores = 1, int(local.group(1) or 1)
    elif executors and executor_cores:
        cores = executors * executor_cores
    elif number("spark.cores.max") and executor_cores:
        cores = int(number("spark.cores.max"))
        executors = cores // executor_cores
    else:
        executors = cores = 0
    gpus = executors * executor_gpus
    cpu_slots = cores // task_cpus
    gpu_slots = math.floor(gpus / task_gpus + 1e-9) if task_gpus and gpus else None
    counted = cores > 0
    slots = min(cpu_slots, gpu_slots) if gpu_slots is not None else cpu_slots
    return ClusterInfo(
        master=master or "(spark.master not readable)", executors=executors, cores=cores,
        task_cpus=task_cpus, gpus=gpus, task_gpus=task_gpus, slots=slots, cpu_slots=cpu_slots,
        gpu_slots=(gpu_slots or 0) if task_gpus else None, estimated=True, counted=counted,
    )


def cluster_hosts(master: str, server: str = "") -> list[str]:
    """The hosts a Spark Connect client can find its cluster by, for the address its ranks
    are told: the master's (``spark://h1:7077,h2:7077``, ``k8s://https://h:443``,
    ``mesos://h:5050``), then the Connect server's. A local master or YARN names none."""
    hosts: list[str | None] = []
    found = re.fullmatch(r"(?:spark|mesos)://(.+)", master)
    if found:
        hosts += [urllib.parse.urlsplit(f"//{part}").hostname
                  for part in found.group(1).split(",")]
    elif master.startswith("k8s://"):
        rest = master[len("k8s://"):]
        hosts.append(urllib.parse.urlsplit(rest if "://" in rest else f"//{rest}").hostname)
    return [h for h in (*hosts, server) if h]


class SparkLauncher:
    """Ranks as the tasks of one Spark barrier stage; see the module docstring.

    Parameters
    ----------
    session : pyspark.sql.SparkSession, optional
        Default: the active session (the notebook's ``spark`` on Databricks).
    """

    name = "spark"
    remote = True

    def __init__(self, session: Any = None) -> None:
        self._session = active_session() if session is None else session
        #: Spark Connect: the stage goes through the DataFrame API, cancel through job tags
        self.connect = is_connect(self._session)
        self._sc: Any = None if self.connect else self._session.sparkContext
        self._lock = threading.Lock()
        self._group: str | None = None
        self._cancelled = False
        self._killed = False  # Spark's job group was cancelled: lost tasks were killed by us
        #: Spark Connect: the operation ids that this job's ``interruptTag`` interrupted (what
        #: Spark answered; empty until then, or when the stage had ended first).
        self.interrupted: tuple[str, ...] = ()
        self._finished = threading.Event()
        self._per_task = 1  # ranks per barrier task: the GPUs of a task, with --gpu
        #: The ranks' outcomes were given (by the stage's end, or given up on: ``_settle``).
        self._settled = False
        self._on_outcome: Callable[[RankOutcome], None] | None = None
        self._np = 0

    # -- capacity ---------------------------------------------------------------------------
    def cluster(self, want: int = 1) -> ClusterInfo:
        """The cluster's numbers, once ``want`` slots are there or it is no use waiting.

        Executors register a moment after a session starts: a young session gets up to
        ``EXECUTOR_WAIT_S`` for them. A local master's slots are fixed from the start.
        """
        if self.connect:
            return read_connect_cluster(self._session)
        sc = self._sc
        age = time.time() - int(sc.startTime) / 1000
        wait = 0.0 if str(sc.master).startswith("local") else EXECUTOR_WAIT_S
        deadline = time.monotonic() + (wait if age < YOUNG_SESSION_S else 0.0)
        while True:
            info = read_cluster(sc)
            if info.slots >= want or time.monotonic() >= deadline:
                return info
            # Executors register with the driver on their own schedule and Spark offers no
            # event to wait on from Python: poll its registry, briefly.
            time.sleep(0.1)

    def driver_address(self) -> events.DriverAddress:
        """Bind what Spark binds, advertise what Spark advertises (unless configured).

        Listening on ``spark.driver.bindAddress`` (every interface when it is not set) and
        telling the ranks ``spark.driver.host`` works wherever Spark's own driver is
        reachable: a host name that resolves to 127.0.1.1 on the driver (Debian), a second
        interface. Behind a port forwarder (a driver in a container) the ranks are told
        ``%config DistMagics.driver_host`` / ``NBDIST_DRIVER_HOST`` and the fixed port
        ``DistMagics.driver_port`` / ``NBDIST_DRIVER_PORT`` instead.
        """
        bind = self._conf("spark.driver.bindAddress") if not self.connect else ""
        host, host_from = launch.setting("driver_host")
        if not self.connect and not bind and not host and str(
                self._conf("spark.master") or "").startswith("local"):
            # Every rank runs on this machine (a local[N] master): loopback, as the local
            # backend, unless Spark's own bind address or nbdist's driver host says otherwise.
            return events.DriverAddress(
                "127.0.0.1", "127.0.0.1", self._port(),
                "on 127.0.0.1 (loopback: spark.master is local and spark.driver.bindAddress "
                "is not set), advertised as 127.0.0.1")
        if not host and self.connect:
            # The notebook is Spark Connect's client, not Spark's driver: spark.driver.host
            # is the server's machine. The ranks reach this one, at the address it reaches the
            # cluster from (its name may resolve to 127.0.1.1, as on Debian).
            toward = cluster_hosts(self._conf("spark.master"), self._server_host())
            host, host_from = (
                channel.hostname_for_peers(toward),
                "this machine's address toward the cluster (spark.master, the Connect "
                "server): a Spark Connect client",
            )
        if not host:
            spark_host = self._conf("spark.driver.host")
            host, host_from = (
                (str(spark_host), "spark.driver.host") if spark_host
                else (channel.hostname_for_peers(), "this machine's address")
            )
        port = self._port()
        _, port_from = launch.setting("driver_port")
        source = (
            f"on {events.interface_text(bind)} (spark.driver.bindAddress"
            f"{f'={bind}' if bind else ' is not set'})"
            f"{f', port {port} ({port_from})' if port else ''}, advertised as {host} "
            f"({host_from})"
        )
        return events.DriverAddress(bind, host, port, source)

    @staticmethod
    def _port() -> int:
        """The event server's fixed port (``DistMagics.driver_port``), or 0 for any."""
        port_text, port_from = launch.setting("driver_port")
        try:
            port = int(port_text or 0)
        except ValueError:
            raise ValueError(f"{port_from} must be a port number, not {port_text!r}") from None
        if not 0 <= port <= 65535:
            raise ValueError(f"{port_from} must be a port number (1-65535, or 0 for any), "
                             f"not {port}")
        return port

    def ranks_per_task(self, gpu: bool) -> int:
        """Ranks each barrier task runs: with ``gpu``, one per GPU of the task
        (``spark.task.resource.gpu.amount``, a whole number); else one."""
        try:
            amount = float(self._conf("spark.task.resource.gpu.amount") or 0)
        except ValueError:
            return 1
        return int(amount) if gpu and amount >= 1 and amount == int(amount) else 1

    def capacity(self) -> Capacity:
        info = self.cluster()
        per_task = self.ranks_per_task(bool(info.task_gpus))
        gpus = info.gpus if info.task_gpus else 0
        if info.task_gpus and not gpus:
            # Connect without the executors' GPU count: tasks do get GPUs (``--gpu`` stays the
            # default), at least one task's worth.
            gpus = math.ceil(info.task_gpus)
        return Capacity(
            slots=info.slots * per_task, gpus=gpus,
            detail=info.describe() + (f", {per_task} ranks each (one per GPU)"
                                      if per_task > 1 else ""),
        )

    def _endpoint(self) -> tuple[str, int] | None:
        """The Connect server's host and port, as the client was given them (None: not a
        Connect session, or a client that does not say)."""
        if not self.connect:
            return None
        try:
            host, _, port = str(self._session.client._builder.endpoint).rpartition(":")
            return host.strip("[]"), int(port)
        except Exception:  # a private attribute of pyspark's client: another version lacks it
            return None

    def _server_gone(self) -> str:
        """Why the Connect server is gone ("" when it takes connections, or when this is not
        a Connect session or its address is not known). A refused connection is what a
        stopped or killed server leaves; a timeout (a busy or far server) is not taken as gone."""
        where = self._endpoint()
        if where is None:
            return ""
        try:
            socket.create_connection(where, timeout=SERVER_PROBE_S).close()
        except ConnectionRefusedError:
            return (f"the Spark Connect server at {where[0]}:{where[1]} is gone (connection "
                    f"refused)")
        except OSError:
            return ""
        return ""

    def _watch_server(self, request: LaunchRequest) -> None:
        """Spark Connect: while the stage runs, end the job once its server is gone (see
        ``SERVER_PROBES``): every rank fails, naming the cause."""
        refused = 0
        why = ""
        while not self._finished.wait(SERVER_PROBE_S):
            gone = self._server_gone()
            refused = refused + 1 if gone else 0
            why = gone or why
            if refused >= SERVER_PROBES:
                break
        else:
            return  # the stage ended
        self._settle(lambda rank: RankOutcome(rank, RankStatus.FAILED, error={
            "type": "SparkConnectLost", "traceback": "",
            "message": f"{why} while rank {rank} ran: its executors' tasks went with it"}))

    def _settle(self, outcome: Callable[[int], RankOutcome]) -> bool:
        """Give every rank its outcome, once: from the stage's end, or given up on (a lost
        server, a cancel the backend does not answer). False when that was done already."""
        with self._lock:
            if self._settled or self._on_outcome is None:
                return False
            self._settled = True
            on_outcome = self._on_outcome
        for rank in range(self._np):
            on_outcome(outcome(rank))
        return True

    def _server_host(self) -> str:
        """The Connect server's host, as the client was given it ("" when not known)."""
        try:
            return str(self._session.client.host or "")
        except Exception:  # a client without the property (pyspark < 4), or closed
            return ""

    def _conf(self, key: str) -> str:
        """A setting of the session's Spark ("" when unset or not readable)."""
        try:
            if self.connect:
                return str(self._session.conf.get(key, None) or "")
            return str(self._sc.getConf().get(key) or "")
        except Exception:  # a setting a Connect server does not let clients read
            return ""

    def check(self, np: int, gpu: bool) -> None:
        gone = self._server_gone()
        if gone:
            raise CapacityError(
                f"{gone}: this Spark Connect session cannot run ranks. Start the server again "
                f"(and a new session: SparkSession.builder.remote(...)), or run local ranks "
                f"with -np -N")
        master = self._conf("spark.master")
        if self._conf("spark.dynamicAllocation.enabled").lower() == "true" and not (
            master.startswith("local")
        ):
            # Spark refuses barrier stages under dynamic allocation (SPARK-24942): executors
            # may come and go, so N tasks cannot be promised to start together.
            raise CapacityError(
                "this Spark session uses dynamic allocation (spark.dynamicAllocation.enabled="
                "true), and Spark cannot run barrier stages with it: executors come and go, so "
                f"{np} ranks cannot be promised to start together. Use a cluster with a fixed "
                "number of executors (spark.dynamicAllocation.enabled=false; on Databricks: "
                f"autoscaling off), or -np -{np} for {np} local ranks on the driver."
            )
        info = self.cluster(want=np)
        if gpu:
            if not info.task_gpus:
                raise CapacityError(
                    "--gpu needs a 'gpu' task resource on the Spark cluster, and "
                    "spark.task.resource.gpu.amount is not set. Set "
                    "spark.executor.resource.gpu.amount (GPUs per executor), "
                    "spark.task.resource.gpu.amount=1 (one GPU per task) and a discovery "
                    "script (spark.executor.resource.gpu.discoveryScript, or "
                    "spark.worker.resource.gpu.* on a standalone cluster) when the cluster "
                    "starts; Databricks sets these on GPU clusters. Or use --no-gpu."
                )
            if info.task_gpus < 1 or info.task_gpus != int(info.task_gpus):
                raise CapacityError(
                    "--gpu gives each rank one GPU of its own, which needs a whole number of "
                    f"GPUs per task (spark.task.resource.gpu.amount=k: k ranks per task, one "
                    f"per GPU); it is {info.task_gpus:g} on this cluster. Set it to 1 (or the "
                    f"GPUs of a node) when the cluster starts, or use --no-gpu."
                )
            per_task = int(info.task_gpus)
            if np % per_task:
                below = np // per_task * per_task
                sizes = (f"-np {below} or -np {below + per_task}" if below
                         else f"-np {per_task}")
                raise CapacityError(
                    f"-np {np} is not a multiple of {per_task}: each Spark task of this cluster "
                    f"has {per_task} GPUs (spark.task.resource.gpu.amount={per_task}) and runs "
                    f"{per_task} ranks, one per GPU. Use {sizes}, or --no-gpu for one CPU "
                    f"rank per task."
                )
            if per_task > 1 and info.counted and np // per_task > info.slots:
                raise CapacityError(
                    f"asked for {np} ranks ({np // per_task} barrier tasks of {per_task} "
                    f"GPUs), but this Spark cluster can run only {info.slots} barrier tasks "
                    f"at once ({info.limit()}), {info.slots * per_task} ranks, and all must "
                    f"run together. Use -np {max(info.slots, 1) * per_task} or fewer, add "
                    f"executors, or -np -{np} for {np} local ranks on the driver."
                )
        if not info.counted:
            return  # Spark's own barrier check is all there is (docs/spark.md, Spark Connect)
        if info.executors == 0 or info.slots == 0:
            raise CapacityError(
                f"asked for {np} ranks, but no executor of this Spark cluster can run a task "
                f"now ({info.describe()}). Wait for the workers to join (%dist_status shows "
                f"them), or use -np -{np} for {np} local ranks on the driver."
            )
        if np > info.slots and self.ranks_per_task(gpu) == 1:
            raise CapacityError(
                f"asked for {np} ranks, but this Spark cluster can run only {info.slots} "
                f"barrier tasks at once ({info.limit()}), and all {np} must run together. Use "
                f"-np {max(info.slots, 1)} or fewer, add executors, or -np -{np} for {np} "
                f"local ranks on the driver."
            )

    # -- running ----------------------------------------------------------------------------
    def _warmth(self) -> tuple[str, str, float] | None:
        """What the tasks need to use their executors' zygotes (``launch.warmth``), for this
        Spark application."""
        return launch.warmth(self._conf("spark.app.id") if self.connect
                             else str(self._sc.applicationId))

    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        from pyspark import InheritableThread

        group = f"nbdist-{request.job_id}-{secrets.token_hex(4)}"
        self._per_task = self.ranks_per_task(request.gpu)
        task = _barrier_task(request, __version__, self._warmth(), self._per_task)
        guard_stop_button()
        with self._lock:
            self._group = group
            self._on_outcome, self._np, self._settled = on_outcome, request.np, False
        if self.connect and self._endpoint() is not None:
            threading.Thread(target=self._watch_server, args=(request,), daemon=True,
                             name=f"nbdist-spark-server-{request.job_id}").start()
        # The stage runs from a thread of its own: the kernel's thread stays free to render and
        # to take the stop button, and setJobGroup (addTag on Connect) only applies to the
        # thread that submits. On Connect a plain thread: InheritableThread would copy the
        # session's tags of the calling thread, and the job's own tag is all it needs.
        maker: Any = threading.Thread if self.connect else InheritableThread
        thread = maker(target=self._submit, args=(request, group, task, on_outcome),
                       name=f"nbdist-spark-{request.job_id}", daemon=True)
        thread.start()

    def _submit(
        self, request: LaunchRequest, group: str, task: _Task,
        on_outcome: Callable[[RankOutcome], None],
    ) -> None:
        rows: list[tuple[int, dict[str, Any]]] = []
        error: BaseException | None = None
        try:
            if self.connect:
                rows = self._collect_connect(request, group, task)
            else:
                sc = self._sc
                sc.setJobGroup(group, f"nbdist job {request.job_id}: {request.np} ranks",
                               interruptOnCancel=True)
                if not self._cancelled:
                    tasks = request.np // self._per_task
                    rdd = sc.parallelize(range(tasks), tasks).barrier()
                    rows = rdd.mapPartitions(task).collect()
        except BaseException as exc:  # the stage failed or was cancelled: outcomes below
            error = exc
        finally:
            self._finished.set()
        outcomes = {rank: RankOutcome.from_fields(rank, fields) for rank, fields in rows}
        culprit = _failed_partition(error) if error is not None else None
        lost_host = self._lost_executor(error) if error is not None else None
        # Nothing, when the ranks were given up on already (a lost server, _give_up).
        self._settle(lambda rank: outcomes.get(rank) or self._lost(rank, error, culprit,
                                                                   lost_host))

    def _collect_connect(self, request: LaunchRequest, tag: str, task: _Task
                         ) -> list[tuple[int, dict[str, Any]]]:
        """The barrier stage on Spark Connect: ``mapInArrow(..., barrier=True)`` over one row
        per rank, under this job's tag (``addTag`` applies to this thread's operations only),
        each task's outcome pickled in a binary column."""
        import pickle

        session = self._session
        session.addTag(tag)
        try:
            if self._cancelled:
                return []
            tasks = request.np // self._per_task
            frame = session.range(tasks, numPartitions=tasks)
            rows = frame.mapInArrow(_arrow_task(task), "rank long, outcome binary",
                                    barrier=True).collect()
        finally:
            session.removeTag(tag)
        return [(int(row["rank"]), pickle.loads(row["outcome"])) for row in rows]

    def _lost(
        self, rank: int, error: BaseException | None, culprit: int | None,
        lost_host: str | None = None,
    ) -> RankOutcome:
        """The outcome of a rank whose task returned nothing.

        With ``lost_host`` (an executor was lost) every such outcome carries it: the job,
        which knows where each rank ran, then fails the ranks that were on that host and
        counts the others as stopped.
        """
        if self._killed or (self._cancelled and error is None):
            return RankOutcome(rank, RankStatus.CANCELLED)
        if error is None:
            return RankOutcome(rank, RankStatus.FAILED, error={
                "type": "LaunchError", "traceback": "",
                "message": f"the barrier task of rank {rank} returned no outcome",
            })
        if culprit is not None and culprit != rank // self._per_task:
            # Spark stopped it with the failed stage
            return RankOutcome(rank, RankStatus.CANCELLED, lost_host=lost_host)
        if not self.connect and (getattr(self._sc, "_jsc", None) is None
                                 or "SparkContext was shut down" in str(error)):
            # spark.stop() under the job: pyspark's own error may name only its internals
            return RankOutcome(rank, RankStatus.FAILED, error={
                "type": "SparkContextStopped", "traceback": "",
                "message": "the SparkContext was stopped while its task ran (spark.stop(), or "
                "the session ended): start a new session and run the cell again"})
        stage, cause = _spark_reason(error)
        if lost_host is not None:
            return RankOutcome(rank, RankStatus.FAILED, lost_host=lost_host, error={
                "type": "ExecutorLost",
                "message": f"its Spark executor on {lost_host} was lost: {cause}",
                "traceback": f"rank {rank}'s Spark executor on {lost_host} was lost: "
                f"{cause}\n{stage}\n",
            })
        return RankOutcome(rank, RankStatus.FAILED, error={
            "type": "SparkTaskFailed", "message": f"its Spark task failed: {cause}",
            "traceback": f"rank {rank}'s Spark task failed: {cause}\n{stage}\n",
        })

    def _lost_executor(self, error: BaseException) -> str | None:
        """The host of the executor whose loss failed the stage, if that is what happened."""
        text = str(error)
        found = _EXECUTOR_LOST.search(text)
        if found is None or self.connect:  # Connect: no executor list to find the host in
            return None
        executor = found.group(1)
        # A barrier stage's failure names the executor, not its host: Spark's list of
        # executors (the dead ones included) has it.
        try:
            listed = self._sc._jsc.sc().statusStore().executorList(False)
            for i in range(listed.size()):
                summary = listed.apply(i)
                if str(summary.id()) == executor:
                    return str(summary.hostPort()).rsplit(":", 1)[0].strip("[]")
        except Exception:  # py4j errors: JVM internals this Spark build lacks
            pass
        return None

    def deliver(self, rank: int, event: DriverEvent) -> bool:
        return False  # the supervisors run on the executors: the event channel it is

    def cancel(self) -> None:
        """Stop the ranks: the supervisors first (the job has told them), then Spark's tasks."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            group = self._group
        if group is not None:
            threading.Thread(
                target=self._cancel_group, args=(group,), name="nbdist-spark-cancel",
                daemon=True,
            ).start()

    def _cancel_group(self, group: str) -> None:
        # The job has asked every connected supervisor to stop its rank; their tasks then end
        # with an outcome each. Only tasks that do not end in time (not started yet, hung,
        # unreachable) are killed by Spark, which loses what they would have returned. Only
        # this job's group is cancelled: other Spark jobs of the session go on.
        if self._finished.wait(CANCEL_GRACE_S):
            return
        self._killed = True
        # From a thread of its own: on a backend that vanished the call itself may not return
        # (pyspark's client retries a lost Connect server for minutes).
        threading.Thread(target=self._interrupt, args=(group,), daemon=True,
                         name="nbdist-spark-interrupt").start()
        if self._finished.wait(GIVE_UP_S):
            return
        why = self._server_gone() or (f"Spark did not end the stage within "
                                      f"{CANCEL_GRACE_S + GIVE_UP_S:g} s of the cancel")
        self._settle(lambda rank: RankOutcome(rank, RankStatus.FAILED, error={
            "type": "SparkLost", "traceback": "",
            "message": f"given up on after the cancel: {why}"}))

    def _interrupt(self, group: str) -> None:
        try:
            if self.connect:
                # This job's tag: nobody else's operations. Spark answers with the ids of the
                # operations it interrupted: the stage's collect(), unless it had ended.
                self.interrupted = tuple(str(i) for i in self._session.interruptTag(group)
                                         or ())
            else:
                self._sc.cancelJobGroup(group)
        except Exception:  # a backend that vanished: _cancel_group gives up on the ranks
            pass


def guard_stop_button() -> None:
    """Keep the notebook's stop button from cancelling every Spark job of the session.

    pyspark's SparkContext, created in the main thread, installs a SIGINT handler that calls
    ``cancelAllJobs()`` and raises KeyboardInterrupt. While the kernel waits on an nbdist job
    or session cell (``nbdist.waiting.waiting`` marks the main thread, from nbdist's one wait loop
    and from the magics), the KeyboardInterrupt alone is wanted: nbdist then cancels its own
    job group, or interrupts the session's cell, and nothing else. Anywhere else the previous
    handler runs as before. Installed from the main thread only (where Python allows it),
    again whenever a new SparkContext replaced it.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or previous is signal.default_int_handler:
        return  # nothing there that would cancel other jobs
    if getattr(previous, "_nbdist_guard", False):
        return
    from nbdist.waiting import is_waiting

    def nbdist_sigint(signum: int, frame: FrameType | None) -> Any:
        # Signal handlers run in the main thread: this asks whether the main thread waits.
        if is_waiting():
            raise KeyboardInterrupt
        return previous(signum, frame)

    nbdist_sigint._nbdist_guard = True  # type: ignore[attr-defined]
    nbdist_sigint._nbdist_previous = previous  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, nbdist_sigint)


def unguard_stop_button() -> None:
    """Put back the SIGINT handler that :func:`guard_stop_button` wrapped (pyspark's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = getattr(signal.getsignal(signal.SIGINT), "_nbdist_previous", None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def shutdown() -> None:
    """``%unload_ext nbdist`` (``backends.shutdown``): pyspark's own SIGINT handler is back."""
    unguard_stop_button()


_EXECUTOR_LOST = re.compile(r"ExecutorLostFailure \(executor (\S+) ")
_LOST_TASK = re.compile(r"Lost task (\d+)\.\d+ in stage")
_BARRIER_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\)")


def _failed_partition(error: BaseException) -> int | None:
    """The partition (= rank) whose task failed the stage, from Spark's message."""
    text = str(error)
    for pattern in (_LOST_TASK, _BARRIER_TASK):
        found = pattern.search(text)
        if found:
            return int(found.group(1))
    return None


def _spark_reason(error: BaseException) -> tuple[str, str]:
    """Spark's one-line account of a failed ``collect()`` and the first line of its cause."""
    java = getattr(error, "java_exception", None)
    text = str(java) if java is not None else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    stage = lines[0] if lines else type(error).__name__
    for prefix in ("org.apache.spark.SparkException: ", "Job aborted due to stage failure: "):
        stage = stage.removeprefix(prefix)
    full = str(error).splitlines()
    cause = next(
        (line.strip() for line in full if "Python worker exited" in line
         or "ExecutorLostFailure" in line or "TaskKilled" in line), stage,
    )
    cause = cause.removeprefix("org.apache.spark.SparkException: ")
    return stage[:1000], cause[:1000]


# -- the task side: runs inside Spark's Python workers ------------------------------------------
def _arrow_task(task: _Task) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """``task`` as a ``mapInArrow`` function: its one input batch read, its outcome pickled
    into one record batch (``rank long, outcome binary``)."""

    def nbdist_rank_arrow(batches: Iterable[Any]) -> Iterator[Any]:
        import pickle

        import pyarrow as pa

        for _ in batches:  # one row (the rank): nothing to read
            pass
        for rank, fields in task(()):
            yield pa.RecordBatch.from_pydict(
                {"rank": [rank], "outcome": [pickle.dumps(fields)]},
                schema=pa.schema([("rank", pa.int64()), ("outcome", pa.binary())]))

    return nbdist_rank_arrow


def _barrier_task(request: LaunchRequest, version: str,
                  warm: tuple[str, str, float] | None = None, per_task: int = 1) -> _Task:
    """The function each barrier task runs; pickled by value, so it holds plain values only.
    With ``per_task`` > 1 (k GPUs per task) a task runs k ranks, one per GPU."""
    fields = request.fields()  # plain values: LaunchRequest is rebuilt once nbdist is known

    def nbdist_rank(_: Iterable[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        import time

        scheduled = time.time()  # the launch timeline's ``scheduled``: the task began
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        task = ctx.partitionId()
        rank = task * per_task
        try:
            from nbdist.rank.task import run_ranks, run_task
        except ImportError as exc:  # said here, not as an unpickling error deep in Spark's log
            import socket
            import sys

            # The word, not RankStatus: this closure must unpickle where nbdist is missing.
            yield rank, {"status": "failed", "error": {
                "type": "ImportError", "traceback": "",
                "message": f"nbdist cannot be imported by the Spark executors' Python "
                f"({sys.executable} on {socket.gethostname()}): {exc}. Install nbdist "
                f"{version} where the executors run (on Databricks: a cluster library, or "
                f"%pip install in the notebook), or point PYSPARK_PYTHON at a Python that "
                f"has it.",
            }}
            return
        if per_task == 1:
            yield rank, run_task(ctx, rank, fields, version, scheduled=scheduled, warm=warm)
            return

        def one(r: int, gpus: tuple[str, ...]) -> dict[str, Any]:
            return run_task(ctx, r, fields, version, scheduled=scheduled, warm=warm, task=task,
                            gpus=gpus, gather_ok=False)

        yield from run_ranks(ctx, task, per_task, one)

    return nbdist_rank

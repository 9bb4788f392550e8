"""Real Spark for the tests of the Spark backend (``tests/spark``, ``tests/faults``).

A JVM runs one SparkContext at a time, so :class:`Sparks` hands out one session at a time:
``local()`` gives a ``local[2]`` session, ``standalone()`` a session on a standalone cluster
started from pyspark's own ``bin/spark-class`` (a master and two workers with three cores and
two fake GPUs each, on loopback addresses only: the second worker on 127.0.0.2 so that the
ranks really are on two hosts). Asking for one kind stops the other; each test module uses one
kind, so there is at most one switch per module.

The fixtures are registered by ``tests/conftest.py``, so every test directory shares one
session (it takes seconds to start). When any selected test needs the cluster, its processes
start with the first Spark test, so it comes up while the local-session tests run. The session
is stopped as soon as the next test does not use Spark (:func:`release`): the tests that
follow see no active session, which would send their jobs to Spark.

pyspark is imported only when a Spark fixture is used: this module is imported by every run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from nbdist.channel import free_port

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Environment variable that marks every process started by this test session, so that rank
#: interpreters are found even after they lost their parent (the case the tests provoke).
MARK = "NBDIST_SPARK_TEST_MARK"
#: The standalone cluster: workers (address, cores, fake GPU addresses).
WORKERS = (("127.0.0.1", 3, ["0", "1"]), ("127.0.0.2", 3, ["0", "1"]))
CLUSTER_START_S = 180.0

_COMMON_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # Spark's own barrier slot check, made fast, only as a safety net: nbdist's pre-check
    # must catch a too-large job first (the tests check that no Spark job started).
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "1",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "100ms",
}


def marked_rank_processes(mark: str, variable: str = MARK) -> list[psutil.Process]:
    """Rank interpreters (and what they started) of this test session, anywhere on the machine:
    those whose environment has ``variable`` set to ``mark`` (Spark's, or Ray's)."""
    from .helpers import is_rank

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or proc.environ().get(variable) != mark:
                continue
            if is_rank(proc) or any(is_rank(p) for p in proc.parents()):
                found.append(proc)
        except psutil.Error:
            pass
    return found


#: A worker: its address, cores and fake GPU addresses.
Worker = tuple[str, int, list[str]]


class Cluster:
    """A standalone master and workers, started from pyspark's scripts; ``stop()`` ends them.

    By default on loopback addresses of this machine. ``wrap(name, host)`` gives a command
    prefix that runs a process on another (simulated) host, and ``status()`` then reads the
    master's state from where it can be reached (``tests/multihost``).
    """

    def __init__(
        self, workdir: Path, env: dict[str, str], *, master: str = "127.0.0.1",
        workers: Sequence[Worker] = WORKERS, port: int | None = None,
        ui_port: int | None = None, wrap: Callable[[str, str], list[str]] | None = None,
        status: Callable[[str], str] | None = None,
    ) -> None:
        self.workdir = workdir
        import pyspark

        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        home = os.path.dirname(pyspark.__file__)
        self._spark_class = os.path.join(home, "bin", "spark-class")
        self._env = {**env, "SPARK_HOME": home, "SPARK_LOG_DIR": str(workdir),
                     "SPARK_NO_DAEMONIZE": "1"}
        self.master = master
        self.workers = list(workers)
        self.port = port or free_port("127.0.0.1")
        self.ui_port = ui_port or free_port("127.0.0.1")
        self.url = f"spark://{master}:{self.port}"
        self._wrap = wrap or (lambda name, host: [])
        self._status = status or _read_url
        self.launched: set[int] = set()  # the workers started

    def launch(self, workers: int | None = None) -> None:
        """Start the master and workers; :meth:`wait` blocks until the workers have joined."""
        self._run("master", self.master,
                  ["org.apache.spark.deploy.master.Master", "--host", self.master,
                   "--port", str(self.port), "--webui-port", str(self.ui_port)],
                  SPARK_LOCAL_IP=self.master)
        for i in range(len(self.workers) if workers is None else workers):
            self.launch_worker(i)

    def launch_worker(self, i: int) -> None:
        host, cores, gpus = self.workers[i]
        script = self.workdir / f"gpus{i}.sh"
        script.write_text(
            "#!/bin/sh\n"
            f"echo '{json.dumps({'name': 'gpu', 'addresses': gpus})}'\n"
        )
        script.chmod(0o755)
        work = self.workdir / f"worker{i}"
        work.mkdir(exist_ok=True)  # a worker started again after kill_worker
        self._run(
            f"worker{i}", host,
            ["org.apache.spark.deploy.worker.Worker", "--host", host, "--webui-port", "0",
             "--cores", str(cores), "--memory", "2g", "--work-dir", str(work), self.url],
            SPARK_LOCAL_IP=host,
            SPARK_WORKER_OPTS=f"-Dspark.worker.resource.gpu.amount={len(gpus)} "
            f"-Dspark.worker.resource.gpu.discoveryScript={script}",
        )
        self.launched.add(i)

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` with its executors, as a lost host: no shutdown hook runs."""
        name = f"worker{i}"
        for entry in [e for e in self.procs if e[0] == name]:
            try:
                os.killpg(entry[1].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            entry[1].wait(timeout=20)
            self.procs.remove(entry)
        self.launched.discard(i)

    def _run(self, name: str, host: str, args: list[str], **env: str) -> None:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [*self._wrap(name, host), self._spark_class, *args], env={**self._env, **env},
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append((name, proc))

    def wait(self) -> None:
        """Block until every launched worker is ALIVE at the master."""
        n = len(self.launched)
        deadline = time.monotonic() + CLUSTER_START_S
        while True:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"the standalone {name} exited:\n{self.log(name)}")
            try:
                status = json.loads(self._status(f"http://{self.master}:{self.ui_port}/json/"))
                if sum(w["state"] == "ALIVE" for w in status["workers"]) >= n:
                    return
            except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired):
                # The master's web UI is not up yet, answered before it was ready, or (read from
                # another simulated host) the reading process was too slow on a loaded machine.
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standalone cluster did not come up:\n{self.log('master')}")
            time.sleep(0.2)  # the master offers nothing to block on but its status page

    def log(self, name: str) -> str:
        text = (self.workdir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-40:])

    def stop(self) -> None:
        # Workers first: they kill their executors in their shutdown hook.
        for _, proc in reversed(self.procs):
            _stop_group(proc)


def _read_url(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


class Sparks:
    """One Spark session at a time, of the kind asked for."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.kind: str | None = None
        self.session: SparkSession | None = None
        self.cluster: Cluster | None = None

    def local(self) -> SparkSession:
        return self._get("local")

    def standalone(self) -> SparkSession:
        return self._get("standalone")

    def standalone_nodes(self) -> SparkSession:
        """The standalone cluster set up for node-level launch: each task takes both GPUs of
        its worker (``spark.task.resource.gpu.amount=2``), one task per worker."""
        return self._get("standalone-nodes")

    def _get(self, kind: str) -> SparkSession:
        if self.kind == kind and self.session is not None:
            return self.session
        from pyspark.sql import SparkSession

        self.stop_session()
        builder = SparkSession.builder.appName(f"nbdist-tests-{kind}")
        for key, value in _COMMON_CONF.items():
            builder = builder.config(key, value)
        if kind == "local":
            builder = builder.master("local[2]")
            executors = 1
        else:
            self.launch_cluster()
            assert self.cluster is not None
            self.cluster.wait()
            cores = WORKERS[0][1]
            builder = (
                builder.master(self.cluster.url)
                .config("spark.executor.cores", str(cores))
                .config("spark.cores.max", str(cores * len(WORKERS)))
                .config("spark.executor.memory", "512m")
                .config("spark.executor.resource.gpu.amount", str(len(WORKERS[0][2])))
                .config("spark.task.resource.gpu.amount",
                        str(len(WORKERS[0][2])) if kind == "standalone-nodes" else "1")
            )
            executors = len(WORKERS)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        self.kind, self.session = kind, session
        _wait_executors(session, executors)
        return session

    def launch_cluster(self) -> None:
        """Start the standalone cluster's processes, without waiting for them."""
        if self.cluster is None:
            self.cluster = Cluster(self.workdir, self.env)
            self.cluster.launch()

    def restore_worker(self, i: int) -> None:
        """Start worker ``i`` again (after :meth:`Cluster.kill_worker`) and wait until the
        standalone session has all its executors back."""
        assert self.cluster is not None and self.kind == "standalone" and self.session
        if i not in self.cluster.launched:
            self.cluster.launch_worker(i)
        self.cluster.wait()
        _wait_executors(self.session, len(WORKERS))

    def stop_session(self) -> None:
        if self.session is not None:
            self.session.stop()
        self.kind = self.session = None

    def stop(self) -> None:
        self.stop_session()
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


def _wait_executors(session: SparkSession, n: int) -> None:
    from nbdist.launch.spark import read_cluster

    deadline = time.monotonic() + CLUSTER_START_S
    while read_cluster(session.sparkContext).executors < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} executors did not register with the test session")
        time.sleep(0.1)  # executors register on their own schedule


class ConnectServer:
    """A Spark Connect server (pyspark's own ``SparkConnectServer``) on 127.0.0.1, as an
    application of the standalone cluster, and a client session on it."""

    def __init__(self, workdir: Path, cluster: Cluster) -> None:
        import pyspark

        self.port = free_port()
        home = Path(pyspark.__file__).parent
        cores = WORKERS[0][1]
        conf = {
            **_COMMON_CONF,
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.executor.cores": str(cores),
            "spark.cores.max": str(cores * len(WORKERS)),
            "spark.executor.memory": "512m",
            "spark.executor.resource.gpu.amount": str(len(WORKERS[0][2])),
            "spark.task.resource.gpu.amount": "1",
        }
        argv = [str(home / "bin" / "spark-submit"), "--class",
                "org.apache.spark.sql.connect.service.SparkConnectServer",
                "--master", cluster.url, "--name", "nbdist-tests-connect"]
        for key, value in conf.items():
            argv += ["--conf", f"{key}={value}"]
        self.log = workdir / "connect-server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=dict(os.environ), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.session: SparkSession | None = None

    def connect(self) -> SparkSession:
        """A client session, once the server takes connections and has both executors."""
        import socket

        from pyspark.sql import SparkSession

        deadline = time.monotonic() + CLUSTER_START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Spark Connect server did not start: "
                                       f"{self.log.read_text()[-3000:]}") from None
                time.sleep(0.2)  # a JVM starting: nothing to wait on but its port
        self.session = SparkSession.builder.remote(f"sc://127.0.0.1:{self.port}").getOrCreate()
        # Executors register on their own schedule: the first stage waits for them, not the
        # tests (a one-task job runs as soon as one executor is there; ask for 4 tasks).
        self.session.range(4, numPartitions=4).collect()
        return self.session

    def stop(self) -> None:
        if self.session is not None:
            self.session.stop()
            self.session = None
        _stop_group(self.proc)


#: The fixtures that give a test Spark; a test using none of them needs no session.
SPARK_FIXTURES = frozenset({"spark_mark", "sparks", "spark_local", "spark_cluster",
                            "spark_connect", "spark_nodes"})
#: The fixtures that need the standalone cluster.
CLUSTER_FIXTURES = frozenset({"spark_cluster", "spark_connect", "spark_nodes"})
_manager: Sparks | None = None


def uses_spark(item: pytest.Item, fixtures: frozenset[str] = SPARK_FIXTURES) -> bool:
    return bool(fixtures & set(getattr(item, "fixturenames", ())))


def release(items: Sequence[pytest.Item], nextitem: pytest.Item | None) -> None:
    """After a test: stop the session if the next test does not use Spark, and the cluster too
    if no test left does (called from ``pytest_runtest_teardown``)."""
    if _manager is None or nextitem is None or uses_spark(nextitem):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # xdist ran this worker every Spark test, in a
        _manager.stop()  # row (their group, tests/conftest.py): none comes after the next one
        return
    rest = items[items.index(nextitem):] if nextitem in items else []
    if any(uses_spark(item, CLUSTER_FIXTURES) for item in rest):
        _manager.stop_session()
    else:
        _manager.stop()


@pytest.fixture(scope="session")
def spark_mark() -> Iterator[str]:
    """The environment every Spark process of these tests inherits (set before the JVM starts)."""
    mark = uuid.uuid4().hex
    env = {
        # Without this, Spark picks the machine's outside address.
        "SPARK_LOCAL_IP": "127.0.0.1",
        # Executors run this interpreter (the one with nbdist, torch and pyspark).
        "PYSPARK_PYTHON": sys.executable,
        MARK: mark,
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    yield mark
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def sparks(
    spark_mark: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Sparks]:
    """The run's Spark sessions and standalone cluster (stopped early by :func:`release`)."""
    global _manager
    if shutil.which("java") is None:
        pytest.fail("the Spark tests need Java 17 (apt-get install openjdk-17-jre-headless)")
    sigint = signal.getsignal(signal.SIGINT)  # a SparkContext installs its own handler
    manager = _manager = Sparks(tmp_path_factory.mktemp("spark"), dict(os.environ))
    # Where one process runs every Spark test, the cluster comes up while the local-session
    # tests run. An xdist worker collected every test but runs one group (tests/conftest.py):
    # the cluster's group starts it with its first test, the local group never does.
    if not os.environ.get("PYTEST_XDIST_WORKER") and any(
            uses_spark(item, CLUSTER_FIXTURES) for item in request.session.items):
        manager.launch_cluster()
    yield manager
    manager.stop()
    _manager = None
    signal.signal(signal.SIGINT, sigint)


@pytest.fixture
def spark_local(sparks: Sparks) -> SparkSession:
    """A ``local[2]`` session: two task slots, no GPUs (the same one while tests use it)."""
    return sparks.local()


@pytest.fixture
def spark_cluster(sparks: Sparks) -> SparkSession:
    """A session on the standalone cluster: 2 executors × (3 cores, 2 fake GPUs), 4 slots."""
    return sparks.standalone()


@pytest.fixture
def spark_nodes(sparks: Sparks) -> SparkSession:
    """A session on the standalone cluster with 2 GPUs per task: 2 tasks of 2 ranks each."""
    return sparks.standalone_nodes()


@pytest.fixture(scope="module")
def spark_connect(sparks: Sparks, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[SparkSession]:
    """A Spark Connect session (a ``pyspark.sql.connect`` SparkSession) on the standalone
    cluster, through a Connect server of its own: 2 executors × (3 cores, 2 fake GPUs). One
    server per test module; the classic session is stopped first (it would hold the cores)."""
    sparks.stop_session()
    sparks.launch_cluster()
    assert sparks.cluster is not None
    sparks.cluster.wait()
    saved = {k: os.environ.get(k) for k in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED",
                                            "SPARK_LOCAL_REMOTE")}
    server = ConnectServer(tmp_path_factory.mktemp("connect"), sparks.cluster)
    try:
        yield server.connect()
    finally:
        server.stop()
        for key, value in saved.items():  # builder.remote() marks the process as a client
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def no_leftover_spark_ranks(spark_mark: str) -> Iterator[None]:
    """After a Spark test, no rank interpreter of this run is left anywhere (10 s).

    What ``no_leftover_processes`` checks for tests that use Spark: Spark's own processes (the
    JVM, its Python daemon and reused workers) rightly outlive a test, and a rank whose Spark
    worker was killed is no longer a descendant of the test process, so ranks are found by
    the mark they inherit.
    """
    from nbdist.launch.local import pool

    from .helpers import none_left

    yield
    pool.clear()  # warm local interpreters are meant to outlive a job, not a test
    none_left(lambda: marked_rank_processes(spark_mark))


def spark_job_ids(session: SparkSession, probe: str) -> int:
    """Run a trivial Spark job in group ``probe`` and return its id (ids count every job)."""
    sc = session.sparkContext
    sc.setJobGroup(probe, "nbdist test probe")
    try:
        sc.parallelize([0], 1).count()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    (job_id,) = sc.statusTracker().getJobIdsForGroup(probe)
    return int(job_id)

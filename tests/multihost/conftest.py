"""A multi-host Spark cluster for these tests, on simulated hosts (``hosts.py``).

One cluster and one driver serve every test of this directory (``-m multihost`` runs them
alone): a standalone master, workers ``wa`` and ``wb`` (``wc`` joins when a test asks for a
third host), two cores and two fake GPUs each, and a driver that is a real IPython kernel on
host ``driver`` (``kernel.py``) with a SparkSession set up the way real clusters often are:
``spark.driver.host`` is the driver's host *name*, which its own ``/etc/hosts`` maps to
``127.0.1.1`` (Debian), and ``spark.driver.bindAddress`` is ``0.0.0.0``. Host ``nat`` runs a
port forwarder when a test needs one.

That session is one application holding every worker's cores, so the kernel's ``spark`` is
one of three applications at a time (:class:`Apps`): the classic session above (fixtures
``mh``, ``three_hosts``), a Spark Connect client of a Connect server on the driver's host
(``mh_connect``), or a classic session with two GPUs per task (``mh_nodes``). The last two
take two workers (``spark.cores.max``). Asking for another one stops the one in use; the test
files run in that order (``test_cluster.py``, ``test_connect.py``, ``test_nodes.py``), so a
whole run switches twice.

Everything is torn down at the end, also when a test or the set-up fails: the kernel, the
Spark processes (by process group), then every process left in the hosts' namespaces, the
links, the namespaces and their ``/etc/netns`` files. Leftovers of an earlier run that
crashed are removed first (``Network.clean_leftovers``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..sparks import MARK, Cluster, _stop_group
from .helpers import WORKERS, ranks_gone
from .hosts import Network, missing
from .kernel import Kernel

#: The simulated machines, in address order (10.231.13.2, .3, ...).
HOSTS = ("driver", "master", "wa", "wb", "wc", "nat")
CORES = 2
GPUS = ["0", "1"]
#: The first multi-host test to run pays the shared set-up (the hosts, a standalone cluster in
#: them, a kernel in the driver's namespace, the application): minutes on a loaded machine, as in
#: CI where it shares the cores with three other xdist workers and the version matrix. pytest-
#: timeout bills a fixture's set-up to the test that needs it first, and the suite's default
#: (120 s) cut it there, failing every multi-host test with the set-up's timeout.
SETUP_TIMEOUT_S = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every multi-host test may be the first to run, so each may take the set-up's time."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SETUP_TIMEOUT_S))


#: Executors register a while after a worker joins, and again after one was killed.
EXECUTORS_S = 180

#: Read a URL on the host it is run on (the master's status page, from the driver's host).
_READ = ("import sys, urllib.request; "
         "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())")

SETUP = """
%load_ext nbdist
%config DistMagics.view = 'text'
import time as _time
from pyspark.sql import SparkSession
from nbdist.launch.spark import read_cluster as _read_cluster


def _mh_classic(task_gpus="1", cores_max=None):
    builder = (
        SparkSession.builder.master({url!r}).appName("nbdist-multihost")
        # What real clusters do: the driver known by its name, which resolves to 127.0.1.1
        # on the driver itself (Debian), Spark listening on every interface.
        .config("spark.driver.host", "driver")
        .config("spark.driver.bindAddress", "0.0.0.0")
        .config("spark.executor.cores", "{cores}")
        .config("spark.executor.memory", "512m")
        .config("spark.executor.resource.gpu.amount", "{gpus}")
        .config("spark.task.resource.gpu.amount", task_gpus)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if cores_max:
        builder = builder.config("spark.cores.max", cores_max)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


spark = _mh_classic()


def _mh_executors(n, timeout={timeout}):
    deadline = _time.monotonic() + timeout
    while _read_cluster(spark.sparkContext).executors < n:
        if _time.monotonic() > deadline:
            raise RuntimeError(f"{{n}} executors did not register in {{timeout}} s")
        _time.sleep(0.2)  # executors register on their own schedule
"""

#: In the kernel: stop the application in use, and a session of nbdist's on it, if any (a
#: Connect client leaves the process marked as one: unmarked, the next session is classic).
STOP_APP = """
import os as _mh_os
import nbdist.session as _mh_sessions
if _mh_sessions.current() is not None and _mh_sessions.current().alive:
    _mh_sessions.current().stop()
spark.stop()
for _mh_key in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE"):
    _mh_os.environ.pop(_mh_key, None)
"""

#: In the kernel: a Spark Connect client session, and a wait until stages run on ``n`` hosts
#: (a Connect client has no executor list: tasks say where they ran).
CONNECT = """
spark = SparkSession.builder.remote({url!r}).getOrCreate()


def _mh_where(batches):
    import socket
    import pyarrow as pa
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({{"host": [socket.gethostname()]}})


def _mh_connect_hosts(n, timeout={timeout}):
    deadline, seen = _time.monotonic() + timeout, set()
    while len(seen) < n:
        if _time.monotonic() > deadline:
            raise RuntimeError(f"stages ran on {{sorted(seen)}} only, not {{n}} hosts, "
                               f"in {{timeout}} s")
        rows = spark.range(8, numPartitions=8).mapInArrow(_mh_where, "host string").collect()
        seen |= {{row.host for row in rows}}
    return sorted(seen)
"""

#: The Spark Connect server's port on the driver's host (15002: Connect's default).
CONNECT_PORT = 15002
#: The second applications take two workers: two executors of two cores.
TWO_WORKERS = str(2 * CORES)


@pytest.fixture(scope="session")
def network() -> Iterator[Network]:
    """The simulated hosts, on one private bridge."""
    why = missing()
    if why:
        pytest.skip(why)
    pytest.importorskip("pyspark")
    pytest.importorskip("torch")
    Network.clean_leftovers()
    net = Network(HOSTS)
    try:
        try:
            net.up()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot build network namespaces here: {' '.join(exc.cmd)}: "
                        f"{exc.stderr.strip()}")
        yield net
    finally:
        net.down()


def _clean_env() -> dict[str, str]:
    """This process's environment without what would pin Spark to loopback (or mark these
    ranks as the single-host Spark tests' own, ``tests/sparks.py``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_LOCAL_IP", "SPARK_LOCAL_HOSTNAME", "NBDIST_DRIVER_HOST",
                        "NBDIST_DRIVER_PORT", "NBDIST_HEARTBEAT_TIMEOUT", MARK)}
    env["PYSPARK_PYTHON"] = sys.executable  # executors run this interpreter (nbdist, torch)
    return env


@pytest.fixture(scope="session")
def cluster(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A standalone master and two workers (a third on demand), started, not waited for."""
    by_ip = {h.ip: h.name for h in network.hosts.values()}
    cluster = Cluster(
        tmp_path_factory.mktemp("multihost-spark"), _clean_env(), master=network["master"].ip,
        workers=[(network[w].ip, CORES, GPUS) for w in WORKERS], port=7077, ui_port=8080,
        wrap=lambda name, ip: network.prefix(by_ip[ip]),
        status=lambda url: network.run("driver", [sys.executable, "-c", _READ, url], 30),
    )
    try:
        cluster.launch(workers=2)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def driver(
    network: Network, cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Kernel]:
    """The notebook: a kernel on host ``driver`` with nbdist loaded and a SparkSession."""
    kernel = Kernel(network.prefix("driver"), tmp_path_factory.mktemp("multihost-kernel"),
                    _clean_env())
    try:
        cluster.wait()  # while the kernel started
        kernel.execute(SETUP.format(url=cluster.url, cores=CORES, gpus=len(GPUS),
                                    timeout=EXECUTORS_S), timeout=EXECUTORS_S + 60)
        kernel.execute("_mh_executors(2)", timeout=EXECUTORS_S + 10)
        yield kernel
    finally:
        kernel.shutdown()


class Apps:
    """The Spark application the driver kernel's ``spark`` is on; :meth:`use` switches."""

    def __init__(self, network: Network, cluster: Cluster, kernel: Kernel, workdir: Path
                 ) -> None:
        self.network, self.cluster, self.kernel, self.workdir = network, cluster, kernel, workdir
        self.kind = "classic"  # what the driver fixture set up
        self.server: subprocess.Popen[bytes] | None = None

    def use(self, kind: str) -> None:
        """Make ``kind`` (``classic``, ``connect``, ``nodes``) the kernel's ``spark``."""
        if kind == self.kind:
            return
        self.kernel.execute(STOP_APP, timeout=120)
        self.stop_server()
        self.kind = "none"
        if kind == "classic":
            self.kernel.execute("spark = _mh_classic()", timeout=EXECUTORS_S)
        elif kind == "nodes":
            self.kernel.execute(f"spark = _mh_classic('2', {TWO_WORKERS!r})", timeout=EXECUTORS_S)
            self.kernel.execute("_mh_executors(2)", timeout=EXECUTORS_S + 10)
        else:
            self.start_server()
            self.kernel.execute(CONNECT.format(url=f"sc://driver:{CONNECT_PORT}",
                                               timeout=EXECUTORS_S), timeout=60)
            self.kernel.execute("_mh_connect_hosts(2)", timeout=EXECUTORS_S + 10)
        self.kind = kind

    def start_server(self) -> None:
        """pyspark's own ``SparkConnectServer`` on the driver's host (where Databricks runs
        it, beside the notebook), an application of the cluster on two workers."""
        import pyspark

        conf = {
            "spark.connect.grpc.binding.address": "0.0.0.0",
            "spark.connect.grpc.binding.port": str(CONNECT_PORT),
            "spark.driver.host": "driver",
            "spark.driver.bindAddress": "0.0.0.0",
            "spark.executor.cores": str(CORES),
            "spark.cores.max": TWO_WORKERS,
            "spark.executor.memory": "512m",
            "spark.executor.resource.gpu.amount": str(len(GPUS)),
            "spark.task.resource.gpu.amount": "1",
            "spark.ui.enabled": "false",
        }
        argv = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--class",
                "org.apache.spark.sql.connect.service.SparkConnectServer",
                "--master", self.cluster.url, "--name", "nbdist-multihost-connect"]
        for key, value in conf.items():
            argv += ["--conf", f"{key}={value}"]
        log = self.workdir / "connect-server.log"
        with open(log, "wb") as out:
            self.server = subprocess.Popen(
                [*self.network.prefix("driver"), *argv], env=_clean_env(), stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        probe = ("import socket, sys; "
                 "socket.create_connection(('driver', int(sys.argv[1])), timeout=1).close()")
        deadline = time.monotonic() + EXECUTORS_S
        while True:
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Spark Connect server did not start: "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            try:
                self.network.run("driver", [sys.executable, "-c", probe, str(CONNECT_PORT)], 10)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                time.sleep(0.5)  # a JVM starting: nothing to wait on but its port

    def stop_server(self) -> None:
        if self.server is not None:
            _stop_group(self.server)
            self.server = None


@pytest.fixture(scope="session")
def apps(network: Network, cluster: Cluster, driver: Kernel,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apps]:
    """The driver's applications; a Connect server it started is stopped at the end."""
    apps = Apps(network, cluster, driver, tmp_path_factory.mktemp("multihost-apps"))
    try:
        yield apps
    finally:
        apps.stop_server()


@pytest.fixture
def mh(network: Network, cluster: Cluster, apps: Apps) -> Iterator[Kernel]:
    """The driver, with every launched worker's executor registered; after the test, no rank
    process is left on any host (the contract's 10 s)."""
    apps.use("classic")
    apps.kernel.execute(f"_mh_executors({len(cluster.launched)})", timeout=EXECUTORS_S + 10)
    yield apps.kernel
    ranks_gone(network)


@pytest.fixture
def three_hosts(mh: Kernel, cluster: Cluster) -> Kernel:
    """The driver, with the third worker (``wc``) in the cluster too."""
    if 2 not in cluster.launched:
        cluster.launch_worker(2)
        cluster.wait()
        mh.execute("_mh_executors(3)", timeout=EXECUTORS_S + 10)
    return mh


@pytest.fixture
def mh_connect(network: Network, apps: Apps) -> Iterator[Kernel]:
    """The driver as a Spark Connect client of a Connect server on its own host (two
    executors on two hosts, one GPU per task); no rank left on any host after the test."""
    apps.use("connect")
    yield apps.kernel
    ranks_gone(network)


@pytest.fixture
def mh_nodes(network: Network, apps: Apps) -> Iterator[Kernel]:
    """The driver with a classic session of two GPUs per task (two executors on two hosts:
    one task per host, two ranks each); no rank left on any host after the test."""
    apps.use("nodes")
    yield apps.kernel
    ranks_gone(network)

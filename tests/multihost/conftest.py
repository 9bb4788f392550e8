"""A multi-host Spark cluster for these tests, on simulated hosts (``hosts.py``).

One cluster and one driver serve every test of this directory (``-m multihost`` runs them
alone): a standalone master, workers ``wa`` and ``wb`` (``wc`` joins when a test asks for a
third host), two cores and two fake GPUs each, and a driver that is a real IPython kernel on
host ``driver`` (``kernel.py``) with a SparkSession set up the way real clusters often are:
``spark.driver.host`` is the driver's host *name*, which its own ``/etc/hosts`` maps to
``127.0.1.1`` (Debian), and ``spark.driver.bindAddress`` is ``0.0.0.0``. Host ``nat`` runs a
port forwarder when a test needs one.

Everything is torn down at the end, also when a test or the set-up fails: the kernel, the
Spark processes (by process group), then every process left in the hosts' namespaces, the
links, the namespaces and their ``/etc/netns`` files. Leftovers of an earlier run that
crashed are removed first (``Network.clean_leftovers``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ..sparks import MARK, Cluster
from .helpers import WORKERS, ranks_gone
from .hosts import Network, missing
from .kernel import Kernel

#: The simulated machines, in address order (10.231.13.2, .3, ...).
HOSTS = ("driver", "master", "wa", "wb", "wc", "nat")
CORES = 2
GPUS = ["0", "1"]
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

spark = (
    SparkSession.builder.master({url!r}).appName("nbdist-multihost")
    # What real clusters do: the driver known by its name, which resolves to 127.0.1.1 on
    # the driver itself (Debian), Spark listening on every interface.
    .config("spark.driver.host", "driver")
    .config("spark.driver.bindAddress", "0.0.0.0")
    .config("spark.executor.cores", "{cores}")
    .config("spark.executor.memory", "512m")
    .config("spark.executor.resource.gpu.amount", "{gpus}")
    .config("spark.task.resource.gpu.amount", "1")
    .config("spark.ui.enabled", "false")
    .config("spark.ui.showConsoleProgress", "false")
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")


def _mh_executors(n, timeout={timeout}):
    deadline = _time.monotonic() + timeout
    while _read_cluster(spark.sparkContext).executors < n:
        if _time.monotonic() > deadline:
            raise RuntimeError(f"{{n}} executors did not register in {{timeout}} s")
        _time.sleep(0.2)  # executors register on their own schedule
"""


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
        status=lambda url: network.run("driver", [sys.executable, "-c", _READ, url], 10),
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


@pytest.fixture
def mh(network: Network, cluster: Cluster, driver: Kernel) -> Iterator[Kernel]:
    """The driver, with every launched worker's executor registered; after the test, no rank
    process is left on any host (the contract's 10 s)."""
    driver.execute(f"_mh_executors({len(cluster.launched)})", timeout=EXECUTORS_S + 10)
    yield driver
    ranks_gone(network)


@pytest.fixture
def three_hosts(mh: Kernel, cluster: Cluster) -> Kernel:
    """The driver, with the third worker (``wc``) in the cluster too."""
    if 2 not in cluster.launched:
        cluster.launch_worker(2)
        cluster.wait()
        mh.execute("_mh_executors(3)", timeout=EXECUTORS_S + 10)
    return mh

"""One real Ray for the tests of the Ray backend: a two-node ``ray.cluster_utils.Cluster``
(two raylets on this machine, the head on its address, the second on 127.0.0.2 so that the
ranks really are on two hosts), each node with 4 logical CPUs and 2 logical GPUs, started
once for the package (Ray takes tens of seconds to start on a busy 2-core machine) and shut
down after its last test.

The cluster is started explicitly and connected to by its own address: nothing depends on a
Ray the machine already runs or on the ``ray_current_cluster`` file a killed cluster leaves in
``/tmp/ray``. Ray's files (sessions, logs, sockets, that file) go to a folder of this test
run (``RAY_TMPDIR``), not ``/tmp/ray``. A cluster that cannot start within
``START_DEADLINE_S`` fails every Ray test with what Ray's raylets said, and is torn down.

A process of one Ray cannot join another while it is connected, so every Ray test shares this
one; a test that needs another shape (node-level launch, a capacity error) changes nbdist's
Ray settings, never the cluster.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from nbdist.launch import ray as ray_backend

from ..helpers import none_left, rank_processes, wait_for
from ..sparks import marked_rank_processes

# Not `pytest.importorskip("ray")`: a rank imports this module too, with the test module whose
# function it runs, and `import ray` cost it 4 CPU-seconds there (jsonschema's IRI grammar,
# built at import), up to 14 when the build crossed a data-stack chunk boundary of Python 3.11
# (gh-142183: an mmap and a munmap per call). The tests import it where they use it.
if importlib.util.find_spec("ray") is None:
    pytest.skip("needs ray (pip install nbdist[ray])", allow_module_level=True)

# The tests' clusters are this run's own, on loopback and network namespaces: no token
# authentication. Left unset, Ray 2.60 turns it on for every `ray start` once a token file
# exists in ~/.ray (which any local `ray.init()` on the machine writes), and the multi-host
# test's driver, started without it, was refused by its head's GCS (InvalidAuthToken).
os.environ["RAY_AUTH_MODE"] = "disabled"



@functools.cache
def nodes() -> tuple[tuple[str, int, int], ...]:
    """The nodes: (address, CPUs, GPUs). The head on this machine's address, as Ray finds it:
    Ray connects to 127.0.0.1 through that address (``resolve_ip_for_localhost``), so a head on
    127.0.0.1 cannot be reached; the second on a loopback address of its own."""
    import ray

    head = str(ray.util.get_node_ip_address())
    return ((head, 4, 2), ("127.0.0.2" if head != "127.0.0.2" else "127.0.0.3", 4, 2))

#: How long the two nodes may take to start and register (measured: 20-40 s on a loaded
#: 2-core machine); past it every Ray test fails, none hangs.
START_DEADLINE_S = 240.0
#: A Unix socket's path must fit in 108 bytes: Ray's longest under its temporary folder.
_SOCKET_TAIL = "/ray/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store.1"


#: Every process of the cluster inherits ``MARK=RUN_MARK`` (its raylets, Ray's workers, the
#: ranks, the zygotes they leave and the ranks forked from them, which are not this process's
#: descendants): :func:`ray_ranks` finds them anywhere, and no other run's.
MARK = "NBDIST_RAY_TEST_MARK"
RUN_MARK = uuid.uuid4().hex


def ray_ranks() -> list[psutil.Process]:
    """The rank processes of this run's Ray cluster (and what they started), wherever they are."""
    return marked_rank_processes(RUN_MARK, MARK)


def free_ports(n: int) -> list[int]:
    """``n`` ports free now, all different: each socket stays bound until all are chosen (one
    at a time, the system gave the same port twice: Ray refused the node's ports)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]


def node_args(ip: str, cpus: int, gpus: int) -> dict[str, Any]:
    """One node's arguments. The agents' ports are given, not chosen by the agents: the
    raylet then does not wait for the dashboard agent to write its port file (Ray aborts the
    raylet when that takes over its fixed wait, which a loaded machine exceeds)."""
    agent, export, listen, runtime_env = free_ports(4)
    return {"num_cpus": cpus, "num_gpus": gpus, "node_ip_address": ip,
            "include_log_monitor": False, "metrics_agent_port": agent,
            "metrics_export_port": export, "dashboard_agent_listen_port": listen,
            "runtime_env_agent_port": runtime_env}


def ray_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where Ray keeps its files for this run: under pytest's temporary folder when its socket
    paths fit there, else a short folder of its own under the system's."""
    base = tmp_path_factory.mktemp("ray")
    if len(str(base)) + len(_SOCKET_TAIL) < 108:
        return base
    return Path(tempfile.mkdtemp(prefix="nbdist-ray-"))


def raylet_said(root: Path) -> str:
    """The last lines of the raylets' logs under ``root``: why a node did not start."""
    lines = []
    for log in sorted(glob.glob(str(root / "ray" / "session_*" / "logs" / "raylet*.out"))):
        with open(log, errors="replace") as f:
            tail = [line.rstrip() for line in f.readlines()[-200:]]
        lines += [line for line in tail if " C " in line or " E " in line][-3:]
    return "\n".join(lines) or "(the raylets logged no error)"


def registered(gcs: str, node: Any) -> None:
    """Wait until ``node`` is in the GCS's table; fail at once when one of its processes died
    (a raylet that aborted), or after ``START_DEADLINE_S``."""
    from ray._private.services import wait_for_node

    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        try:
            wait_for_node(gcs, node.plasma_store_socket_name, 2)
            return
        except TimeoutError:
            if not node.remaining_processes_alive():
                raise RuntimeError("a process of the Ray node at "
                                   f"{node.node_ip_address} died while it started") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray node at {node.node_ip_address} did not register "
                                   f"within {START_DEADLINE_S:g} s") from None


def start_cluster(started: list[Any]) -> None:
    """Start the two nodes and connect this process as the driver, each wait bounded by
    ``START_DEADLINE_S`` (the test's own timeout bounds the whole); what was made goes into
    ``started`` at once, so that a start that fails is torn down."""
    import ray
    from ray.cluster_utils import Cluster

    (head_ip, head_cpus, head_gpus), (ip, cpus, gpus) = nodes()
    cluster = Cluster(initialize_head=False)
    started.append(cluster)
    # Ray's own wait for a node is 30 s: too short on a loaded machine; ours instead.
    head = cluster.add_node(wait=False, include_dashboard=False,
                            **node_args(head_ip, head_cpus, head_gpus))
    gcs = cluster.address
    registered(gcs, head)
    registered(gcs, cluster.add_node(wait=False, **node_args(ip, cpus, gpus)))
    ray.init(address=gcs, log_to_driver=False, _node_ip_address=head_ip)
    cluster.wait_for_nodes(timeout=START_DEADLINE_S)


def stop_cluster(started: list[Any]) -> None:
    import ray

    ray_backend.shutdown()
    ray.shutdown()
    for cluster in started:
        cluster.shutdown()


def signal_up() -> None:
    """Write the file ``NBDIST_RAY_UP`` names, if any, once the cluster is up: ``make test``
    starts the version matrix's legs only then, because Ray's raylet gives its agents a fixed
    wait that a loaded machine exceeds (docs/developing.md)."""
    path = os.environ.get("NBDIST_RAY_UP")
    if path:
        Path(path).write_text(f"{os.getpid()}\n")


@pytest.fixture(scope="package")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The package's two-node Ray cluster, with this process connected as its driver; pytest
    keeps a failed start's error for the package's other tests (one try per run)."""
    root = ray_tmpdir(tmp_path_factory)
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED",
                                              "RAY_agent_register_timeout_ms", MARK)}
    os.environ.update({"RAY_TMPDIR": str(root), "RAY_USAGE_STATS_ENABLED": "0",
                       "RAY_agent_register_timeout_ms": str(int(START_DEADLINE_S * 1000)),
                       MARK: RUN_MARK})
    started: list[Any] = []
    try:
        try:
            start_cluster(started)
        except Exception as exc:
            pytest.fail(f"the Ray test cluster could not start ({type(exc).__name__}: {exc}); "
                        f"the raylets said:\n{raylet_said(root)}", pytrace=False)
        signal_up()
        yield started[0]
    finally:
        stop_cluster(started)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def on_ray(ray_cluster: Any) -> Iterator[Any]:
    """The cluster, with nbdist's Ray settings at their defaults before and after the test."""
    fresh = ray_backend.RaySettings(placement_wait=20.0)
    for name in vars(fresh):
        setattr(ray_backend.settings, name, getattr(fresh, name))
    yield ray_cluster
    for name in vars(fresh):
        setattr(ray_backend.settings, name, getattr(fresh, name))


def rank_hosts() -> list[psutil.Process]:
    """Ray workers running nbdist's actor (``ray::RankHost``), anywhere under this process."""
    found = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "RankHost" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def groups_left() -> list[str]:
    """nbdist's placement groups that Ray has not removed."""
    from ray.util.placement_group import placement_group_table

    return [g["name"] for g in placement_group_table().values()
            if g["name"].startswith("nbdist-") and g["state"] != "REMOVED"]


@pytest.fixture(autouse=True)
def no_leftover_ray() -> Iterator[None]:
    """After each Ray test: no rank (also none forked from a node's zygote, which is not this
    process's descendant), no nbdist actor and no nbdist placement group is left (10 s). Ray's
    own processes (raylets, idle workers) and the nodes' idle zygotes rightly outlive a test."""
    import ray

    yield
    none_left(rank_processes)
    none_left(ray_ranks, what="rank processes of the Ray cluster left running after the test")
    none_left(rank_hosts, what="nbdist's Ray actors left running after the test")
    if not ray.is_initialized():  # the cluster did not start: nothing of a job to look for
        return
    wait_for(lambda: not groups_left(), 10.0, "nbdist's placement groups to be removed")


def ray_zygotes() -> list[psutil.Process]:
    """The zygotes nbdist left on this cluster's nodes (their lock files are named by the
    node's raylet: ``z-<raylet pid>-...``)."""
    from nbdist.rank.executor_zygote import COMMAND

    raylets = {str(p.pid) for p in psutil.Process(os.getpid()).children(recursive=True)
               if p.name() == "raylet"}
    found = []
    for proc in psutil.process_iter():
        try:
            if COMMAND in " ".join(proc.cmdline()) and any(
                    os.path.basename(f.path).split("-")[1:2] == [pid]
                    for f in proc.open_files() for pid in raylets):
                found.append(proc)
        except (psutil.Error, IndexError):
            pass
    return found


def stop_ray_zygotes() -> None:
    """End them (earlier tests' environments hold a node's two places: MAX_PER_EXECUTOR)."""
    for proc in ray_zygotes():
        proc.terminate()
    wait_for(lambda: not ray_zygotes(), 30, "the nodes' zygotes to go")

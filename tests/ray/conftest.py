"""One real Ray for the tests of the Ray backend: a two-node ``ray.cluster_utils.Cluster``
(two raylets on this machine, the second on 127.0.0.2 so that the ranks really are on two
hosts), each node with 4 logical CPUs and 2 logical GPUs, started once for the package (Ray
takes tens of seconds to start on the busy 2-core machine) and shut down after its last test.

A process of one Ray cannot join another while it is connected, so every Ray test shares this
one; a test that needs another shape (node-level launch, a capacity error) changes nbdist's
Ray settings, never the cluster, except the node-loss test, which adds and removes a node of
its own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from nbdist.launch import ray as ray_backend

from ..helpers import none_left, rank_processes

ray = pytest.importorskip("ray")

#: The nodes: (address, CPUs, GPUs).
NODES = (("127.0.0.1", 4, 2), ("127.0.0.2", 4, 2))


#: Tries at starting the cluster: on the loaded 2-core machine a raylet may abort because its
#: dashboard agent did not write its port file within Ray's fixed 15 s.
START_TRIES = 3


def start_cluster() -> Any:
    """The two nodes, up and listed; raises what the last try raised."""
    from ray.cluster_utils import Cluster

    (head_ip, head_cpus, head_gpus), (ip, cpus, gpus) = NODES
    for attempt in range(START_TRIES):
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": head_cpus, "num_gpus": head_gpus, "node_ip_address": head_ip,
                "include_dashboard": False, "include_log_monitor": False})
            cluster.add_node(num_cpus=cpus, num_gpus=gpus, node_ip_address=ip,
                             include_log_monitor=False)
            return cluster
        except Exception:
            if cluster is not None:
                cluster.shutdown()
            if attempt == START_TRIES - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[Any]:
    """The package's two-node Ray cluster, with this process connected as its driver."""
    if _FAILED:  # pytest sets a failed fixture up again for every test: not another try
        raise _FAILED[0]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's daemons start at a higher priority than the rest of the machine's work, and its
    # dashboard agent in its minimal form (what `pip install ray` without [default] runs):
    # the raylet gives the agent a fixed 15 s to start, which six other helpers' test runs
    # on two cores can exceed. Neither changes what nbdist does on Ray.
    before = os.getpriority(os.PRIO_PROCESS, 0)
    saved = sys.modules.get("ray.dashboard.optional_deps", _MISSING)
    sys.modules["ray.dashboard.optional_deps"] = None  # type: ignore[assignment]
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -15)
    except OSError:  # not root: the default priority
        pass
    try:
        cluster = start_cluster()
    except Exception as exc:
        _FAILED.append(exc)
        raise
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before) if os.getuid() == 0 else None
        if saved is _MISSING:
            del sys.modules["ray.dashboard.optional_deps"]
        else:
            sys.modules["ray.dashboard.optional_deps"] = saved  # type: ignore[assignment]
    try:
        # The Cluster names the GCS at this machine's address; it listens on the head's.
        gcs = f"{NODES[0][0]}:{cluster.address.rsplit(':', 1)[1]}"
        ray.init(address=gcs, log_to_driver=False, _node_ip_address=NODES[0][0])
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray_backend.shutdown()
        ray.shutdown()
        cluster.shutdown()


_MISSING = object()
#: Why the cluster could not start, once it could not.
_FAILED: list[Exception] = []


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


@pytest.fixture
def no_leftover_ray() -> Iterator[None]:
    """After a Ray test: no rank, no nbdist actor and no nbdist placement group is left (10 s).
    Ray's own processes (raylets, idle workers) rightly outlive a test."""
    yield
    none_left(rank_processes)
    none_left(rank_hosts, what="nbdist's Ray actors left running after the test")
    from ..helpers import wait_for

    wait_for(lambda: not groups_left(), 10.0, "nbdist's placement groups to be removed")

"""Ray on real hosts of its own: a head node, where the notebook's Python runs (a cluster's head
node, or a KubeRay notebook pod), and two worker nodes with two logical GPUs each, every one a
network namespace with its own address, host name and temporary folder, joined by a private
bridge (``tests/multihost/hosts.py``), each running ``ray start`` as a real cluster's nodes do.

The driver is a Python process on the head (``ray.init("HEAD:6379")``): the ranks land on the
workers, reach the driver's event server across the bridge, meet at rank 0's node and
all-reduce. Everything runs in the hosts; the test reads what the driver printed and the hosts'
processes, and tears all of it down (``Network.down``), also when it fails.

This file runs before ``test_ray.py`` (file order): its nodes start before the package's own
cluster, and under ``make test`` before the version matrix's legs start beside the Ray tests
(a loaded machine makes Ray's raylet give up on its agents; docs/ray.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ..helpers import wait_for
from ..multihost.hosts import Network, missing

pytestmark = [pytest.mark.ray, pytest.mark.multihost, pytest.mark.torch, pytest.mark.slow,
              pytest.mark.timeout(600)]

#: The nodes: host name, CPUs, logical GPUs. Ranks take one GPU each, so they land on wa, wb.
NODES = (("head", 1, 0), ("wa", 2, 2), ("wb", 2, 2))
GCS_PORT = 6379
#: How long the three nodes may take to start and register (a loaded 2-core machine).
START_DEADLINE_S = 240

#: The driver, run on the head: connects to its node, waits for the others, runs 4 ranks and
#: prints what they saw, where they ran, and what was left of the job after it.
DRIVER = textwrap.dedent('''
    import json, os, socket, sys, time

    # The driver finds its node among the raylets it sees (all of this machine's: one PID
    # namespace), within Ray's 60 s for a GCS request by default; the head's raylet took
    # most of it under the start's load, and the request was left too little (fresh clone).
    os.environ["RAY_gcs_server_request_timeout_seconds"] = sys.argv[2]
    import ray

    import nbdist

    head, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
    ray.init(address=f"{head}:%d" % int(sys.argv[3]), _node_ip_address=head,
             log_to_driver=False)
    while len([n for n in ray.nodes() if n["Alive"]]) < 3:
        if time.monotonic() > deadline:
            sys.exit(f"only {ray.nodes()!r} registered")
        time.sleep(0.5)


    def where():
        import os, socket

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        keys = ("RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES")
        return {"sum": int(t.item()), "host": socket.gethostname(),
                **{k: os.environ.get(k, "") for k in keys}}


    job = nbdist.run(where, np=4, backend="ray", timeout=240)
    from ray.util.placement_group import placement_group_table

    def groups():  # nbdist's placement groups: removed as the job ends (30 s at most)
        return [g["state"] for g in placement_group_table().values()
                if g["name"].startswith("nbdist-")]

    end = time.monotonic() + 30
    while any(state != "REMOVED" for state in groups()) and time.monotonic() < end:
        time.sleep(0.2)
    print(json.dumps({"launcher": job.launcher.name, "results": job.results,
                      "hosts": [r.host for r in job.state.ranks], "groups": groups()}))
    ray.shutdown()
''')


def ray_start(net: Network, name: str, cpus: int, gpus: int, head_ip: str,
              started: list[subprocess.Popen[bytes]]) -> None:
    """``ray start --block`` on host ``name``: the head's, or a worker joining it. The agents'
    ports are given (the raylet then does not wait for their port files); each host has its
    own address space, so the same numbers serve every host."""
    host = net[name]
    argv = [str(Path(sys.executable).parent / "ray"), "start", "--block",
            "--node-ip-address", host.ip, "--num-cpus", str(cpus), "--num-gpus", str(gpus),
            "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats",
            "--temp-dir", str(net.tmpdir(name) / "ray"),
            "--dashboard-agent-listen-port", "52365", "--dashboard-agent-grpc-port", "52366",
            "--metrics-export-port", "52367", "--runtime-env-agent-port", "52368"]
    if name == "head":
        argv += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
    else:
        argv += ["--address", f"{head_ip}:{GCS_PORT}"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_agent_register_timeout_ms": str(START_DEADLINE_S * 1000),
           "RAY_gcs_server_request_timeout_seconds": str(START_DEADLINE_S)}
    with open(net.tmpdir(name) / "ray-start.log", "wb") as log:
        started.append(subprocess.Popen([*net.prefix(name), *argv], stdout=log,
                                        stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True))


def wait_for_start(net: Network, name: str, proc: subprocess.Popen[bytes]) -> bool:
    """Whether host ``name``'s ``ray start --block`` said its runtime started (False when it
    exited first); bounded by ``START_DEADLINE_S``."""
    import time

    log = net.tmpdir(name) / "ray-start.log"
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        try:
            if "Ray runtime started" in log.read_text(errors="replace"):
                return True
        except OSError:
            pass
        if proc.poll() is not None:
            return False
        time.sleep(0.5)  # `ray start` offers nothing to wait on but its output
    return False


def said(net: Network) -> str:
    """What each host's ``ray start`` printed last: why a node did not come up."""
    out = []
    for name, _, _ in NODES:
        try:
            tail = (net.tmpdir(name) / "ray-start.log").read_text(errors="replace")[-1500:]
        except OSError:
            tail = "(no log)"
        out.append(f"--- {name}:\n{tail}")
    return "\n".join(out)


@pytest.fixture
def ray_hosts() -> Iterator[Network]:
    """The three hosts with a Ray node each (the head first, then the workers, once the head's
    GCS answers); torn down with every process in them."""
    if why := missing():
        pytest.skip(why)
    Network.clean_leftovers()
    net = Network([name for name, _, _ in NODES])
    started: list[subprocess.Popen[bytes]] = []
    try:
        net.up()
        head_ip = net["head"].ip
        ray_start(net, "head", NODES[0][1], NODES[0][2], head_ip, started)
        probe = (f"import socket, time\nend = time.monotonic() + {START_DEADLINE_S}\n"
                 f"while True:\n    try:\n        socket.create_connection(('{head_ip}', "
                 f"{GCS_PORT}), 2).close()\n        break\n    except OSError:\n"
                 f"        assert time.monotonic() < end, 'no GCS'\n        time.sleep(0.5)\n")
        try:
            net.run("head", [sys.executable, "-c", probe], timeout=START_DEADLINE_S + 30)
        except Exception as exc:
            pytest.fail(f"the head's Ray did not start ({exc}):\n{said(net)}", pytrace=False)
        for name, cpus, gpus in NODES[1:]:
            ray_start(net, name, cpus, gpus, head_ip, started)
        for i, (name, cpus, gpus) in enumerate(NODES[1:], start=1):
            # Ray gives a node's raylet a fixed 30 s to register (ray/_private/node.py), which
            # a loaded machine exceeds; `ray start` then exits: once, it is started again.
            if not wait_for_start(net, name, started[i]):
                ray_start(net, name, cpus, gpus, head_ip, started)  # the exited one stays listed
        yield net
    finally:
        net.down()  # every process in the hosts, ``ray start`` among them
        for proc in started:
            proc.wait(timeout=30)


def test_ranks_on_ray_worker_hosts_meet_at_rank_0s_node_and_leave_nothing(
    ray_hosts: Network, tmp_path: Path,
) -> None:
    """A driver on the head runs 4 GPU ranks: two on each worker host, numbered per node,
    MASTER_ADDR rank 0's host, an all-reduce over the bridge; afterwards no nbdist actor or
    rank is left on any host and the placement group is removed."""
    net = ray_hosts
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    try:
        out = net.run("head", [sys.executable, str(script), net["head"].ip,
                               str(START_DEADLINE_S), str(GCS_PORT)],
                      timeout=START_DEADLINE_S + 300)
    except Exception as exc:
        pytest.fail(f"the driver on the head failed: {exc}\n{said(net)}", pytrace=False)
    seen = json.loads(out.strip().splitlines()[-1])
    results, hosts = seen["results"], seen["hosts"]
    assert seen["launcher"] == "ray"
    assert [r["sum"] for r in results] == [4] * 4
    assert sorted({r["host"] for r in results}) == ["wa", "wb"]  # not the head: no GPUs there
    assert {hosts[0], hosts[2]} == {net["wa"].ip, net["wb"].ip}
    assert hosts[0] == hosts[1] and results[0]["host"] == results[1]["host"]
    assert [r["LOCAL_RANK"] for r in results] == ["0", "1", "0", "1"]
    assert [r["NODE_RANK"] for r in results] == ["0", "0", "1", "1"]
    assert {r["MASTER_ADDR"] for r in results} == {hosts[0]}
    for r in results:  # a node's two logical GPUs; the rank's own in LOCAL_RANK's place
        assert sorted(r["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
    assert all(state == "REMOVED" for state in seen["groups"]), seen["groups"]

    def left() -> list[str]:
        found = []
        for name in ("wa", "wb"):
            for p in net.processes(name):
                try:
                    line = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                if "RankHost" in line or "nbdist.rank.runtime" in line:
                    found.append(f"{name}: {line[:80]}")
        return found

    wait_for(lambda: not left(), 30, "nbdist's actors and ranks on the worker hosts to end")

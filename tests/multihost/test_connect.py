"""nbdist on a Spark Connect session across hosts: the notebook is a Connect client of a
Connect server on the driver's host, an application of the multi-host cluster on two workers
(``conftest.py``'s ``mh_connect``); barrier stages go through ``mapInArrow(..., barrier=True)``
and cancel through job tags."""

from __future__ import annotations

import re

import pytest

from ..helpers import Gate
from .helpers import WORKERS, ranks_gone
from .hosts import Network
from .kernel import Kernel
from .test_cluster import (
    LOCAL_CODE,
    RAISES,
    RANK_ENV,
    TRAIN,
    USES_LOCAL_CODE,
    WAIT_UP,
    _check_world,
    _lines,
    _run_live,
)

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.slow,
              pytest.mark.timeout(600)]


def test_a_connect_cell_over_two_hosts_trains_with_live_output(
    mh_connect: Kernel, network: Network, gate: Gate
) -> None:
    """4 ranks on 2 hosts from a Connect client: output live, the torchrun environment and a
    GPU per rank by host, all_reduce and 20 DDP steps; the ranks reached the notebook's
    event server (nothing lost), at the address they were told for a Connect client."""
    kernel = mh_connect
    assert kernel.value("__import__('nbdist.launch.spark').launch.spark.is_connect(spark)")
    # The driver's name resolves to 127.0.1.1 there: the ranks are told its eth0 address.
    told = kernel.value("__import__('nbdist.launch.spark').launch.spark.SparkLauncher()"
                        ".driver_address().advertise")
    assert told == network["driver"].ip, told
    reply = _run_live(kernel, TRAIN.format(np=4, wait=gate.code(), keys=RANK_ENV), gate, 4)
    assert reply.error is None, reply.error
    assert "OutputLostWarning" not in reply.stderr, reply.stderr
    by_host = _check_world(kernel.value("envs"), 4, network)
    assert sorted(map(len, by_host.values())) == [2, 2]
    (detail,) = kernel.value("[c.detail for b, c in __import__('nbdist.launch.backends')"
                             ".launch.backends.capacities() if b == 'spark']")
    assert "2 executors, 4 cores" in detail and "estimated from the configuration" in detail, \
        detail


def test_the_notebooks_modules_reach_connect_ranks_on_hosts_that_lack_its_folder(
    mh_connect: Kernel,
) -> None:
    """On Connect, a module and a package in a folder only the driver's host has are imported
    by 4 ranks on the two workers from the copy shipped with the payload."""
    mh_connect.execute(LOCAL_CODE)
    mh_connect.execute(USES_LOCAL_CODE, timeout=300)
    got = mh_connect.value("got")
    assert [g[0] for g in got] == [7] * 4
    assert not any(g[1] for g in got), got  # the folder really is missing there
    assert len({g[2] for g in got}) == 2 and {g[2] for g in got} <= set(WORKERS), got


def test_a_rank_raising_on_another_host_fails_the_connect_job(
    mh_connect: Kernel, network: Network
) -> None:
    """On Connect, a rank raising on another host than rank 0's fails the cell naming it,
    with its traceback; every rank on every host is gone."""
    reply = mh_connect.fails(RAISES, timeout=300)
    up = _lines(reply.stdout, "up on ")
    culprit = re.search(r"rank (\d) of 4 failed: ValueError: bad shard on (\w+)", reply.error or "")
    assert culprit, reply.error
    rank, host = int(culprit.group(1)), culprit.group(2)
    assert up[rank] == host != up[0]
    assert 'raise ValueError(f"bad shard on {socket.gethostname()}")' in (reply.error or "")
    ranks_gone(network)


#: In the kernel: another query of the same Connect session, from a thread of its own, whose
#: one task says it started and waits for the gate.
OTHER_QUERY = """
import threading as _mh_threading

def _mh_other_query(batches):
    for batch in batches:
        open({started!r}, "w").close()
{wait}
        yield batch

_mh_other = []
_mh_thread = _mh_threading.Thread(target=lambda: _mh_other.append([tuple(r) for r in (
    spark.range(1, numPartitions=1).mapInArrow(_mh_other_query, "id long").collect())]))
_mh_thread.start()
_mh_deadline = _time.monotonic() + 300
while not __import__("os").path.exists({started!r}):
    assert _time.monotonic() < _mh_deadline, "the other query did not start"
    _time.sleep(0.1)  # its task runs on an executor: it says so in a file
"""

#: Three ranks (the slots the other query leaves, so on both hosts) that run until stopped.
ENDLESS3 = """%%distributed -np 3 --bg
import socket, time
print(f"up on {socket.gethostname()}", flush=True)
while True:
    time.sleep(0.05)
"""


def test_cancel_interrupts_only_the_jobs_own_tag(
    mh_connect: Kernel, network: Network, gate: Gate
) -> None:
    """``%dist_cancel`` of a Connect job interrupts its stage through its own tag at once (no
    grace), stopping its ranks on both hosts, while another query of the same session,
    running beside it, goes on and finishes."""
    kernel = mh_connect
    started = gate.path + ".started"
    kernel.execute(OTHER_QUERY.format(started=started, wait=gate.code(indent=" " * 8)),
                   timeout=320)
    try:
        kernel.execute("import nbdist.launch.spark as _mh_sb\n"
                       "_mh_grace, _mh_sb.CANCEL_GRACE_S = _mh_sb.CANCEL_GRACE_S, 0.0")
        kernel.execute(ENDLESS3, timeout=60)
        kernel.execute(WAIT_UP, timeout=320)
        hosts = kernel.value("sorted({r.host for r in _mh_job.state.ranks})")
        assert len(hosts) == 2, hosts
        reply = kernel.execute("%dist_cancel", timeout=60)
        assert re.search(r"job j\d+ cancelled", reply.stdout), reply.stdout
        kernel.execute("_mh_job.wait(60)", timeout=90)
        assert kernel.value("_mh_job.state.status") == "cancelled"
        # Spark's interrupt, not only the ranks' stop over the event channel: the stage's
        # operation was among those the job's own tag interrupted.
        assert kernel.value("list(_mh_job.launcher.interrupted)"), "interruptTag ended nothing"
    finally:
        gate.open()
        kernel.execute("_mh_sb.CANCEL_GRACE_S = _mh_grace\n_mh_thread.join(300)", timeout=320)
    assert kernel.value("_mh_other") == [[[0]]]

"""k GPUs per Spark task across hosts: a classic session with ``spark.task.resource.gpu.amount
= 2`` on two workers of two fake GPUs (``conftest.py``'s ``mh_nodes``): one barrier task per
host, each running two ranks side by side, as torchrun on each node would."""

from __future__ import annotations

import os
import signal

import pytest

from ..helpers import Gate
from .helpers import ranks_gone
from .hosts import Network
from .kernel import Kernel
from .test_cluster import RANK_ENV, TRAIN, _check_world, _lines, _run_live

pytestmark = [pytest.mark.multihost, pytest.mark.spark, pytest.mark.slow,
              pytest.mark.timeout(600)]


def test_two_gpus_per_task_place_two_ranks_on_each_host(
    mh_nodes: Kernel, network: Network, gate: Gate
) -> None:
    """``-np 4`` on tasks of 2 GPUs is 2 tasks, one per host: ranks 0-1 on one host and 2-3 on
    the other, with RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and CUDA_VISIBLE_DEVICES as
    torchrun sets them, output live, all_reduce and 20 DDP steps across the hosts."""
    kernel = mh_nodes
    reply = _run_live(kernel, TRAIN.format(np=4, wait=gate.code(), keys=RANK_ENV), gate, 4)
    assert reply.error is None, reply.error
    assert "OutputLostWarning" not in reply.stderr, reply.stderr
    envs = kernel.value("envs")
    by_host = _check_world(envs, 4, network)
    assert sorted(by_host.values()) == [[0, 1], [2, 3]], by_host
    for ranks in by_host.values():
        visible = envs[ranks[0]]["env"]["CUDA_VISIBLE_DEVICES"]
        assert sorted(visible.split(",")) == ["0", "1"]  # both GPUs of the task's host
    detail = kernel.value("[c.detail for b, c in __import__('nbdist.launch.backends')"
                          ".launch.backends.capacities() if b == 'spark']")
    assert "2 ranks each (one per GPU)" in detail[0], detail


#: Ranks in a collective loop that say where they are and their pid.
COLLECTIVE = """%%distributed -np 4
import os, socket, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
print(f"up on {socket.gethostname()} pid {os.getpid()}", flush=True)
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.1)
"""


def test_a_killed_rank_of_a_task_fails_the_job_naming_it(
    mh_nodes: Kernel, network: Network
) -> None:
    """Rank 3 (the second rank of the task on the other host) SIGKILLed mid-run: the job fails
    naming it and how it died, and nothing of either task is left running on either host."""
    kernel = mh_nodes
    msg_id = kernel.start(COLLECTIVE)
    live = kernel.collect(msg_id, timeout=300,
                          until=lambda r: len(_lines(r.stdout, "up on ")) == 4 or bool(r.error))
    assert live.error is None, live.error
    up = {rank: line.split() for rank, line in _lines(live.stdout, "up on ").items()}
    assert up[2][0] == up[3][0] != up[0][0], up  # the other host's task: ranks 2 and 3
    pid = int(up[3][2])
    assert any(p.pid == pid for p in network.processes(up[3][0]))
    os.kill(pid, signal.SIGKILL)
    reply = kernel.collect(msg_id, timeout=120)
    error = reply.error or ""
    assert "rank 3 of 4 failed: rank 3 was killed by SIGKILL" in error, error
    ranks_gone(network)  # both tasks' ranks, on both hosts

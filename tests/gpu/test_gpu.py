"""nbdist on real NVIDIA GPUs (marker ``gpu``): every test here skips without one.

They check what only a GPU can show: a rank forked from the zygote (which never started CUDA)
initialises CUDA and trains; NCCL's process group with one GPU per rank; a cell whose value is
a CUDA tensor; ``--gpu`` on the local backend; a session keeping a CUDA model between cells;
the panel naming each rank's GPU; a module that starts CUDA at import: ranks start fresh and
say why (``rank/fork_safety.py``); NCCL's flight recorder naming a hung all-reduce;
``%dist_check --gpu``; JAX finding the rank's GPU. With one GPU the multi-rank checks run on
one rank (NCCL refuses two ranks on one device). Run them alone with ``pytest -m gpu``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import nbdist
from nbdist import check
from nbdist import session as sessions
from nbdist.errors import DistributedError
from nbdist.launch import local
from nbdist.rank import fork_safety
from nbdist.rank.zygote import COMMAND

from ..helpers import run

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]

#: The GPUs this machine shows (``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi -L``); asking torch
#: would initialise CUDA in the test process, which plays the kernel here.
GPUS = local.visible_gpus()
if not GPUS:
    pytest.skip("no NVIDIA GPU here (nvidia-smi lists none)", allow_module_level=True)
torch = pytest.importorskip("torch")
#: Ranks for the multi-rank checks: one per GPU, at most four.
NP = min(len(GPUS), 4)


def train_on_gpu() -> dict[str, Any]:
    import os

    import torch

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 64, device=device)
    y = x.sum(1, keepdim=True)
    first = last = 0.0
    for step in range(50):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if step == 0 else first
        last = loss.item()
    return {"parent": os.getppid(), "first": first, "last": last,
            "device": str(next(model.parameters()).device),
            "name": torch.cuda.get_device_name(device)}


def test_a_rank_forked_from_the_zygote_initialises_cuda_and_trains() -> None:
    """A zygote-forked rank trains on its GPU, and the zygote itself never loaded CUDA."""
    first = nbdist.run(train_on_gpu, np=1, gpu=True).result(timeout=240)
    job = nbdist.run(train_on_gpu, np=1, gpu=True)
    second = job.result(timeout=240)
    rank = job.state.ranks[0]
    assert rank.start == "forked", f"started {rank.start}: {rank.start_why}"
    zygote = second["parent"]
    assert zygote in local.pool.pids()  # forked, not a fresh interpreter
    assert COMMAND in " ".join(psutil.Process(zygote).cmdline())
    for result in (first, second):
        assert result["device"] == "cuda:0" and result["last"] < result["first"] / 2
    # Still safe to fork: no CUDA driver started inside (a mapped libcuda.so is allowed).
    handles = [os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")]
    with open(f"/proc/{zygote}/maps") as maps:
        assert fork_safety.device_handles(handles, maps) == []


def nccl_all_reduce() -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    total = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(total)
    uuid = str(torch.cuda.get_device_properties(local_rank).uuid)
    dist.destroy_process_group()
    return {"sum": total.item(), "uuid": uuid, "visible": os.environ["CUDA_VISIBLE_DEVICES"],
            "gpu": os.environ["NBDIST_GPU"], "local_rank": local_rank}


def test_nccl_process_group_with_one_gpu_per_rank() -> None:
    """``init_process_group("nccl")`` works with one distinct GPU per rank."""
    results = nbdist.run(nccl_all_reduce, np=NP, gpu=True).results
    assert [r["sum"] for r in results] == [NP * (NP + 1) / 2] * NP
    assert len({r["uuid"] for r in results}) == NP  # each rank on a GPU of its own
    for rank, r in enumerate(results):
        assert r["gpu"] == GPUS[rank]
        assert r["visible"].split(",")[r["local_rank"]] == r["gpu"]


def test_local_gpu_flag_gives_each_rank_its_gpu() -> None:
    """``--gpu`` locally: CUDA_VISIBLE_DEVICES in LOCAL_RANK order, cuda:LOCAL_RANK its own."""

    def where() -> dict[str, Any]:
        import os

        import torch

        local_rank = int(os.environ["LOCAL_RANK"])
        return {"visible": os.environ["CUDA_VISIBLE_DEVICES"], "gpu": os.environ["NBDIST_GPU"],
                "count": torch.cuda.device_count(),
                "uuid": str(torch.cuda.get_device_properties(local_rank).uuid)}

    job = nbdist.run(where, np=NP, gpu=True)
    results = job.results
    assert job.gpu
    assert [r["gpu"] for r in results] == GPUS[:NP]
    assert all(r["visible"] == ",".join(GPUS[:NP]) and r["count"] == NP for r in results)
    assert len({r["uuid"] for r in results}) == NP


def test_a_cell_whose_value_is_a_cuda_tensor(ip: Any) -> None:
    """A CUDA tensor returned by rank 0 arrives in the notebook with its values."""
    value = run(ip, "%%distributed -np 1 --gpu\n"
                    "import os, torch\n"
                    "torch.arange(4.0, device=f\"cuda:{os.environ['LOCAL_RANK']}\") * 2")
    assert isinstance(value, torch.Tensor)
    assert value.device.type == "cuda" and value.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.fixture
def gpu_session(ip: Any) -> Iterator[sessions.Session]:
    run(ip, f"%dist_session start -np -{NP} --gpu")
    live = sessions.current()
    assert live is not None
    yield live
    if live.alive:
        live.stop()
    sessions._current = None


def test_a_session_keeps_a_cuda_model_between_cells(
    ip: Any, gpu_session: sessions.Session
) -> None:
    """A model moved to the GPU in one session cell is still there, trained, in the next."""
    run(ip, "%%distributed\n"
            "import os, torch\n"
            "device = torch.device('cuda', int(os.environ['LOCAL_RANK']))\n"
            "model = torch.nn.Linear(8, 1).to(device)\n"
            "before = model.weight.detach().clone()")
    run(ip, "%%distributed -o moved\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "model(torch.ones(4, 8, device=device)).sum().backward()\n"
            "opt.step()\n"
            "(model.weight.device.type, model.weight.device.index,\n"
            " bool((model.weight.detach() != before).any()))")
    assert ip.user_ns["moved"] == [("cuda", rank, True) for rank in range(NP)]


def test_the_panel_shows_each_ranks_gpu() -> None:
    """Each rank's row in the panel names the GPU it was given."""
    from nbdist.views.widget import Panel

    def noop() -> int:
        return int(os.environ["RANK"])

    job = nbdist.run(noop, np=NP, gpu=True)
    assert job.results == list(range(NP))
    panel = Panel(job.state)
    panel.render()
    for rank in range(NP):
        assert f"GPU {GPUS[rank]}" in panel.rows[rank].label.value


def test_a_module_that_starts_cuda_at_import_makes_ranks_start_fresh_and_says_so(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed module that initialises CUDA at import: the zygote does not fork, the
    ranks start fresh and work, and why names the module and the driver's handles."""
    site = tmp_path / "site-packages"  # what counts as installed, not the user's own code
    site.mkdir()
    (site / "nbdist_cuda_at_import.py").write_text("import torch\ntorch.cuda.init()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")])))

    def uses_it() -> float:
        import nbdist_cuda_at_import  # noqa: F401
        import torch

        return float(torch.ones(2, device="cuda").sum().item())

    assert nbdist.run(uses_it, np=1, gpu=True).result(timeout=240) == 2.0
    job = nbdist.run(uses_it, np=1, gpu=True)
    assert job.result(timeout=240) == 2.0
    rank = job.state.ranks[0]
    assert rank.start in ("warm", "fresh")
    assert rank.start_why.startswith(
        "the zygote cannot fork: module nbdist_cuda_at_import started the CUDA driver at "
        "import (the process holds /dev/nvidia"), rank.start_why


def nccl_hang() -> None:
    import os
    import time

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.ones(1000, device="cuda")
    dist.all_reduce(x)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e11))  # the stream is busy for a minute or more
    dist.all_reduce(x, async_op=True)  # queued behind it: recorded, never completed
    while True:
        time.sleep(0.05)


def test_a_hung_nccl_all_reduce_is_named_in_the_error() -> None:
    """NCCL keeps its own flight recorder: a job that times out in its third all-reduce says
    so, with NCCL named, as a gloo job does (``rank/flight.py``)."""
    job = nbdist.run(nccl_hang, np=1, gpu=True, timeout=30)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=240)
    message = str(info.value)
    assert info.value.reason == "timeout"
    assert "collectives: rank 0 waits in all_reduce #3 (1000 float32, nccl)" in message, message


def test_dist_check_on_gpus_names_them_and_sweeps_nccl() -> None:
    """``%dist_check --gpu``: each rank's GPU (name, memory, NVML's word), CUDA and NCCL
    versions, and an all-reduce sweep on NCCL; a healthy machine has no problems."""
    report = check.run_check(NP, gpu=True, timeout=240)
    text = report.text()
    assert report.ok, text
    for row in report.rows:
        assert "NVIDIA" in row[6] and " GB" in row[6], text
        cuda, _, nccl = row[4].partition("/")
        assert cuda[:2].isdigit() and nccl.count(".") == 2, text
    assert report.sweep and report.sweep[-1][0] >= 1 << 20, text


def jax_on_the_gpu() -> tuple[int, str, float]:
    import jax
    import jax.numpy as jnp

    jax.distributed.initialize()  # no arguments: nbdist's cluster (rank/jax_cluster.py)
    device = jax.local_devices()[0]
    return jax.process_count(), device.platform, float(jnp.arange(4.0).sum())


def test_jax_initialises_on_the_ranks_gpu() -> None:
    """``jax.distributed.initialize()`` with no arguments on a GPU rank: JAX sees its GPU."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip("needs jax")
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    results = nbdist.run(jax_on_the_gpu, np=1, gpu=True, env=env).results
    assert results == [(1, "gpu", 6.0)], results

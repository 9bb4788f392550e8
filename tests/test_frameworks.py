"""Frameworks without a launcher (docs/frameworks.md): plain JAX finds the job by itself.

``jax.distributed.initialize()`` with no arguments works on every rank because
``rank/jax_cluster.py`` adds nbdist to JAX's cluster detection. The unit tests run the hook on
a stand-in module shaped like ``jax._src.clusters`` (no JAX needed); the rank tests run real JAX
on CPU ranks (gloo collectives) and skip without it (``nbdist[jax]``). DeepSpeed's ZeRO-2
runs from the torchrun environment alone; that test skips without DeepSpeed (not installed by
CI: it compiles a C++ op on CPU ranks, minutes on a busy machine).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types
from typing import Any

import pytest

import nbdist
from nbdist.rank import jax_cluster
from nbdist.world import Hello, plan_world

needs_jax = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                               reason="needs jax (nbdist[jax])")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs deepspeed (pip install deepspeed)")


def _clusters_module() -> types.ModuleType:
    """A module shaped like ``jax._src.clusters``: a ClusterEnv whose subclasses register."""

    class ClusterEnv:
        _cluster_types: list[type] = []

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            cls._cluster_types.append(cls)

    class Other(ClusterEnv):
        name = "k8s"

    module = types.ModuleType("clusters")
    module.ClusterEnv = ClusterEnv  # type: ignore[attr-defined]
    return module


def test_the_coordinator_is_rank_zeros_host_and_its_held_port() -> None:
    """Every rank's NBDIST_JAX_COORDINATOR is rank 0's host and the port rank 0 held for JAX."""
    hellos = {0: Hello(0, "a", 29500, tf_port=1, jax_port=4242), 1: Hello(1, "b", tf_port=2)}
    envs = plan_world(hellos, 2, "r", "j")
    assert [envs[r]["NBDIST_JAX_COORDINATOR"] for r in (0, 1)] == ["a:4242", "a:4242"]
    assert envs[0]["MASTER_PORT"] == "29500"  # torch.distributed keeps its own port
    assert "NBDIST_JAX_COORDINATOR" not in plan_world({0: Hello(0, "a", 1)}, 1, "r", "j")[0]


def test_the_job_is_first_in_jaxs_detection_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """nbdist's ClusterEnv comes before JAX's own (Kubernetes would win on a pod) and answers
    from the rank's environment; registering twice adds it once."""
    clusters = _clusters_module()
    jax_cluster.register(clusters)
    jax_cluster.register(clusters)
    types_ = clusters.ClusterEnv._cluster_types
    assert [t.name for t in types_] == ["nbdist", "k8s"]
    mine = types_[0]
    monkeypatch.setenv("NBDIST_JAX_COORDINATOR", "10.0.0.5:4242")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("NBDIST_GPU", raising=False)
    assert mine.is_env_present()
    assert mine.get_coordinator_address(None, None) == "10.0.0.5:4242"
    assert mine.get_coordinator_address(None, "7000") == "10.0.0.5:7000"
    assert (mine.get_process_count(), mine.get_process_id()) == (4, 3)
    assert mine.get_local_process_id() is None  # CPUs: every device of the process
    monkeypatch.setenv("NBDIST_GPU", "5")
    assert mine.get_local_process_id() == 1  # its GPU among CUDA_VISIBLE_DEVICES
    monkeypatch.delenv("NBDIST_JAX_COORDINATOR")
    assert not mine.is_env_present()  # outside a job, JAX's own detection goes on


def test_the_hook_registers_when_the_module_is_imported_later(tmp_path) -> None:
    """The post-import hook runs once the clusters module is imported, by whoever imports it,
    and a fresh interpreter that never imports it is untouched."""
    pkg = tmp_path / "fakejax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clusters.py").write_text(textwrap.dedent("""
        class ClusterEnv:
            _cluster_types = []
            def __init_subclass__(cls, **kw):
                super().__init_subclass__(**kw)
                cls._cluster_types.append(cls)
    """))
    script = textwrap.dedent("""
        import sys
        from nbdist.rank import jax_cluster
        jax_cluster.CLUSTERS = "fakejax.clusters"
        jax_cluster.install()
        assert "fakejax.clusters" not in sys.modules
        import fakejax.clusters as c
        print([t.name for t in c.ClusterEnv._cluster_types])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['nbdist']"


def _jax_psum() -> tuple[int, int, float]:
    import jax  # imported after the rank started: the hook registers nbdist here
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.distributed.initialize()  # no arguments, as on SLURM
    mesh = Mesh(np.array(jax.devices()), ("i",))
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh,
                                  in_specs=P("i"), out_specs=P()))
    mine = np.array([jax.process_index() + 1.0], dtype=np.float32)
    value = total(jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), mine))
    return jax.process_count(), jax.process_index(), float(value[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_jax
def test_jax_distributed_initialize_needs_no_arguments_on_cpu_ranks() -> None:
    """On 3 CPU ranks, jax.distributed.initialize() finds the job: process_count is 3, each
    rank's process_index is its RANK, and a psum across processes adds 1 + 2 + 3."""
    results = nbdist.run(_jax_psum, np=3, gpu=False).results
    assert results == [(3, 0, 6.0), (3, 1, 6.0), (3, 2, 6.0)]


def _deepspeed_zero2() -> tuple[str, int, int, list[float], float, float]:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    deepspeed = importlib.import_module("deepspeed")  # untyped, and absent from CI

    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    before = sum(p.double().sum().item() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)  # no launcher, no init_distributed
    g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(5):
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(engine(x), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = sum(p.double().sum().item() for p in engine.module.parameters())
    return (str(dist.get_backend()), dist.get_world_size(), engine.zero_optimization_stage(),
            losses, before, after)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_deepspeed
def test_deepspeed_zero2_runs_without_its_launcher_on_cpu_ranks() -> None:
    """deepspeed.initialize with a ZeRO-2 dict config finds the job from nbdist's environment on
    2 CPU ranks (gloo): ranks train on different data and end with the same weights."""
    # The first use on a machine compiles DeepSpeed's shared-memory op; build it once here, so
    # the two ranks do not both wait on the build (minutes on a busy machine) under the job.
    subprocess.run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; "
                    "build_shm_op()"], check=True, timeout=1200, capture_output=True)
    results = nbdist.run(_deepspeed_zero2, np=2, gpu=False, timeout=600).results
    assert [r[:3] for r in results] == [("gloo", 2, 2), ("gloo", 2, 2)]
    assert results[0][3] != results[1][3]  # each rank its own data and losses
    assert results[0][4] == results[1][4] != results[0][5]  # the same start, trained
    assert results[0][5] == pytest.approx(results[1][5], abs=1e-9)  # gradients were reduced

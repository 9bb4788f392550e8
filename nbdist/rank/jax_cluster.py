"""JAX finds an nbdist job as it finds SLURM or Open MPI: ``jax.distributed.initialize()``.

JAX's cluster detection (``jax._src.clusters``) knows SLURM, Open MPI, Kubernetes and TPUs: a
``%%distributed`` rank is none of them, so ``jax.distributed.initialize()`` with no arguments
fails there ("coordinator_address should be defined"). JAX's documented way to add a cluster is
a subclass of ``ClusterEnv``, which registers itself when it is defined. This module defines one
for nbdist, *after* JAX itself is imported (a post-import hook on ``jax._src.clusters``), so a
rank that never imports JAX pays nothing, and puts it first: on a Kubernetes pod (KubeRay, a
Spark executor on Kubernetes) JAX's own Kubernetes detection would otherwise take over.

What it answers comes from the environment ``world.plan_world`` sets for every backend:
``NBDIST_JAX_COORDINATOR`` (rank 0's host and the port its supervisor reserved), ``WORLD_SIZE``,
``RANK``, and on GPUs ``LOCAL_RANK`` (the rank's own device among ``CUDA_VISIBLE_DEVICES``,
which lists its host's GPUs in local-rank order).

Runs on a rank; imports only the standard library (JAX is never imported from here).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: The module whose import defines ``ClusterEnv`` and registers JAX's own clusters.
CLUSTERS = "jax._src.clusters"
#: Set on every rank by ``world.plan_world``: ``host:port`` of JAX's coordinator (rank 0).
COORDINATOR = "NBDIST_JAX_COORDINATOR"


def install() -> None:
    """Make ``jax.distributed.initialize()`` find this rank's job, now or when JAX is imported."""
    module = sys.modules.get(CLUSTERS)
    if module is not None:  # imported before the rank started (a warm zygote's module)
        register(module)
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(CLUSTERS, register))


def register(clusters: ModuleType) -> None:
    """Define nbdist's ``ClusterEnv`` in JAX's ``clusters`` module, first in detection order."""
    base: Any = getattr(clusters, "ClusterEnv", None)
    types = getattr(base, "_cluster_types", None)
    if base is None or not isinstance(types, list):
        print("nbdist: this JAX has no ClusterEnv registry; pass coordinator_address, "
              "num_processes and process_id to jax.distributed.initialize() yourself "
              f"(they are in ${COORDINATOR}, $WORLD_SIZE and $RANK)", file=sys.stderr)
        return
    if any(getattr(t, "name", None) == "nbdist" for t in types):
        return

    class NbdistCluster(base):  # type: ignore[misc]
        """An nbdist rank: rank 0's supervisor reserved the coordinator's port."""

        name = "nbdist"
        opt_in_only_method = False

        @classmethod
        def is_env_present(cls) -> bool:
            return COORDINATOR in os.environ and "RANK" in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs: int | None = None,
                                    override_coordinator_port: str | None = None) -> str:
            address = os.environ[COORDINATOR]
            if override_coordinator_port:
                address = f"{address.rsplit(':', 1)[0]}:{override_coordinator_port}"
            return address

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ["WORLD_SIZE"])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ["RANK"])

        @classmethod
        def get_local_process_id(cls) -> int | None:
            # One device per rank on GPUs; on CPUs JAX keeps all of the process's devices.
            if "NBDIST_GPU" not in os.environ:
                return None
            return int(os.environ["LOCAL_RANK"])

    # Defining the class appended it; detection takes the first that is present.
    types.remove(NbdistCluster)
    types.insert(0, NbdistCluster)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` once, right after ``name`` has been imported, whoever imports it."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the search below must not find us again
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        then = self.then

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                then(module)
            except Exception as exc:  # JAX changed: the user can still pass the arguments
                print(f"nbdist: could not register the job with JAX ({exc!r}); pass "
                      "coordinator_address, num_processes and process_id to "
                      "jax.distributed.initialize() yourself", file=sys.stderr)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

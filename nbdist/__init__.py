"""nbdist: run a notebook cell on N distributed ranks.

In a notebook::

    %load_ext nbdist

    %%distributed -np 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    dist.get_rank()

From Python: ``nbdist.run(fn, *args, np=2).result()``. On a rank: ``nbdist.progress``,
``nbdist.report``, and ``nbdist.shard`` for its part of a table. This module is imported on
every rank, so it stays light: the engine and the magics load on first use.

The exceptions and warnings (drawn as a tree in :mod:`nbdist.errors` and docs/magics.md)::

    NbdistError (CaptureError, CapacityError, LaunchError, SessionError, ValuesDroppedError)
    DistributedError (a RuntimeError: ranks failed, timed out or were cancelled)
    CaptureWarning, OutputLostWarning, PullWarning (UserWarning)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

from nbdist._checkpoint import checkpoint_dir
from nbdist.errors import (
    CapacityError,
    CaptureError,
    CaptureWarning,
    DistributedError,
    LaunchError,
    NbdistError,
    OutputLostWarning,
    PullWarning,
    SessionError,
    ValuesDroppedError,
)
from nbdist.rank.reporting import progress, report
from nbdist.rank.shard import shard

if TYPE_CHECKING:
    from nbdist.elastic import ElasticJob
    from nbdist.job import Job

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "CaptureError",
    "CaptureWarning",
    "DistributedError",
    "LaunchError",
    "NbdistError",
    "OutputLostWarning",
    "PullWarning",
    "SessionError",
    "ValuesDroppedError",
    "checkpoint_dir",
    "load_ipython_extension",
    "progress",
    "report",
    "run",
    "shard",
    "unload_ipython_extension",
]


@overload
def run(fn: Any, *args: Any, max_restarts: int, **kwargs: Any) -> ElasticJob: ...


@overload
def run(fn: Any, *args: Any, checkpoint_dir: str, **kwargs: Any) -> ElasticJob: ...


@overload
def run(fn: Any, *args: Any, **kwargs: Any) -> Job: ...


def run(fn: Any, *args: Any, **kwargs: Any) -> Job | ElasticJob:
    """Run ``fn`` on N ranks; see :func:`nbdist.job.run` for the parameters.

    ``max_restarts=K`` launches every rank again after a fault, up to K times (with
    ``restart_on_error``, ``capacity_wait`` and ``checkpoint_dir``: :func:`nbdist.elastic.run`).
    """
    if _ELASTIC & kwargs.keys():
        from nbdist.elastic import run as _elastic_run

        return _elastic_run(fn, *args, **kwargs)
    from nbdist.job import run as _run

    return _run(fn, *args, **kwargs)


_ELASTIC = frozenset({"max_restarts", "restart_on_error", "capacity_wait", "checkpoint_dir"})


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbdist``: register ``%%distributed``, ``%dist_status``, ``%dist_cancel``."""
    from nbdist.magics import DistMagics

    magics = DistMagics(shell=ipython)
    ipython.register_magics(magics)
    if magics.warm_at_load:  # the first cell's zygote, started in the background
        from nbdist.launch.local import warm_at_load

        warm_at_load()


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbdist``: stop the session, the warm pool and the event servers, and
    remove the magics (refused while a job runs); see :func:`nbdist.magics.unload`."""
    from nbdist.magics import unload

    unload(ipython)

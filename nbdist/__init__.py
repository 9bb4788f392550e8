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
from nbdist._version import __version__ as __version__
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
from nbdist.handle import Handle
from nbdist.rank.reporting import progress, report
from nbdist.rank.shard import shard

if TYPE_CHECKING:
    from nbdist.elastic import ElasticJob
    from nbdist.job import Job


__all__ = [
    "CapacityError",
    "CaptureError",
    "CaptureWarning",
    "DistributedError",
    "Handle",
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
    """Run ``fn(*args, **kwargs)`` on N ranks and return its job (a :class:`Job`).

    nbdist keeps these keywords for itself, one for each option of ``%%distributed``
    (``nbdist.options.RUN_KEYWORDS``): ``np`` (ranks, default 2; negative: that many local
    ranks even when Spark is active), ``backend``, ``gpu``, ``timeout``, ``env``, ``mlflow``,
    ``log_dir`` (the fields of ``JobOptions``), and ``max_restarts``, ``restart_on_error``,
    ``capacity_wait``, ``checkpoint_dir`` (those of ``Restarts``: any of them makes a job
    that restarts, :func:`nbdist.elastic.run`). Every other keyword goes to ``fn``, whose
    signature is checked against the arguments before launch: a keyword it does not take is
    a TypeError naming the option of nbdist it is close to (``timout`` → ``timeout``). To
    give ``fn`` an argument named like one of nbdist's, bind it with ``functools.partial``.
    A bad option value is a ValueError naming it, before launch.
    """
    from nbdist.options import RUN_KEYWORDS, check_call

    ours = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_KEYWORDS}
    check_call(fn, args, kwargs)
    if _ELASTIC & ours.keys():
        from nbdist.elastic import run as _elastic_run

        return _elastic_run(fn, *args, **ours, **kwargs)
    from nbdist.job import run as _run

    return _run(fn, *args, **ours, **kwargs)


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

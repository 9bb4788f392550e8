"""The backend registry: which backend a job gets (``-np``, ``--backend``), what each backend
can run at once (``%dist_status``), and letting go of what the backends started
(``%unload_ext nbdist``). The job, the session and the magics ask here; none of them names a
backend's module.

A backend's module is imported only when a job uses it (Spark's only when a session is
active), and only a backend that was imported can have started anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from nbdist.launch import Capacity, Launcher

#: The backends by name, and their modules.
MODULES = {"local": "nbdist.launch.local", "spark": "nbdist.launch.spark"}


def choose(np: int, backend: str = "auto") -> tuple[Launcher, int]:
    """The launcher for ``np`` (negative: local even with Spark active) and the rank count."""
    if np == 0:
        raise ValueError("np must be a non-zero integer: N ranks, or -N for N local ranks")
    if backend not in ("auto", *MODULES):
        raise ValueError(f"unknown backend {backend!r}: use auto, local or spark")
    if backend == "spark" or (backend == "auto" and np > 0 and spark_session() is not None):
        if np < 0:
            raise ValueError("-np -N means local ranks; it cannot go with --backend spark")
        from nbdist.launch.spark import SparkLauncher

        return SparkLauncher(), np
    from nbdist.launch.local import LocalLauncher

    return LocalLauncher(), abs(np)


def same_backend(launcher: Launcher) -> Callable[[], Launcher]:
    """How to make a launcher like ``launcher`` again, from any thread (a job's restarts).

    The active SparkSession is the calling thread's: it is taken now, in the thread that
    started the job, since restarts are launched from a thread of the job's own.
    """
    if launcher.name == "spark":
        from nbdist.launch.spark import SparkLauncher, active_session

        session = active_session()
        return lambda: SparkLauncher(session)
    kind = type(launcher)
    return lambda: kind()


def spark_session() -> Any:
    """The active Spark session, or None; never imports Spark just to find out it is unused."""
    if "pyspark" not in sys.modules:
        return None
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    return SparkSession.getActiveSession()


def capacities() -> list[tuple[str, Capacity]]:
    """(backend, Capacity) of the local backend, and of Spark when a session is active
    (``%dist_status``)."""
    from nbdist.launch.local import LocalLauncher

    caps: list[tuple[str, Capacity]] = [("local", LocalLauncher().capacity())]
    if spark_session() is not None:
        try:
            launcher, _ = choose(1, "spark")
            caps.append(("spark", launcher.capacity()))
        except Exception as exc:  # no Spark backend here, or the cluster cannot be asked
            caps.append(("spark", Capacity(0, 0, f"unknown: {exc}")))
    return caps


def shutdown() -> None:
    """Let go of what the backends keep between jobs: the local warm pool's zygotes and
    interpreters, the Spark stop-button guard (pyspark's own SIGINT handler is back)."""
    for module in MODULES.values():
        loaded = sys.modules.get(module)  # nothing was started if it was never imported
        if loaded is not None:
            loaded.shutdown()

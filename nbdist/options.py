"""One typed options object from the magic to the ranks, as torchrun's ``LaunchConfig``: how a
job runs (``JobOptions``: backend, GPUs, timeout, environment, label, MLflow, log folder) and,
beside it, whether and how it restarts (``Restarts``). ``%%distributed``'s parser builds them
(``magics.parse_options``), ``nbdist.run`` from its keywords; the engine passes them on whole
(``elastic.start`` → ``ElasticJob`` → ``job.start`` → ``Job``, which maps them into the
launch request, ``protocol.LaunchRequest``). A new option is one field here and one parser
line there.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

#: The backends a job may ask for (``--backend``).
BACKENDS = ("auto", "local", "spark")


@dataclass(frozen=True)
class Restarts:
    """Whether a job restarts after a fault, and how (``nbdist.elastic``)."""

    #: Launch every rank again after a fault (a lost host, a signal), up to this many times;
    #: 0: one attempt.
    max_restarts: int = 0
    #: Restart after a Python exception of the cell too (taken for a bug otherwise).
    restart_on_error: bool = False
    #: Seconds a restart waits for the slots of N ranks (None: ``settings.capacity_wait``).
    capacity_wait: float | None = None
    #: What ``nbdist.checkpoint_dir()`` returns on the ranks: a path every rank can reach.
    checkpoint_dir: str | None = None

    def __post_init__(self) -> None:
        """A ValueError naming the option when the combination cannot run: every path that
        builds the options (the magic, ``nbdist.run``, a restart) gets it at construction."""
        if not _whole(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, not {self.max_restarts!r}")
        if self.restart_on_error and not self.max_restarts:
            raise ValueError("restart_on_error needs max_restarts: how many restarts to allow "
                             "(--max-restarts K)")
        if self.capacity_wait is not None and (
                not _number(self.capacity_wait) or self.capacity_wait < 0):
            raise ValueError(
                f"capacity_wait must be 0 or more seconds, not {self.capacity_wait!r}")
        if self.checkpoint_dir is not None and (
                not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir):
            raise ValueError(f"checkpoint_dir must be a path, not {self.checkpoint_dir!r}")

    def check(self) -> None:
        """Nothing left to check: a ``Restarts`` is valid once made (``__post_init__``)."""


@dataclass(frozen=True)
class JobOptions:
    """How a job runs, whatever starts it (the magic, ``nbdist.run``, a session, a restart)."""

    #: ``auto`` (Spark when a session is active and ``np`` > 0, else local), ``local``,
    #: ``spark``.
    backend: str = "auto"
    #: One GPU per rank; None: when the backend has GPUs.
    gpu: bool | None = None
    #: Seconds after which every rank is stopped and the job fails (None: never).
    timeout: float | None = None
    #: Extra environment variables for every rank.
    env: dict[str, str] = field(default_factory=dict)
    #: What ``%dist_status`` and the panel call the job (a function's name).
    label: str = ""
    #: Log rank 0's reported metrics into the notebook's active MLflow run (``--mlflow``).
    mlflow: bool = False
    #: Where every rank's complete log goes, ``rank-R.log`` (``--log-dir``; None: a folder of
    #: the job's under the temporary folder, ``nbdist.logfiles``).
    log_dir: str | None = None
    restarts: Restarts = field(default_factory=Restarts)

    def __post_init__(self) -> None:
        """A ValueError naming the option and the value given when the options cannot run
        (as torch's ``LaunchConfig.__post_init__``): refused where they are made."""
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: use auto, local or spark")
        if self.gpu is not None and not isinstance(self.gpu, bool):
            raise ValueError(f"gpu must be True, False or None, not {self.gpu!r}")
        if self.timeout is not None and (not _number(self.timeout) or self.timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds, not "
                             f"{self.timeout!r}")
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"env must map names to strings (every rank's environment), not "
                             f"{self.env!r}")
        if not isinstance(self.restarts, Restarts):
            raise ValueError(f"restarts must be a Restarts, not {self.restarts!r}")
        if self.log_dir is not None and (not isinstance(self.log_dir, str) or not self.log_dir):
            raise ValueError(f"log_dir must be a folder's path, not {self.log_dir!r}")

    def check(self) -> None:
        """Nothing left to check: ``JobOptions`` are valid once made (``__post_init__``)."""



def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _run_keywords() -> tuple[str, ...]:
    job = [f.name for f in fields(JobOptions) if f.name not in ("label", "restarts")]
    return ("np", *job, *(f.name for f in fields(Restarts)))


#: The keywords ``nbdist.run`` keeps for itself: ``np``, every field of ``JobOptions`` but
#: ``label`` and ``restarts``, and every field of ``Restarts`` (so every option of the magic).
#: A function a job runs gets none of them; pass such an argument with ``functools.partial``.
RUN_KEYWORDS = _run_keywords()
#: Those that make ``nbdist.run`` return a job that restarts (``elastic.ElasticJob``).
RESTART_KEYWORDS = frozenset(f.name for f in fields(Restarts))


def options_from(label: str, **keywords: Any) -> JobOptions:
    """``JobOptions`` (with its ``Restarts``) from ``nbdist.run``'s keywords (any of
    ``RUN_KEYWORDS`` but ``np``): one field each, checked as they are made."""
    restarts = {k: keywords.pop(k) for k in list(keywords) if k in RESTART_KEYWORDS}
    env = keywords.pop("env", None)
    if isinstance(keywords.get("log_dir"), str) and keywords["log_dir"]:
        keywords["log_dir"] = os.path.abspath(os.path.expanduser(keywords["log_dir"]))
    return JobOptions(label=label, env=dict(env) if isinstance(env, Mapping) else
                      ({} if env is None else env), restarts=Restarts(**restarts), **keywords)


def check_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """A TypeError before launch when ``fn(*args, **kwargs)`` cannot be called, naming the
    keyword that is close to one of ``nbdist.run``'s own (``timout`` → ``timeout``).

    Every rank would fail with the same TypeError; a typo of an option of nbdist would have
    reached the function as its argument. A function whose signature cannot be read (a
    builtin, a C extension's) is not checked.
    """
    if not callable(fn):
        raise TypeError(f"nbdist.run takes a function to run on every rank first, not a "
                        f"{type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
        hints, unknown = [], [k for k in kwargs if k not in signature.parameters]
        for key in unknown:
            close = difflib.get_close_matches(key, RUN_KEYWORDS, n=1, cutoff=0.75)
            if close:
                hints.append(f"{key}={kwargs[key]!r}: did you mean {close[0]}? ({close[0]} "
                             f"is an option of nbdist.run; a keyword it does not know goes to "
                             f"the function)")
        what = "; ".join(hints) if hints else (
            f"; nbdist.run's own keywords are {', '.join(RUN_KEYWORDS)}, the rest go to the "
            f"function" if unknown else "")
        if hints:
            what = f": {what}"
        params = ", ".join(str(p.replace(annotation=p.empty)) for p in
                           signature.parameters.values())
        raise TypeError(f"nbdist.run: {name}({params}) cannot be called with these "
                        f"arguments ({exc}){what}") from None

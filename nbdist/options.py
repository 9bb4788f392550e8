"""One typed options object from the magic to the ranks, as torchrun's ``LaunchConfig``: how a
job runs (``JobOptions``: backend, GPUs, timeout, environment, label, MLflow, log folder) and,
beside it, whether and how it restarts (``Restarts``). ``%%distributed``'s parser builds them
(``magics.parse_options``), ``nbdist.run`` from its keywords; the engine passes them on whole
(``elastic.start`` → ``ElasticJob`` → ``job.start`` → ``Job``, which maps them into the
launch request, ``protocol.LaunchRequest``). A new option is one field here and one parser
line there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def check(self) -> None:
        """A ValueError naming the option when the combination cannot run."""
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, not {self.max_restarts}")
        if self.restart_on_error and not self.max_restarts:
            raise ValueError("restart_on_error needs max_restarts: how many restarts to allow "
                             "(--max-restarts K)")
        if self.capacity_wait is not None and self.capacity_wait < 0:
            raise ValueError(
                f"capacity_wait must be 0 or more seconds, not {self.capacity_wait:g}")


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

    def check(self) -> None:
        """A ValueError naming the option when the options cannot run."""
        self.restarts.check()
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {self.timeout!r}")

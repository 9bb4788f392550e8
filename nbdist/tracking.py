"""MLflow, the way Databricks users log: the notebook's active run reaches the ranks.

When the notebook has an active MLflow run, every rank gets the standard variables
``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and ``MLFLOW_RUN_ID``: ``mlflow.log_metric``
on a rank (which starts, that is resumes, the run that ``MLFLOW_RUN_ID`` names) and
``mlflow.autolog()`` there log into the notebook's run. nbdist looks at MLflow only where the
notebook imported it already (``sys.modules``): importing it costs about a second, and a
notebook that never imported MLflow has no active run.

With ``--mlflow`` (``nbdist.run(..., mlflow=True)``) the driver also logs what rank 0 reports
(``nbdist.report``) into that run, with steps, through :class:`MetricsLogger`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: Settings of the notebook's environment the ranks need to reach the same store: a folder
#: store is refused by MLflow 3 unless this is set (local ranks inherit it anyway; Spark
#: executors do not).
PASSED_ON = ("MLFLOW_ALLOW_FILE_STORE",)
#: The driver logs rank 0's metrics in batches, at most this often (each batch is one request
#: to the tracking server, or one write to its store).
FLUSH_S = 1.0
#: Most values queued for MLflow; beyond that the oldest go (a store slower than the reports).
MAX_QUEUED = 100_000


def _active_run() -> Any:
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return None
    try:
        return mlflow.active_run()
    except Exception:  # a half-imported or broken mlflow: no run to share
        return None


def run_env() -> dict[str, str]:
    """The ``MLFLOW_*`` variables for the ranks, when the notebook has an active run; else {}."""
    run = _active_run()
    if run is None:
        return {}
    mlflow = sys.modules["mlflow"]
    env = {
        "MLFLOW_TRACKING_URI": str(mlflow.get_tracking_uri()),
        "MLFLOW_EXPERIMENT_ID": str(run.info.experiment_id),
        "MLFLOW_RUN_ID": str(run.info.run_id),
    }
    env.update({k: os.environ[k] for k in PASSED_ON if k in os.environ})
    return env


def _numbers(values: dict[str, Any]) -> tuple[dict[str, float], int | None]:
    """The reported values MLflow takes (numbers), and the ``step`` reported with them."""
    step = values.get("step")
    step = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) \
        and math.isfinite(step) else None
    nums = {str(k): float(v) for k, v in values.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return nums, step


class MetricsLogger:
    """Logs rank 0's reported metrics into an MLflow run from the driver, with steps.

    Each ``put`` is one report as it reached the driver: the channel sends metrics at most a
    few times a second per rank and merges those reported in between (``rank.client.LAZY_S``), so
    this logs the latest value of each metric per send, not every value reported. A reported
    ``step`` is the step of the values sent with it; without one, a metric's step counts its
    values logged so far (0, 1, 2, ...). Logging runs on its own thread, never on the event
    server's: a slow tracking server does not hold up the channel.

    Parameters
    ----------
    run_id, tracking_uri : str
        The run to log into, and where its tracking server or store is.
    """

    def __init__(self, run_id: str, tracking_uri: str) -> None:
        import mlflow  # the notebook imported it already (see for_active_run)

        self.run_id = run_id
        self._client = mlflow.MlflowClient(tracking_uri)
        self._metric = mlflow.entities.Metric
        self._queue: list[tuple[dict[str, float], int | None, int]] = []
        self._steps: dict[str, int] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._failed = False
        #: Values logged so far.
        self.logged = 0
        # Started by the first report: a job that reports nothing (or fails to launch)
        # leaves no thread behind.
        self._thread = threading.Thread(target=self._loop, daemon=True, name="nbdist-mlflow")

    @classmethod
    def for_active_run(cls) -> MetricsLogger:
        """A logger into the notebook's active run; ValueError (naming the fix) without one."""
        run = _active_run()
        if run is None:
            why = ("MLflow is not imported in this notebook" if "mlflow" not in sys.modules
                   else "the notebook has no active MLflow run")
            raise ValueError(
                f"--mlflow (mlflow=True) logs rank 0's metrics into the notebook's active "
                f"MLflow run, but {why}: `import mlflow; mlflow.start_run()` first"
            )
        return cls(str(run.info.run_id), str(sys.modules["mlflow"].get_tracking_uri()))

    def put(self, values: dict[str, Any]) -> None:
        """Queue one report of rank 0 (called on the event server's thread: no I/O here)."""
        nums, step = _numbers(values)
        if not nums:
            return
        with self._cond:
            if len(self._queue) >= MAX_QUEUED:
                del self._queue[0]
            self._queue.append((nums, step, int(time.time() * 1000)))
            if not self._thread.is_alive() and not self._closing:
                self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Log what is queued, then stop (waits at most ``timeout`` for the store)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing, FLUSH_S)
                batch, self._queue = self._queue, []
                closing = self._closing
            if batch:
                self._log(batch)
            if closing:
                return

    def _log(self, batch: list[tuple[dict[str, float], int | None, int]]) -> None:
        metrics = []
        for nums, step, ms in batch:
            for key, value in nums.items():
                n = self._steps.get(key, 0)
                self._steps[key] = n + 1
                metrics.append(self._metric(key, value, ms, n if step is None else step))
        try:
            for start in range(0, len(metrics), 1000):  # MLflow takes 1000 per batch at most
                self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])
        except Exception as exc:  # the store is out of reach: say so once, keep the job going
            if not self._failed:
                self._failed = True
                log.warning("nbdist: logging rank 0's metrics to MLflow run %s failed: %s",
                            self.run_id, exc)
            return
        self.logged += len(metrics)

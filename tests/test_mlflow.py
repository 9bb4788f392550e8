"""MLflow: the notebook's active run reaches the ranks, and ``mlflow=True`` logs rank 0's
reported metrics into it; with the real ``mlflow`` (``mlflow-skinny``) and a folder store."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbdist

# Not a module-level `import mlflow`: the ranks import this module for the functions they run
# (2.8 CPU-seconds of mlflow's import each, where the function does not use it).
if importlib.util.find_spec("mlflow") is None:
    pytest.skip("needs mlflow (pip install nbdist[mlflow])", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _mlflow() -> Any:
    import mlflow

    return mlflow


@pytest.fixture
def notebook_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """An active MLflow run in a folder store under ``tmp_path``, ended after the test."""
    mlflow = _mlflow()

    # MLflow 3 refuses a folder store unless asked; mlflow-skinny has no sqlite store.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    run = mlflow.start_run()
    try:
        yield run
    finally:
        mlflow.end_run()
        mlflow.set_tracking_uri(None)


def _log_on_rank_0() -> dict[str, str]:
    import os

    import mlflow

    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    if os.environ["RANK"] == "0":
        mlflow.log_metric("rank_loss", 0.25, step=7)
    return env


def test_rank_0_logs_into_the_notebooks_active_run(notebook_run: Any) -> None:
    """The ranks get the run's MLFLOW_* variables; mlflow.log_metric on rank 0 lands in it,
    and the run stays the notebook's, running."""
    mlflow = _mlflow()

    job = nbdist.run(_log_on_rank_0, np=2, backend="local")
    job.result(timeout=150)
    envs = job.results
    assert len(envs) == 2
    info = notebook_run.info
    for env in envs:
        assert env["MLFLOW_RUN_ID"] == info.run_id
        assert env["MLFLOW_EXPERIMENT_ID"] == info.experiment_id
        assert env["MLFLOW_TRACKING_URI"] == mlflow.get_tracking_uri()
    history = mlflow.MlflowClient().get_metric_history(info.run_id, "rank_loss")
    assert [(m.value, m.step) for m in history] == [(0.25, 7)]
    assert mlflow.active_run().info.run_id == info.run_id
    assert mlflow.get_run(info.run_id).info.status == "RUNNING"


def _autolog_on_rank_0() -> None:
    import os

    import mlflow
    from sklearn.linear_model import LinearRegression

    if os.environ["RANK"] == "0":
        mlflow.autolog(log_models=False, log_datasets=False, silent=True)
        LinearRegression(fit_intercept=False).fit([[0.0], [1.0], [2.0]], [0.0, 2.0, 4.0])


def test_autolog_on_rank_0_logs_into_the_notebooks_run(notebook_run: Any) -> None:
    """mlflow.autolog() on rank 0 records a scikit-learn fit's parameters in the notebook's
    run."""
    mlflow = _mlflow()

    nbdist.run(_autolog_on_rank_0, np=2, backend="local").result(timeout=150)
    params = mlflow.get_run(notebook_run.info.run_id).data.params
    assert params.get("fit_intercept") == "False"


def _report(n: int) -> None:
    import time

    import nbdist

    for step in range(n):
        nbdist.report(loss=1.0 / (step + 1), step=step, note="text is not a metric")
        time.sleep(0.4)  # longer than the channel's merging of metrics (rank.client.LAZY_S)


def test_mlflow_option_logs_rank_0s_reports_with_their_steps(notebook_run: Any) -> None:
    """With mlflow=True the driver logs what rank 0 reports, each value at its step, by the
    time the job's result is there."""
    mlflow = _mlflow()

    nbdist.run(_report, 4, np=2, backend="local", mlflow=True).result(timeout=150)
    history = mlflow.MlflowClient().get_metric_history(notebook_run.info.run_id, "loss")
    steps = [m.step for m in history]
    assert steps == sorted(steps) and steps[-1] == 3, steps
    assert {m.step: m.value for m in history}[3] == pytest.approx(0.25)
    assert not mlflow.MlflowClient().get_metric_history(notebook_run.info.run_id, "note")


def test_mlflow_option_without_an_active_run_says_how_to_start_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow=True with no active run is refused before launch, naming mlflow.start_run()."""
    mlflow = _mlflow()

    assert mlflow.active_run() is None
    with pytest.raises(ValueError, match=r"no active MLflow run: .*mlflow.start_run\(\)"):
        nbdist.run(_report, 1, np=2, backend="local", mlflow=True)


def test_magic_mlflow_option_logs_rank_0s_reports(ip: Any, notebook_run: Any) -> None:
    """%%distributed --mlflow logs rank 0's reports into the notebook's run."""
    mlflow = _mlflow()

    ip.run_cell_magic("distributed", "-np 2 --mlflow --quiet",
                      "import nbdist\nnbdist.report(acc=0.5, step=2)\n")
    history = mlflow.MlflowClient().get_metric_history(notebook_run.info.run_id, "acc")
    assert [(m.value, m.step) for m in history] == [(0.5, 2)]


def _report_then_die_once(reported: str) -> None:
    import os
    import time

    import nbdist

    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    nbdist.report(loss=1.0 + count, step=count)  # the first report is sent at once
    if os.environ["RANK"] == "0":
        open(f"{reported}.{count}", "w").close()
    if count == 0 and os.environ["RANK"] == "1":
        # Not before rank 0 reported: on a busy machine rank 0 may start later than rank 1,
        # and nbdist stops it when rank 1 dies.
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{reported}.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), 9)
    if count == 0:
        import time

        time.sleep(60)  # until nbdist stops it after rank 1's death


def test_mlflow_option_logs_every_attempt_of_a_job_that_restarts(
    notebook_run: Any, tmp_path: Path,
) -> None:
    """With max_restarts, rank 0's reports of every attempt land in the notebook's run (the
    restart starts from a thread of nbdist's own, where MLflow's active run is not set), and
    the restarted ranks keep the run's MLFLOW_* variables."""
    mlflow = _mlflow()

    job = nbdist.run(_report_then_die_once, str(tmp_path / "reported"), np=2, backend="local",
                     mlflow=True, max_restarts=1)
    job.result(timeout=150)
    assert len(job.attempts) == 2
    history = mlflow.MlflowClient().get_metric_history(notebook_run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 2.0)]

"""The options of a job, the kernel's settings and the one result handle: refused where they are
made, every option of the magic a keyword of ``nbdist.run``, and an outcome set once."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

import nbdist
from nbdist import handle
from nbdist.options import RUN_KEYWORDS, JobOptions, Restarts, check_call
from nbdist.settings import Settings, settings
from nbdist.state import JobState


@pytest.mark.parametrize(("make", "match"), [
    (lambda: JobOptions(timeout=-1), r"timeout must be a positive number of seconds, not -1"),
    (lambda: JobOptions(timeout=float("nan")), r"timeout must be .* not nan"),
    (lambda: JobOptions(backend="ray-ish"), r"unknown backend 'ray-ish'"),
    (lambda: JobOptions(gpu="yes"), r"gpu must be True, False or None"),  # type: ignore[arg-type]
    (lambda: JobOptions(env={"A": 1}), r"env must map names to strings"),  # type: ignore[dict-item]
    (lambda: JobOptions(log_dir=""), r"log_dir must be a folder's path"),
    (lambda: Restarts(max_restarts=-1), r"max_restarts must be 0 or more, not -1"),
    (lambda: Restarts(restart_on_error=True), r"restart_on_error needs max_restarts"),
    (lambda: Restarts(max_restarts=1, capacity_wait=-2), r"capacity_wait must be 0 or more"),
])
def test_options_are_refused_where_they_are_made(make: Any, match: str) -> None:
    """A bad option is a ValueError naming it and the value given, at construction."""
    with pytest.raises(ValueError, match=match):
        make()


def test_every_option_of_the_magic_is_a_keyword_of_run() -> None:
    """``nbdist.run``'s own keywords are np and the fields of JobOptions and Restarts, log_dir
    among them."""
    assert set(RUN_KEYWORDS) == {
        "np", "backend", "gpu", "timeout", "env", "mlflow", "log_dir", "max_restarts",
        "restart_on_error", "capacity_wait", "checkpoint_dir"}


def _takes_lr(lr: float) -> float:
    return lr


def test_a_keyword_close_to_an_option_is_refused_before_launch() -> None:
    """``timout=5`` names ``timeout``; a wrong call of the function fails before any rank."""
    with pytest.raises(TypeError, match=r"timout=5: did you mean timeout\?"):
        nbdist.run(_takes_lr, 0.1, np=1, timout=5)
    with pytest.raises(TypeError, match=r"_takes_lr\(lr\) cannot be called .*missing a requ"):
        nbdist.run(_takes_lr, np=1)
    with pytest.raises(TypeError, match="np, backend, gpu"):
        check_call(_takes_lr, (0.1,), {"learning": 1})
    check_call(_takes_lr, (), {"lr": 0.1})  # a good call passes
    check_call(print, (1, 2), {"sep": ""})  # builtins are not refused


def _where() -> str:
    print("hello from rank", os.environ["RANK"])
    return os.environ["RANK"]


@pytest.mark.slow
def test_run_takes_a_log_dir(tmp_path: Path) -> None:
    """``nbdist.run(..., log_dir=...)`` writes each rank's log there, as ``--log-dir`` does."""
    job = nbdist.run(_where, np=1, backend="local", log_dir=str(tmp_path))
    assert job.result() == "0"
    assert job.state.log_dir == str(tmp_path)
    assert "hello from rank 0" in (tmp_path / "rank-0.log").read_text()


@pytest.mark.parametrize(("name", "value"), [
    ("view", "fancy"), ("large_value_mb", 0), ("history", 0), ("history_mb", -1.0),
    ("driver_port", 70000), ("heartbeat_timeout", 5.0), ("capacity_wait", -1.0),
    ("stacks_when_quiet", 0), ("warm_at_load", "no"),
])
def test_a_setting_is_checked_when_set(name: str, value: Any) -> None:
    """Every knob refuses a bad value with its name, and keeps the one it had."""
    fresh = Settings()
    before = getattr(fresh, name)
    with pytest.raises(ValueError, match=f"DistMagics.{name} takes"):
        setattr(fresh, name, value)
    assert getattr(fresh, name) == before


def test_an_unknown_setting_names_the_known_ones() -> None:
    """A misspelt knob is an AttributeError listing them all."""
    with pytest.raises(AttributeError, match="no setting 'histroy_mb'.*history_mb"):
        Settings().histroy_mb = 3


def test_config_reaches_the_one_settings_object(ip: Any) -> None:
    """``%config DistMagics.<name>`` sets ``nbdist.settings.settings``, for every knob."""
    from traitlets import TraitError

    magics = ip.magics_manager.registry["DistMagics"]
    try:
        ip.run_line_magic("config", "DistMagics.history_mb = 12.5")
        ip.run_line_magic("config", "DistMagics.view = 'text'")
        assert settings.history_mb == 12.5 and settings.history_bytes == int(12.5 * 2**20)
        assert settings.view == "text"
        with pytest.raises(TraitError, match="history_mb takes a positive number"):
            magics.history_mb = 0.0
        assert settings.history_mb == 12.5
    finally:
        ip.run_line_magic("config", "DistMagics.history_mb = 256.0")
        ip.run_line_magic("config", "DistMagics.view = 'auto'")


class _Work(handle.Handle):
    """A handle without ranks: the outcome is what a test settles it with."""

    noun = "job"

    def __init__(self) -> None:
        super().__init__()
        self.id, self.np = handle.new_id("t"), 2
        self.state = JobState(self.id, "test", 2)

    def wait(self, timeout: float | None = None, on_tick: Any = None) -> bool:
        return self._done.wait(timeout)

    def cancel(self, reason: str = "cancelled by the user") -> None:
        self._settle(RuntimeError(reason))


def test_an_outcome_is_set_once_and_done_follows_the_close() -> None:
    """``_settle`` sets the outcome once (a second call changes nothing), runs the close
    before ``done()`` turns true, and the values are readable then."""
    work = _Work()
    seen: list[bool] = []

    def close() -> None:
        seen.append(work.done())
        work.state.finish("done", "")

    assert work._settle(None, close, values={0: "a", 1: "b"}, size=2)
    assert seen == [False] and work.done() and work.state.status == "done"
    assert not work._settle(RuntimeError("late"), close, values={0: "x"})
    work.cancel("late")
    assert work.error is None
    assert work.result() == "a" and work.results == ["a", "b"] and seen == [False]


def test_concurrent_ends_settle_one_outcome() -> None:
    """Of many threads ending the same work at once, exactly one sets its outcome."""
    work = _Work()
    won: list[int] = []
    start = threading.Barrier(8)

    def end(i: int) -> None:
        start.wait()
        if work._settle(RuntimeError(str(i))):
            won.append(i)

    threads = [threading.Thread(target=end, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and str(work.error) == str(won[0])

"""Restarts after a fault (``--max-restarts``): the judge's rules, real local ranks killed from
outside, the capacity wait, and the usage errors of the magics."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

import nbdist
import nbdist.launch.backends
from nbdist import elastic, settings, state
from nbdist.elastic import AttemptEnd, judge
from nbdist.protocol import RankOutcome, RankStatus
from nbdist.views import status

from .helpers import wait_for

pytestmark = pytest.mark.timeout(300)


# -- the judge (pure) -----------------------------------------------------------------------------
def _raised(rank: int, kind: str = "ValueError", message: str = "boom") -> RankOutcome:
    return RankOutcome(rank, RankStatus.FAILED, error={"type": kind, "message": message,
                                              "traceback": f"{kind}: {message}\n"})


def _end(*outcomes: RankOutcome, reason: str = "failed", **kw: Any) -> AttemptEnd:
    error = nbdist.DistributedError("x", reason=reason)
    return AttemptEnd(error, {o.rank: o for o in outcomes}, kw.pop("lost_hosts", {}), **kw)


@pytest.mark.parametrize(("end", "rule", "restart"), [
    (_end(_raised(0), _raised(1)), "same exception", False),
    (_end(_raised(0), RankOutcome(1, RankStatus.CANCELLED)), "same exception", False),
    (_end(_raised(0), _raised(1, message="other")), "exception", False),
    (_end(_raised(0), RankOutcome(1, RankStatus.FAILED, exit_code=-9)), "signal", True),
    (_end(RankOutcome(0, RankStatus.FAILED, exit_code=3)), "exit", True),
    (_end(RankOutcome(0, RankStatus.FAILED, lost_host="10.0.0.4",
                      error={"type": "ExecutorLost", "message": "", "traceback": ""}),
          _raised(1, "RuntimeError", "Connection closed by peer")), "lost host", True),
    (_end(RankOutcome(0, RankStatus.CANCELLED), lost_hosts={1: "10.0.0.5"}), "lost host", True),
    (_end(RankOutcome(0, RankStatus.FAILED, exit_code=-9), reason="timeout"), "timeout", False),
    (_end(RankOutcome(0, RankStatus.FAILED, exit_code=-9), cancelled=True), "cancelled", False),
    (_end(RankOutcome(0, RankStatus.DONE), RankOutcome(1, RankStatus.DONE)), "other", False),
])
def test_judge_rules(end: AttemptEnd, rule: str, restart: bool) -> None:
    """Faults (lost hosts, signals, exits) restart; the cell's exceptions, cancels and
    timeouts do not; the verdict names the rule that decided."""
    verdict = judge(end)
    assert (verdict.rule.name, verdict.restart) == (rule, restart)
    assert f"rule '{rule}'" in verdict.text()


def test_restart_on_error_turns_exceptions_into_restarts() -> None:
    """With restart_on_error, the exception rules restart; cancels still do not."""
    assert judge(_end(_raised(0), _raised(1)), restart_on_error=True).restart
    assert judge(_end(_raised(0), _raised(1, message="x")), restart_on_error=True).restart
    assert not judge(_end(_raised(0), cancelled=True), restart_on_error=True).restart


def test_state_through_attempts_keeps_logs_and_resets_ranks() -> None:
    """A new attempt resets every rank (state, progress) but keeps and marks their logs; the
    header, the text view and %dist_status JOB show the attempts."""
    from nbdist.views.widget import Panel

    job = state.ElasticState("j9", "local", 2, max_restarts=2)
    job.begin(1, "j10", "")
    for r in range(2):
        job.apply(r, {"t": "state", "state": "running"})
        job.apply(r, {"t": "out", "s": "o", "text": f"step 1 on {r}\npart"})
    job.set_rank(1, state.FAILED, -9)
    job.finish(state.FAILED, "an attempt's end")  # what the attempt's Job calls
    assert job.status == state.RUNNING and job.ended is None
    job.end_attempt("rank 1 was killed by SIGKILL", "restarted (rule 'signal')")
    job.begin(2, "j11", "attempt 1 ended: rank 1 was killed by SIGKILL")
    assert [r.status for r in job.ranks] == [state.PENDING] * 2
    assert [line.text for line in job.ranks[1].log] == [
        "── nbdist: attempt 1 of 3 ──", "step 1 on 1", "part",
        "── nbdist: attempt 2 of 3: attempt 1 ended: rank 1 was killed by SIGKILL ──"]
    assert "attempt 2 of 3 · attempt 1 ended" in status.header_html(job)
    panel = Panel(job)
    panel.render()
    assert "attempt 2 of 3" in panel.header.value
    table = status.ranks_table(job)
    assert "1 of 3   j10" in table and "restarted (rule 'signal')" in table
    assert re.search(r"1 of 3 +j10 +\d+\.\d s +rank 1 was killed by SIGKILL", table), table
    assert "2 of 3   j11" in table and "running" in table
    assert "running, attempt 2 of 3" in status.jobs_table([job])
    job.close(state.DONE)
    assert job.status == state.DONE and job.ended is not None


# -- real ranks ----------------------------------------------------------------------------------
def trainer() -> Callable[..., Any]:
    """A deterministic DDP training that checkpoints every ``every`` steps with
    ``nbdist.checkpoint_dir()`` and resumes from it; rank 1 of the first attempt writes its
    pid to ``ready`` at step ``stop_at`` and waits there to be killed."""

    def train(steps: int, every: int, stop_at: int | None, ready: str) -> dict[str, Any]:
        import os
        import time

        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        import nbdist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = DistributedDataParallel(model)
        path = os.path.join(nbdist.checkpoint_dir(), "ckpt.pt")
        first = 0
        if os.path.exists(path):
            saved = torch.load(path)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            first = saved["step"]
        print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} from step {first}",
              flush=True)
        for step in range(first, steps):
            if (step == stop_at and rank == 1
                    and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"):
                with open(ready + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(ready + ".tmp", ready)
                while True:  # until the test kills this process
                    time.sleep(0.05)
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(8, 4, generator=g)
            loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if (step + 1) % every == 0 and rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, path + ".tmp")
                os.replace(path + ".tmp", path)  # a kill never leaves half a checkpoint
            dist.barrier()  # rank 0's checkpoint is complete before any rank goes on
        dist.destroy_process_group()
        return {k: v.clone() for k, v in model.state_dict().items()}

    return train


def _kill_when_ready(ready: Path, timeout: float = 120.0) -> float:
    """Wait for the rank to write its pid, SIGKILL it, and return when (monotonic)."""
    wait_for(ready.exists, timeout, "the rank to reach the step where it is killed")
    os.kill(int(ready.read_text()), signal.SIGKILL)
    return time.monotonic()


@pytest.mark.slow
# In a fresh clone with the worker's zygotes shared between tests, its second attempt once ran
# past 240 s (2026-11-28; not reproduced alone or after the Keras tests): until that is
# understood, it starts from no zygote, as every test did before (docs/developing.md).
@pytest.mark.fresh_pool
def test_killed_rank_restarts_from_its_checkpoint_to_the_same_parameters(
    tmp_path: Path,
) -> None:
    """Rank 1 SIGKILLed once mid-run: with max_restarts=1 the job completes, resumed from the
    last checkpoint, and its final parameters equal those of an uninterrupted run."""
    import torch

    train = trainer()
    steps, every, stop_at = 24, 5, 13
    started = time.monotonic()
    plain = nbdist.run(train, steps, every, None, str(tmp_path / "unused"), np=2,
                       backend="local", checkpoint_dir=str(tmp_path / "plain"))
    expected = plain.result(timeout=240)
    baseline = time.monotonic() - started

    ready = tmp_path / "ready"
    started = time.monotonic()
    job = nbdist.run(train, steps, every, stop_at, str(ready), np=2, backend="local",
                     max_restarts=1, checkpoint_dir=str(tmp_path / "elastic"))
    assert isinstance(job, elastic.ElasticJob)
    killed = _kill_when_ready(ready)
    got = job.result(timeout=240)
    after_kill = time.monotonic() - killed
    total = time.monotonic() - started
    print(f"figure: local kill -> completion {after_kill:.2f} s; whole restarted job "
          f"{total:.2f} s, uninterrupted {baseline:.2f} s (ratio {total / baseline:.2f})")

    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    first, second = job.attempts
    assert "rank 1 was killed by SIGKILL" in first.cause
    assert first.verdict == "restarted (rule 'signal')"
    assert second.cause == "done"
    assert job.state.status == state.DONE
    assert job.state.note == "done on attempt 2 of 2"
    texts = [line.text for line in job.state.merged]
    assert "attempt 0 from step 0" in texts and "attempt 1 from step 10" in texts
    marks = [t for t in texts if t.startswith("── nbdist: attempt 2 of 2")]
    assert len(marks) == 2 and "rule 'signal'" in marks[0]  # one per rank
    assert texts.index(marks[0]) > texts.index("attempt 0 from step 0")
    table = status.ranks_table(job.state)
    assert "attempts:" in table and "restarted (rule 'signal')" in table


def _fails_first(kind: str) -> Callable[[], int]:
    """Raises ValueError on every rank (kind="raise"), or is SIGKILLed on rank 1
    (kind="kill"), in the first attempt; returns the restart count in the others."""

    def f() -> int:
        import os

        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if count == 0 and kind == "raise":
            raise ValueError("the same bug on every rank")
        if kind == "kill-always" or (kind == "kill" and count == 0):
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), 9)
        assert os.environ["TORCHELASTIC_MAX_RESTARTS"] == "2"
        return count

    return f


def test_a_bug_is_not_restarted_and_the_error_says_so() -> None:
    """The same exception on every rank ends the job after one attempt, naming the rule."""
    job = nbdist.run(_fails_first("raise"), np=2, backend="local", max_restarts=2)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    message = str(info.value)
    assert "attempt 1 of 3 failed and was not restarted: rule 'same exception'" in message
    assert "--restart-on-error" in message
    assert "ValueError: the same bug on every rank" in message
    assert len(job.attempts) == 1 and job.state.status == state.FAILED
    assert any("ValueError" in text for text in info.value.failures.values())


@pytest.mark.slow
def test_restart_on_error_restarts_after_an_exception() -> None:
    """With restart_on_error the exception is restarted and the second attempt succeeds."""
    job = nbdist.run(_fails_first("raise"), np=2, backend="local", max_restarts=2,
                     restart_on_error=True)
    assert job.results == [1, 1]
    assert [a.verdict for a in job.attempts] == ["restarted (rule 'same exception')", ""]


def test_every_attempt_failing_lists_every_attempt() -> None:
    """A rank killed on every attempt: after max_restarts restarts the error lists them all."""
    job = nbdist.run(_fails_first("kill-always"), np=2, backend="local", max_restarts=2)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=180)
    message = str(info.value)
    assert f"job {job.id} failed on all 3 attempts (--max-restarts 2)" in message
    for n in (1, 2, 3):
        assert f"attempt {n} of 3 (" in message
    assert message.count("restarted (rule 'signal')") == 2
    assert "not restarted: no restarts left (rule 'signal')" in message
    assert "rank 1 was killed by SIGKILL" in message


def _held(ready: str) -> Callable[[], int]:
    """The first attempt's rank 1 writes its pid to ``ready`` and waits to be killed."""

    def f() -> int:
        import os
        import time

        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if count == 0:
            if os.environ["RANK"] == "1":
                with open(ready + ".tmp", "w") as out:
                    out.write(str(os.getpid()))
                os.replace(ready + ".tmp", ready)
            while True:
                time.sleep(0.05)
        return count

    return f


def test_restart_waits_for_capacity_then_runs(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One of two GPUs gone after the loss: the restart waits, showing "waiting for 2
    slots, 1 free", and runs once the GPU is back."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    ready = tmp_path / "ready"
    job = nbdist.run(_held(str(ready)), np=2, backend="local", gpu=True, max_restarts=1,
                     capacity_wait=120)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a GPU went with the host
    _kill_when_ready(ready)
    wait_for(lambda: "waiting for 2 slots, 1 free" in job.state.note, 60, "the wait")
    assert "of --capacity-wait 120" in job.state.note
    assert "attempt 2 of 2" in status.header_html(job.state)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert job.results == [1, 1]


@pytest.mark.slow
def test_restart_gives_up_when_capacity_does_not_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slots stay short: the job fails after --capacity-wait with the numbers."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    ready = tmp_path / "ready"
    job = nbdist.run(_held(str(ready)), np=2, backend="local", gpu=True, max_restarts=1,
                     capacity_wait=3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _kill_when_ready(ready)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    message = str(info.value)
    assert f"job {job.id} could not restart" in message
    assert "did not have the slots for 2 ranks within 3 s (--capacity-wait)" in message
    assert "this machine has 1 GPU (0)" in message
    assert "attempt 1 of 2" in message and "restarted (rule 'signal')" in message
    assert job.state.status == state.FAILED


def test_cancel_stops_the_restarts(tmp_path: Path) -> None:
    """A cancel while an attempt runs ends the job as cancelled, with no further attempt."""
    ready = tmp_path / "ready"
    job = nbdist.run(_held(str(ready)), np=2, backend="local", max_restarts=3)
    wait_for(ready.exists, 120, "the ranks to run")
    job.cancel("cancelled by the test")
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=60)
    assert info.value.reason == "cancelled"
    assert len(job.attempts) == 1 and job.state.status == state.CANCELLED


@pytest.mark.slow
def test_timeout_bounds_the_whole_job_and_is_not_restarted(tmp_path: Path) -> None:
    """--timeout ends a job that restarts like any other: rule 'timeout', no new attempt."""
    job = nbdist.run(_held(str(tmp_path / "ready")), np=2, backend="local", max_restarts=2,
                     timeout=4)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    assert info.value.reason == "timeout"
    assert "was not restarted: rule 'timeout'" in str(info.value)
    assert len(job.attempts) == 1


def test_environment_and_checkpoint_dir(tmp_path: Path) -> None:
    """Every rank sees the restart count, the maximum, one run id and the checkpoint dir."""

    def env() -> tuple[str, ...]:
        import os

        import nbdist

        return (os.environ["TORCHELASTIC_RESTART_COUNT"],
                os.environ["TORCHELASTIC_MAX_RESTARTS"], os.environ["TORCHELASTIC_RUN_ID"],
                nbdist.checkpoint_dir())

    job = nbdist.run(env, np=2, backend="local", max_restarts=3,
                     checkpoint_dir=str(tmp_path / "ck"))
    (a, b) = job.results
    assert a == b and a[:2] == ("0", "3") and a[3] == str(tmp_path / "ck")
    assert a[2] == job.run_id
    plain = nbdist.run(env, np=1, backend="local", checkpoint_dir=str(tmp_path / "p"))
    assert plain.result()[3] == str(tmp_path / "p")


def test_a_restart_without_the_event_channel_still_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks that cannot reach the driver's event server plan their world through the
    backend (the supervisor's fallback rendezvous): the second attempt still sees its restart count,
    run id and checkpoint directory, which reach local ranks at the rendezvous only."""
    from nbdist.errors import OutputLostWarning
    from nbdist.launch.local import LocalLauncher

    from .faults.rows import Misdirected

    class Unreachable(Misdirected):  # made again for each attempt, like any launcher
        def __init__(self) -> None:
            super().__init__(LocalLauncher())

    monkeypatch.setattr(nbdist.launch.backends, "choose", lambda np, backend: (Unreachable(), np))

    def f() -> tuple[str, ...]:
        import os
        import signal

        import nbdist

        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return (os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["TORCHELASTIC_RUN_ID"],
                nbdist.checkpoint_dir())

    job = nbdist.run(f, np=2, max_restarts=1, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.warns(OutputLostWarning):
        job.result(timeout=120)
        results = job.results
    assert results == [("1", job.run_id, str(tmp_path / "ck"))] * 2
    first, second = job.attempts
    assert first.verdict == "restarted (rule 'signal')", first.verdict
    assert second.cause == "done"


def test_checkpoint_dir_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a chosen path: under the working directory, by notebook (or function) and
    run id; on a rank with nothing set, by TORCHELASTIC_RUN_ID."""
    from nbdist import _checkpoint

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/My Training.ipynb")
    assert _checkpoint.default_dir("train", "abc") == str(
        tmp_path / "nbdist-checkpoints" / "My_Training-abc")
    monkeypatch.delenv("JPY_SESSION_NAME")
    assert _checkpoint.default_dir("train", "abc", "/shared") == "/shared/train-abc"
    monkeypatch.delenv(_checkpoint.ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    assert nbdist.checkpoint_dir() == str(tmp_path / "nbdist-checkpoints" / "r1")
    assert (tmp_path / "nbdist-checkpoints" / "r1").is_dir()


# -- the magics ----------------------------------------------------------------------------------
def test_config_settings_reach_the_next_job(ip: Any, tmp_path: Path) -> None:
    """%config DistMagics.capacity_wait and .checkpoint_root are what a job that restarts
    uses when the cell gives none; a negative wait is refused naming the setting."""
    from traitlets import TraitError

    assert settings.settings.capacity_wait == settings.CAPACITY_WAIT_S == 300
    try:
        ip.run_line_magic("config", "DistMagics.capacity_wait = 7")
        ip.run_line_magic("config", f"DistMagics.checkpoint_root = {str(tmp_path)!r}")
        job = nbdist.run(_fails_first("none"), np=1, backend="local", max_restarts=2)
        assert job.result(timeout=120) == 0
        assert job.capacity_wait == 7
        assert job.checkpoint_dir.startswith(str(tmp_path) + os.sep), job.checkpoint_dir
        magics = ip.magics_manager.registry["DistMagics"]  # %config shows the error, this raises
        with pytest.raises(TraitError, match="capacity_wait must be 0 or more seconds, not -1"):
            magics.capacity_wait = -1
        assert settings.settings.capacity_wait == 7
    finally:
        ip.run_line_magic("config", f"DistMagics.capacity_wait = {settings.CAPACITY_WAIT_S}")
        ip.run_line_magic("config", "DistMagics.checkpoint_root = ''")
    assert settings.settings.checkpoint_root == ""


def test_usage_errors(ip: Any, no_session: None) -> None:
    """--max-restarts with a session, without -np, or its companions alone: usage errors."""
    with pytest.raises(UsageError, match="--restart-on-error applies to a job that restarts"):
        ip.run_cell_magic("distributed", "-np 2 --restart-on-error", "pass")
    with pytest.raises(UsageError, match="--capacity-wait applies to a job that restarts"):
        ip.run_cell_magic("distributed", "-np 2 --capacity-wait 5", "pass")
    with pytest.raises(UsageError, match="--max-restarts takes how many times"):
        ip.run_cell_magic("distributed", "-np 2 --max-restarts -1", "pass")
    with pytest.raises(UsageError, match="a session cannot restart"):
        ip.run_line_magic("dist_session", "start -np 1 --max-restarts 2")
    ip.run_line_magic("dist_session", "start -np 1 --backend local")
    try:
        with pytest.raises(UsageError, match="a restart would lose"):
            ip.run_cell_magic("distributed", "--max-restarts 1", "pass")
    finally:
        ip.run_line_magic("dist_session", "stop")


def test_cell_and_script_restart(ip: Any, tmp_path: Path, capsys: Any) -> None:
    """The cell form and the line form with a script take --max-restarts; the text view
    marks the attempts."""
    cell = ("import os\n"
            "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
            "    os.kill(os.getpid(), 9)\n"
            "int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n")
    assert ip.run_cell_magic("distributed", "-np 2 --backend local --max-restarts 1",
                             cell) == 1
    out = capsys.readouterr().out
    assert "[nbdist] attempt 2 of 2 · attempt 1 ended: rank 1 of 2 failed" in out
    assert "── nbdist: attempt 2 of 2" in out
    script = tmp_path / "train.py"
    script.write_text(cell.replace("int(", "print('count', ") + "\n")
    ip.run_line_magic("distributed", f"-np 2 --backend local --max-restarts 1 {script}")
    out = capsys.readouterr().out
    assert "[rank 1] count 1" in out and "[rank 1] count 0" not in out

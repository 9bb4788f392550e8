"""The flight recorder in real local jobs: a hung, desynchronised or mismatched collective is
named in the job's error, the recorder can be turned off, a job without collectives says
nothing; ``%dist_check`` names a slow rank."""

from __future__ import annotations

import os
from typing import Any

import pytest

import nbdist
from nbdist import check, logfiles
from nbdist.errors import DistributedError
from nbdist.views import status

from .helpers import wait_for


def _collective_job(mode: str) -> None:
    """Two all-reduces on every rank, then rank 1 goes its own way (``mode``)."""
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.all_reduce(x)
    if rank == 1 and mode in ("stop", "off"):
        while True:  # never enters the third all-reduce
            time.sleep(0.05)
    if mode == "desync" and rank == 1:
        dist.broadcast(x, 0)
    elif mode == "dtype":
        # Same bytes per element: gloo runs it (garbage), the recorder keeps both dtypes.
        dist.all_reduce(torch.ones(4, dtype=torch.int32) if rank == 1 else x)
        if rank == 1:
            while True:
                time.sleep(0.05)
        dist.all_reduce(x)
    else:
        dist.all_reduce(x)


def _timed_out(mode: str, env: dict[str, str] | None = None) -> tuple[Any, DistributedError]:
    job = nbdist.run(_collective_job, mode, np=3, backend="local", timeout=25, env=env)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=120)
    assert info.value.reason == "timeout"
    return job, info.value


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_stops_before_the_third_all_reduce_is_named_in_the_error() -> None:
    """On a timeout the error, the job's state and the status say which ranks wait in
    all_reduce #3 and that rank 1 never entered it (where it is); the raw dumps are in the
    job's log folder for torch's analyser."""
    job, err = _timed_out("stop")
    message = str(err)
    assert "collectives: ranks 0, 2 wait in all_reduce #3 (4 float32, gloo) since " \
        in message, message
    assert "rank 1 never entered it (its last: all_reduce #2, completed) — rank 1 is in " \
        "test_collectives_jobs.py:" in message, message
    assert "collectives: ranks 0, 2 wait in all_reduce #3" in job.state.forensics
    assert "rank 1 never entered it" in status.summary_text(job.state)
    folder = os.path.join(job.state.log_dir, logfiles.FLIGHT_RECORDS)
    assert sorted(os.listdir(folder)) == ["rank_0", "rank_1", "rank_2"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_desync_is_named_in_the_error() -> None:
    """All-reduce on ranks 0 and 2 against broadcast on rank 1 at #3 is named a desync."""
    _, err = _timed_out("desync")
    assert "desync at #3: ranks 0, 2 call all_reduce, rank 1 calls broadcast" in str(err), err


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mismatched_dtypes_are_named_in_the_error() -> None:
    """int32 on rank 1 against float32 on the others at #3 is named a mismatch; the others
    then wait in #4, which rank 1 never entered."""
    _, err = _timed_out("dtype")
    message = str(err)
    assert "mismatch at all_reduce #3: ranks 0, 2 4 float32, rank 1 4 int32" in message, message
    assert "ranks 0, 2 wait in all_reduce #4" in message, message


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_recorder_turned_off_says_nothing() -> None:
    """With ``TORCH_FR_BUFFER_SIZE=0`` the same hang gives the stacks and no collectives."""
    job, err = _timed_out("off", {"TORCH_FR_BUFFER_SIZE": "0"})
    assert "collectives" not in str(err)
    assert "all_reduce" in err.stacks  # the stacks are still taken
    assert not os.path.exists(os.path.join(job.state.log_dir, logfiles.FLIGHT_RECORDS))


def _fails_while_another_waits() -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    pair = dist.new_group([0, 2])  # every rank makes it; rank 1 is not in it
    rank = dist.get_rank()
    if rank == 1:
        raise ValueError("rank 1 gives up")
    if rank == 0:  # waits for rank 2, which never comes (rank 1's end does not reach it)
        dist.all_reduce(torch.ones(4), group=pair)
    while True:
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failed_job_says_where_the_others_stood_in_their_collectives() -> None:
    """When a rank fails, the others' stacks and collectives are taken before they are
    stopped: the error names the failure first, then who waited in which collective."""
    job = nbdist.run(_fails_while_another_waits, np=3, backend="local")
    with pytest.raises(DistributedError) as info:
        job.result(timeout=150)
    message = str(info.value)
    assert info.value.reason == "failed"
    assert message.index("ValueError: rank 1 gives up") < message.index("collectives: ")
    assert "rank 0 waits in all_reduce #1 (4 float32, gloo)" in message, message
    assert "rank 2 never entered it" in message, message
    assert "_fails_while_another_waits" in job.state.forensics  # the others' stacks


def _no_collective() -> None:
    import time

    while True:
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_job_without_collectives_says_nothing() -> None:
    """A job that never ran a collective times out with its stacks and no collectives line."""
    # The timeout counts from the launch: on a machine loaded 15 times over (CI's), 10 s ended
    # the job before its ranks had reached the function, and there were no stacks of it.
    job = nbdist.run(_no_collective, np=2, backend="local", timeout=60)
    with pytest.raises(DistributedError) as info:
        job.result(timeout=150)
    assert "collectives" not in str(info.value)
    assert "_no_collective" in info.value.stacks


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("np", [2, 3])
def test_dist_check_names_the_slow_rank(np: int) -> None:
    """``%dist_check``'s engine on 2 and 3 local ranks, the last made slow by the test hook:
    the table has a row per rank and the last problem names the slow rank."""
    slow = np - 1
    got = check.run_check(np, backend="local", env={"NBDIST_CHECK_DELAY": f"{slow}:0.3"},
                          largest=64 << 10)
    assert len(got.rows) == np
    assert got.sweep and all(bw > 0 for _, _, bw in got.sweep)
    # Other problems may be said too (a nearly full disk: seen on a full CI machine).
    assert any(p.startswith(f"rank {slow} on ") and "is the slowest" in p
               for p in got.problems), got.text()
    assert any(ln.startswith(f"  rank {slow} on ") for ln in got.text().splitlines())
    assert f"log folder: {got.log_dir} (" in got.text() and got.log_free_gb is not None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dist_check_magic_prints_the_table(ip: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``%dist_check -np 2`` prints a row per rank, the sweep and a verdict; bad input is a
    usage error."""
    from IPython.core.error import UsageError

    ip.run_line_magic("dist_check", "-np -2")
    out = capsys.readouterr().out
    assert out.startswith("%dist_check of 2 ranks"), out
    assert "all-reduce (bus bandwidth as nccl-tests computes it):" in out
    assert "    1 KB" in out
    with pytest.raises(UsageError, match="-np takes"):
        ip.run_line_magic("dist_check", "-np 0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_many_stacks_requests_never_crash_a_rank() -> None:
    """Forty stacks requests (each with its flight recorder request) to 4 idle ranks leave
    every rank running: the thread that answers for the recorder is never starting or ending
    while faulthandler walks the threads (before the fix, a rank died of SIGSEGV within ~25)."""
    job = nbdist.run(_no_collective, np=4, backend="local")
    try:
        wait_for(lambda: all(r.status == "running" for r in job.state.ranks), 120,
                 "every rank running")
        for _ in range(40):
            taken = job.stacks()
            assert not taken.missing and not job.done(), (taken.text(), job.state.status)
    finally:
        job.cancel()

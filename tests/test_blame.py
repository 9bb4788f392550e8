"""Which failed rank a job's error names first (``nbdist.blame``, ``endings.failure_error``)."""

from __future__ import annotations

import time

import pytest

import nbdist
from nbdist import blame, endings
from nbdist.protocol import RankOutcome, RankStatus

from .helpers import rank_processes, wait_for

#: What gloo says on a rank whose all_reduce lost its peer (torch 2.x, verbatim).
GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [127.0.0.1]:21381. This is typically caused by a "
               "remote worker crashing. Check the logs of the remote worker before reporting "
               "an error. GLHF!")


def raised(rank: int, kind: str, message: str, ended: float | None = None) -> RankOutcome:
    return RankOutcome(rank, RankStatus.FAILED, exit_code=1, ended=ended, error={
        "type": kind, "message": message, "traceback": f"{kind}: {message}\n"})


def failure_of(failed: list[RankOutcome], np: int, heard: int | None) -> str:
    return str(endings.failure_error("j1", np, failed, {}, heard))


@pytest.mark.parametrize(("kind", "message"), [
    ("RuntimeError", GLOO_CLOSED),
    ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset "
                     "by peer"),
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or "
                         "there was a network error, NCCL version 2.21.5"),
    ("RuntimeError", "[Rank 0] Watchdog caught collective operation timeout: "
                     "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 milliseconds"),
    ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed "
                     "out waiting 1800000ms for recv operation to complete"),
    ("DistStoreError", "wait timeout after 300000ms, keys: /default_pg/0//cuda//0"),
])
def test_a_collectives_lost_peer_is_a_consequence(kind: str, message: str) -> None:
    """gloo's and NCCL's lost-peer errors and collective timeouts are peer-loss consequences."""
    assert blame.peer_lost(raised(0, kind, message))


@pytest.mark.parametrize("outcome", [
    raised(1, "ValueError", "bad shard 7"),
    raised(1, "RuntimeError", "CUDA out of memory. Tried to allocate 2.00 GiB"),
    raised(1, "TimeoutError", "the data server did not answer"),
    RankOutcome(1, RankStatus.FAILED, exit_code=-9),
    RankOutcome(1, RankStatus.FAILED, exit_code=3),
])
def test_a_ranks_own_error_or_death_is_not_a_consequence(outcome: RankOutcome) -> None:
    """The cell's own exceptions, a signal and an exit code are causes, not peer losses."""
    assert not blame.peer_lost(outcome)


def test_nothing_heard_names_the_real_error_over_lower_ranks_lost_peers() -> None:
    """Nothing heard over the channel, outcomes in rank order (a Spark collect()): rank 1's
    ValueError is named, not rank 0's "Connection closed by peer" that followed from it."""
    failed = [raised(0, "RuntimeError", GLOO_CLOSED), raised(1, "ValueError", "bad shard 7"),
              raised(2, "RuntimeError", GLOO_CLOSED), raised(3, "RuntimeError", GLOO_CLOSED)]
    text = failure_of(failed, 4, heard=None)
    assert text.startswith("rank 1 of 4 failed: ValueError: bad shard 7 "
                           "(ranks 0, 2, 3 failed after it)"), text


def test_a_heard_lost_peer_yields_to_another_ranks_real_error() -> None:
    """Rank 2's lost peer heard first (a busy machine): rank 0's real error is named."""
    failed = [raised(0, "KeyError", "'label'"), raised(2, "RuntimeError", GLOO_CLOSED)]
    text = failure_of(failed, 3, heard=2)
    assert text.startswith("rank 0 of 3 failed: KeyError: 'label' (ranks 2 failed after it)"), text


def test_between_real_errors_the_heard_one_then_the_first_to_end_is_named() -> None:
    """Two real errors: the one heard first; nothing heard: the one that ended first, then the
    lowest rank when the outcomes carry no end time."""
    failed = [raised(0, "KeyError", "'a'", ended=105.0), raised(1, "ValueError", "b", ended=100.0),
              raised(2, "RuntimeError", GLOO_CLOSED, ended=99.0)]
    assert failure_of(failed, 3, heard=0).startswith("rank 0 of 3 failed: KeyError")
    assert failure_of(failed, 3, heard=None).startswith("rank 1 of 3 failed: ValueError")
    timeless = [raised(0, "RuntimeError", GLOO_CLOSED), raised(2, "KeyError", "'a'"),
                raised(3, "ValueError", "b")]
    assert failure_of(timeless, 4, heard=None).startswith("rank 2 of 4 failed: KeyError")


def test_only_lost_peers_name_the_first_to_end() -> None:
    """Every failed rank lost a peer (the cause was stopped, or is elsewhere): the one that
    ended first is named, and the lowest rank without end times."""
    failed = [raised(0, "RuntimeError", GLOO_CLOSED, ended=12.0),
              raised(1, "DistBackendError", "NCCL communicator was aborted", ended=11.0)]
    assert blame.root_cause(failed, None) == 1
    assert blame.root_cause(failed, 0) == 0  # heard first: one clock, the driver's
    assert blame.root_cause([raised(2, "RuntimeError", GLOO_CLOSED),
                             raised(1, "RuntimeError", GLOO_CLOSED)], None) == 1


def test_a_signal_still_comes_before_a_real_error() -> None:
    """A rank killed by SIGKILL is named over another rank's exception, heard or not."""
    failed = [raised(0, "ValueError", "bad shard 7", ended=1.0),
              RankOutcome(2, RankStatus.FAILED, exit_code=-9, ended=2.0)]
    assert blame.root_cause(failed, 0) == 2 and blame.root_cause(failed, None) == 2


#: The last lines of a rank that NCCL's error handling aborted after a peer went (torch 2.x).
NCCL_ABORT_TAIL = [
    "[rank0]:[E ProcessGroupNCCL.cpp:1595] [PG 0 Rank 0] Process group watchdog thread "
    "terminated with exception: NCCL error: remote process exited or there was a network error",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
]


def test_an_abort_after_a_lost_peer_yields_to_the_error_that_caused_it() -> None:
    """Rank 0 aborted by NCCL's watchdog once rank 1 raised (heard first or not): rank 1's
    ValueError is named; an abort without a lost peer in its last output still comes before
    lost peers, and a SIGKILL before everything."""
    nccl_abort = RankOutcome(0, RankStatus.FAILED, exit_code=-6, tail=NCCL_ABORT_TAIL, ended=1.0)
    real = raised(1, "ValueError", "bad shard 7", ended=2.0)
    assert blame.root_cause([nccl_abort, real], 0) == 1
    assert blame.root_cause([nccl_abort, real], None) == 1
    assert failure_of([nccl_abort, real], 2, heard=0).startswith(
        "rank 1 of 2 failed: ValueError: bad shard 7 (ranks 0 failed after it)")
    assertion = RankOutcome(2, RankStatus.FAILED, exit_code=-6, tail=["Assertion failed"])
    lost = raised(3, "RuntimeError", GLOO_CLOSED, ended=0.5)
    assert blame.root_cause([lost, assertion, nccl_abort], 3) == 2
    assert blame.root_cause([nccl_abort, lost], None) == 3  # both consequences: first to end
    sigkill = RankOutcome(4, RankStatus.FAILED, exit_code=-9)
    assert blame.root_cause([real, assertion, sigkill], 1) == 4


def lost_peer_after_rank_1_raises() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("bad shard 7")
    total = torch.ones(1)
    dist.all_reduce(total)  # loses rank 1: "Connection closed by peer"
    return int(total.item())


@pytest.mark.slow
def test_a_local_job_names_the_rank_that_raised_not_its_peers() -> None:
    """Three local ranks on gloo, rank 1 raising before an all_reduce: the error names rank 1's
    ValueError, and a peer that lost it in the collective ended after it."""
    pytest.importorskip("torch")
    job = nbdist.run(lost_peer_after_rank_1_raises, np=3, backend="local")
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=120)
    assert str(info.value).startswith("rank 1 of 3 failed: ValueError: bad shard 7"), info.value
    outcomes = job._outcomes
    raised_at = outcomes[1].ended
    assert raised_at is not None
    for rank in (0, 2):  # a peer that failed rather than being stopped lost rank 1, after it
        peer = outcomes[rank]
        if peer.status == RankStatus.FAILED:
            assert blame.peer_lost(peer), peer.error
            assert peer.ended is not None and peer.ended >= raised_at, (peer.ended, raised_at)
    wait_for(lambda: not rank_processes(), 30, "no rank process left")


class SlowToSay(Exception):
    """An exception whose message takes a second to format: the rank sends it that long
    after its code ended."""

    def __str__(self) -> str:
        time.sleep(1.0)
        return "slow to say"


def raises_slow_to_say() -> None:
    raise SlowToSay()


def test_a_rank_ended_when_its_code_ended_not_when_its_supervisor_read_the_error() -> None:
    """``ended`` is the rank's own stamp of its code's end: two ranks' supervisors read their
    frames in either order, and a peer that lost the cause was once read first (by 0.1 ms)."""
    job = nbdist.run(raises_slow_to_say, np=1, backend="local")
    with pytest.raises(nbdist.DistributedError, match="slow to say"):
        job.result(timeout=120)
    marks = job.state.ranks[0].marks
    assert job._outcomes[0].ended == marks["end"], (job._outcomes[0].ended, marks)
    assert marks["result"] - marks["end"] >= 0.9, marks  # the error came a second later
    wait_for(lambda: not rank_processes(), 30, "no rank process left")


def test_a_session_rank_ended_when_it_exited_not_at_its_first_cells_end() -> None:
    """A session's rank stamps ``end`` at its first cell only, and its cells end on the
    channel (no ``result`` mark): its outcome's ``ended`` is when it exited."""
    from nbdist import session as sessions
    from nbdist.capture import capture_cell
    from nbdist.options import JobOptions

    live = sessions.start(1, JobOptions(backend="local"))
    try:
        captured = capture_cell("1 + 1", {}, remote_names=live.defined_names())
        assert live.run_cell(captured.payload()).result(timeout=120) == 2
        first_end = live.job.state.ranks[0].marks["end"]
        wait_for(lambda: time.time() > first_end + 1.0, 30, "a second after the cell")
    finally:
        live.stop()
    assert live.job.wait(120)
    marks = live.job.state.ranks[0].marks
    ended = live.job._outcomes[0].ended
    assert ended == marks["exit"] and ended > first_end + 1.0, (ended, marks)

"""A job's life as a pure machine (``nbdist.lifecycle``), without any process: the rows of the
fault matrix (docs/reliability.md) that are about the order things happen in, as a table of
stimuli in and actions and verdicts out."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nbdist.lifecycle import (
    Action,
    Cancel,
    Drain,
    End,
    Fail,
    Hello,
    JobMachine,
    MarkFailed,
    Outcome,
    RankFailing,
    Refuse,
    SendWorld,
    Silent,
    StacksTaken,
    Stimulus,
    StopRanks,
    TakeStacks,
    Timeout,
    WorldFailed,
)
from nbdist.protocol import ErrorRecord, RankOutcome, RankStatus

DONE, FAILED, CANCELLED = RankStatus.DONE, RankStatus.FAILED, RankStatus.CANCELLED


def ended(rank: int, status: RankStatus, at: float) -> Outcome:
    error: ErrorRecord | None = {"type": "RuntimeError", "message": "boom", "traceback": ""} \
        if status == FAILED else None
    return Outcome(RankOutcome(rank=rank, status=status, error=error), at)


@dataclass
class Row:
    """Stimuli in, each with the actions it must give; then the verdict and what is kept."""

    name: str
    np: int
    steps: list[tuple[Stimulus, list[Action]]]
    verdict: End | None = None
    first_failure: int | None = None
    cancel_reason: str | None = None
    running_at_cancel: list[int] = field(default_factory=list)
    owned: bool = False


ROWS = [
    Row("every rank says hello, then the world goes out once all are in", 2, [
        (Hello(0, 1.0), []),
        (Hello(1, 1.1), [SendWorld()]),
        (ended(0, DONE, 2.0), []),
        (ended(1, DONE, 2.1), [Drain()]),
    ], End.DONE),
    Row("the first rank to fail stops the others and is the one blamed first", 3, [
        (Hello(0, 1.0), []), (Hello(1, 1.0), []), (Hello(2, 1.0), [SendWorld()]),
        (ended(1, FAILED, 2.0), [StopRanks("rank 1 failed")]),
        (ended(0, FAILED, 2.1), []),  # its peer's lost connection, heard after
        (ended(2, CANCELLED, 2.2), [Drain()]),
    ], End.FAILED, first_failure=1, cancel_reason="rank 1 failed", running_at_cancel=[0, 2]),
    Row("a supervisor's word of failure stops the others before any outcome", 2, [
        (RankFailing(1, 2.0), [StopRanks("rank 1 failed")]),
        (RankFailing(0, 2.1), []),
        (ended(0, FAILED, 3.0), []),
        (ended(1, FAILED, 3.1), [Drain()]),
    ], End.FAILED, first_failure=1, cancel_reason="rank 1 failed", running_at_cancel=[0, 1]),
    Row("the last outcome of a failure stops nothing: every rank has ended", 1, [
        (ended(0, FAILED, 2.0), [Drain()]),
    ], End.FAILED, first_failure=0),
    Row("a rank silent while connected fails the job, naming its host", 3, [
        (Silent({2: "h2"}, 60.0, 70.0), [MarkFailed((2,)),
                                         StopRanks("rank 2 on h2 not heard from for 60 s")]),
        (ended(0, CANCELLED, 71.0), []), (ended(1, CANCELLED, 71.0), []),
        (ended(2, FAILED, 72.0), [Drain()]),
    ], End.LOST, first_failure=2, cancel_reason="rank 2 on h2 not heard from for 60 s",
        running_at_cancel=[0, 1, 2]),
    Row("a rank silent, then heard: it was lost all the same (the job had stopped)", 2, [
        (Silent({1: "h1"}, 60.0, 70.0), [MarkFailed((1,)),
                                         StopRanks("rank 1 on h1 not heard from for 60 s")]),
        (Hello(1, 71.0), [Refuse(1, "rank 1 on h1 not heard from for 60 s")]),
        (ended(0, CANCELLED, 72.0), []), (ended(1, DONE, 72.0), [Drain()]),
    ], End.LOST, cancel_reason="rank 1 on h1 not heard from for 60 s",
        running_at_cancel=[0, 1]),
    Row("ranks falling silent after the cancel are not lost: the job was ending", 2, [
        (Cancel("cancelled by the user", 5.0), [TakeStacks((0, 1))]),
        (StacksTaken(6.0), [StopRanks("cancelled by the user")]),
        (Silent({1: "h1"}, 60.0, 70.0), []),
        (ended(0, CANCELLED, 71.0), []), (ended(1, CANCELLED, 71.0), [Drain()]),
    ], End.CANCELLED, cancel_reason="cancelled by the user", running_at_cancel=[0, 1]),
    Row("cancel during start: a rank that connects afterwards gets the cancel, not the world", 2, [
        (Hello(0, 1.0), []),
        (Cancel("interrupted from the notebook", 1.5), [TakeStacks((0, 1))]),
        (StacksTaken(2.0), [StopRanks("interrupted from the notebook")]),
        (Hello(1, 2.5), [Refuse(1, "interrupted from the notebook")]),
        (ended(0, CANCELLED, 3.0), []), (ended(1, CANCELLED, 3.0), [Drain()]),
    ], End.CANCELLED, cancel_reason="interrupted from the notebook", running_at_cancel=[0, 1]),
    Row("a timeout takes the stacks, then stops the ranks still running", 2, [
        (Hello(0, 1.0), []), (Hello(1, 1.0), [SendWorld()]),
        (ended(0, DONE, 5.0), []),
        (Timeout(10.0, 11.0), [TakeStacks((1,))]),
        (StacksTaken(12.0), [StopRanks("timed out after 10 s")]),
        (ended(1, CANCELLED, 12.5), [Drain()]),
    ], End.TIMEOUT, cancel_reason="timed out after 10 s", running_at_cancel=[1]),
    Row("a rank failing while a timeout's stacks are taken: the failure ends the job", 2, [
        (Timeout(10.0, 11.0), [TakeStacks((0, 1))]),
        (ended(1, FAILED, 11.5), [StopRanks("rank 1 failed")]),
        (StacksTaken(12.0), []),
        (ended(0, CANCELLED, 12.5), [Drain()]),
    ], End.FAILED, first_failure=1, cancel_reason="rank 1 failed", running_at_cancel=[0]),
    Row("a timeout after a failure stopped the job changes nothing", 2, [
        (ended(0, FAILED, 2.0), [StopRanks("rank 0 failed")]),
        (Timeout(10.0, 10.0), []),
        (ended(1, CANCELLED, 10.5), [Drain()]),
    ], End.FAILED, first_failure=0, cancel_reason="rank 0 failed", running_at_cancel=[1]),
    Row("a timeout or cancel once every rank ended does nothing", 1, [
        (ended(0, DONE, 2.0), [Drain()]),
        (Timeout(10.0, 10.0), []), (Cancel("late", 11.0), []),
    ], End.DONE),
    Row("a second cancel while the first one's stacks come in adds nothing", 2, [
        (Cancel("first", 1.0), [TakeStacks((0, 1))]),
        (Cancel("second", 1.1), []),
        (StacksTaken(2.0), [StopRanks("first")]),
        (StacksTaken(2.1), []),
        (ended(0, CANCELLED, 3.0), []), (ended(1, CANCELLED, 3.0), [Drain()]),
    ], End.CANCELLED, cancel_reason="first", running_at_cancel=[0, 1]),
    Row("a failed rendezvous stops the ranks", 2, [
        (Hello(0, 1.0), []), (Hello(1, 1.0), [SendWorld()]),
        (WorldFailed("two ranks on one GPU", 1.1),
         [StopRanks("the rendezvous failed: two ranks on one GPU")]),
    ], cancel_reason="the rendezvous failed: two ranks on one GPU", running_at_cancel=[0, 1]),
    Row("a session's ranks: their owner decides when they cannot go on, and a cancel takes "
        "no stacks", 2, [
        (Silent({0: "h0"}, 60.0, 70.0), [MarkFailed((0,)),
                                         Fail("rank 0 on h0 not heard from for 60 s")]),
        (Cancel("the session broke", 71.0), [StopRanks("the session broke")]),
        (ended(0, FAILED, 72.0), []), (ended(1, CANCELLED, 72.0), [Drain()]),
    ], End.LOST, first_failure=0, cancel_reason="the session broke", running_at_cancel=[0, 1],
        owned=True),
    Row("an outcome heard twice settles once", 1, [
        (ended(0, DONE, 2.0), [Drain()]),
        (ended(0, DONE, 2.1), []),
    ], End.DONE),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_the_order_of_events_decides_the_end(row: Row) -> None:
    """Each stimulus gives exactly its actions; the machine ends with the row's verdict, blame
    and cancel."""
    machine = JobMachine(row.np, owned=row.owned)
    for stimulus, expected in row.steps:
        assert machine.handle(stimulus) == expected, stimulus
    if row.verdict is not None:
        assert machine.complete and machine.verdict() is row.verdict
    assert machine.first_failure == row.first_failure
    assert machine.cancel_reason == row.cancel_reason
    assert machine.running_at_cancel == row.running_at_cancel


def test_a_stimulus_of_another_kind_is_refused() -> None:
    """Only the machine's stimuli go in."""
    with pytest.raises(TypeError, match="not a stimulus"):
        JobMachine(1).handle("ping")  # type: ignore[arg-type]

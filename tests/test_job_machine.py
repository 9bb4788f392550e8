"""A job's life as a pure machine (``nbdist.lifecycle``), without any process: the rows of the
fault matrix (docs/reliability.md) that are about the order things happen in, as a table of
stimuli in and actions and verdicts out, and a restart's wait for capacity turn by turn."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from nbdist.lifecycle import (
    Action,
    BreakSession,
    Cancel,
    CapacityWait,
    CellError,
    CellMachine,
    CellValue,
    Drain,
    End,
    Fail,
    GraceOver,
    Hello,
    Interrupt,
    JobMachine,
    MarkFailed,
    Outcome,
    RankFailing,
    Refuse,
    SendWorld,
    SettleCell,
    Silent,
    StacksTaken,
    Step,
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
    Row("the first rank to fail stops the others, after their stacks, and is the one blamed "
        "first", 3, [
        (Hello(0, 1.0), []), (Hello(1, 1.0), []), (Hello(2, 1.0), [SendWorld()]),
        (ended(1, FAILED, 2.0), [TakeStacks((0, 2), failure=True)]),
        (ended(0, FAILED, 2.1), []),  # its peer's lost connection, heard after
        (Timeout(10.0, 2.2), []),  # the stop is under way
        (StacksTaken(2.3), [StopRanks("rank 1 failed")]),
        (ended(2, CANCELLED, 2.4), [Drain()]),
    ], End.FAILED, first_failure=1, cancel_reason="rank 1 failed", running_at_cancel=[2]),
    Row("a supervisor's word of failure after the world: the others' stacks, then the stop", 2, [
        (Hello(0, 1.0), []), (Hello(1, 1.0), [SendWorld()]),
        (RankFailing(1, 2.0), [TakeStacks((0,), failure=True)]),
        (RankFailing(0, 2.1), []),
        (StacksTaken(2.2), [StopRanks("rank 1 failed")]),
        (ended(0, FAILED, 3.0), []),
        (ended(1, FAILED, 3.1), [Drain()]),
    ], End.FAILED, first_failure=1, cancel_reason="rank 1 failed", running_at_cancel=[0, 1]),
    Row("a supervisor's word of failure before the world stops the others at once", 2, [
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


# -- a job that restarts, waiting for the slots of its ranks --------------------------------------
WAITS = [
    # (name, capacity_wait, job deadline, turns: (now, cancelled, fits) -> step)
    ("the slots come back within the wait: the attempt starts", 300.0, None,
     [((10.0, False, False), Step.WAIT), ((12.0, False, True), Step.START)]),
    ("the wait runs out: the job gives up, naming --capacity-wait", 5.0, None,
     [((10.0, False, False), Step.WAIT), ((15.0, False, False), Step.GIVE_UP)]),
    ("a timeout during a restart wait: the job's --timeout ends it first", 300.0, 14.0,
     [((10.0, False, False), Step.WAIT), ((14.0, False, False), Step.GIVE_UP)]),
    ("a cancel during the wait wins over slots that came back", 300.0, None,
     [((10.0, False, False), Step.WAIT), ((11.0, True, True), Step.CANCEL)]),
    ("slots at the last moment still start the attempt", 5.0, None,
     [((15.0, False, True), Step.START)]),
]


@pytest.mark.parametrize(("capacity_wait", "deadline", "turns"),
                         [w[1:] for w in WAITS], ids=[w[0] for w in WAITS])
def test_a_restart_waits_for_capacity_within_the_first_bound(
        capacity_wait: float, deadline: float | None,
        turns: list[tuple[tuple[float, bool, bool], Step]]) -> None:
    """Each turn of the wait: cancel first, then the slots, then the nearer of
    ``--capacity-wait`` and the job's ``--timeout``."""
    wait = CapacityWait.begin(10.0, capacity_wait, deadline, 60.0)
    for (now, cancelled, fits), expected in turns:
        assert wait.step(now, cancelled=cancelled, fits=fits)[0] is expected, now
    assert wait.bound == ("the job's --timeout of 60 s" if deadline is not None
                          else f"{capacity_wait:g} s (--capacity-wait)")


# -- a session's cell -----------------------------------------------------------------------------
CELLS = [
    ("every rank's value: the cell is done", 2, [
        (CellValue(0, 1.0), []), (CellValue(1, 1.1), [SettleCell(End.DONE)]),
    ], End.DONE, None),
    ("the first failure interrupts the others and is the one named", 3, [
        (CellError(2, "ValueError", "bad", 1.0), [Interrupt((0, 1), "rank 2 failed")]),
        (CellError(0, "KeyboardInterrupt", "", 1.1), []),
        (CellError(1, "RuntimeError", "peer gone", 1.2), [SettleCell(End.FAILED)]),
    ], End.FAILED, 2),
    ("an interrupt's KeyboardInterrupts are not the cell's failure: it was interrupted", 2, [
        (Cancel("interrupted from the notebook", 1.0),
         [Interrupt((0, 1), "interrupted from the notebook")]),
        (Cancel("again", 1.1), []),
        (CellError(0, "KeyboardInterrupt", "", 1.2), []),
        (CellError(1, "KeyboardInterrupt", "", 1.3), [SettleCell(End.CANCELLED)]),
    ], End.CANCELLED, None),
    ("a rank that does not stop within the grace breaks the session", 2, [
        (Cancel("interrupted from the notebook", 1.0),
         [Interrupt((0, 1), "interrupted from the notebook")]),
        (CellError(0, "KeyboardInterrupt", "", 1.2), []),
        (GraceOver(11.0), [BreakSession((1,), "interrupted from the notebook")]),
    ], None, None),
    ("a cell on some ranks (--targets) waits for those only", (1, 3), [
        (CellError(3, "ValueError", "bad", 1.0), [Interrupt((1,), "rank 3 failed")]),
        (CellError(1, "KeyboardInterrupt", "", 1.1), [SettleCell(End.FAILED)]),
    ], End.FAILED, 3),
    ("a rank's last word after the cell settled changes nothing", 1, [
        (CellValue(0, 1.0), [SettleCell(End.DONE)]),
        (CellError(0, "RuntimeError", "late", 1.1), []),
        (GraceOver(11.0), []), (Cancel("late", 12.0), []),
    ], End.DONE, None),
]


@pytest.mark.parametrize(("np", "steps", "verdict", "first"), [c[1:] for c in CELLS],
                         ids=[c[0] for c in CELLS])
def test_a_session_cell_ends_by_the_order_of_its_ranks(
        np: int | tuple[int, ...], steps: list[tuple[object, list[object]]], verdict: End | None,
        first: int | None) -> None:
    """Each stimulus of a session cell gives exactly its actions; the verdict and the rank
    the error names follow who failed first."""
    machine = CellMachine(tuple(range(np)) if isinstance(np, int) else np)
    for stimulus, expected in steps:
        assert machine.handle(stimulus) == expected, stimulus  # type: ignore[arg-type]
    if verdict is not None:
        assert machine.settled and machine.verdict() is verdict
    assert machine.first_error == first

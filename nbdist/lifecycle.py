"""A job's life as a pure machine: stimuli in, with the time they happened; actions out.

In the mould of dask's ``worker_state_machine``: :class:`JobMachine` is mutated only through
:meth:`JobMachine.handle`, never does I/O, never reads a clock, and is tested without a process
(``tests/test_job_machine.py``). ``job.Job`` is its I/O shell: it turns what the event server,
the backend and its timers say into stimuli, and carries out the actions (send the world, stop
the ranks, take their stacks, settle). A backend adds I/O, never new ending logic.

The stimuli: :class:`Hello` (a rank connected), :class:`RankFailing` (a rank's supervisor said
it failed, before its outcome), :class:`Outcome` (a rank ended), :class:`Silent` (connected
ranks said nothing for the heartbeat timeout), :class:`WorldFailed` (the rendezvous failed),
:class:`Timeout`, :class:`Cancel` (the user, the stop button), :class:`StacksTaken` (the
stacks a timeout or cancel asked for are in, or given up on).

The actions: :class:`SendWorld` (every rank said hello), :class:`Refuse` (a rank connected
after the cancel: stop it, never give it the world), :class:`TakeStacks` (before a timeout, a
cancel or a rank's failure after the rendezvous stops running ranks: where they are; the stop
follows with :class:`StacksTaken`),
:class:`StopRanks` (cancel every rank and the backend), :class:`Fail` (the ranks cannot go on:
an owner, a session, decides), :class:`MarkFailed` (ranks taken for lost), :class:`Drain`
(every rank ended: read the channels to their end, then settle with :meth:`JobMachine.verdict`).

Beside it, the same shape for a session's cell (:class:`CellMachine`, whose I/O shell is
``session.SessionCell``) and for a job that restarts while it waits for the slots of its ranks
(:class:`CapacityWait`, asked at each turn by ``elastic.ElasticJob``).

Who ends first decides: the first failure stops the others (after their stacks) and is blamed
first; a stop already
under way is never replaced (a rank failing while a timeout's stacks are taken still ends the
job as failed, the timeout's stop then does nothing); a rank heard after the job was stopped
gets a cancel, never the world.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from nbdist.protocol import RankOutcome, RankStatus


# -- stimuli --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """A rank connected and proved the secret."""

    rank: int
    at: float


@dataclass(frozen=True)
class RankFailing:
    """A rank's supervisor said the rank failed; its outcome comes later (Spark hands them all
    over at the stage's end)."""

    rank: int
    at: float


@dataclass(frozen=True)
class Outcome:
    """A rank ended, as the backend says (after the job's mapping of a lost host)."""

    outcome: RankOutcome
    at: float


@dataclass(frozen=True)
class Silent:
    """Connected ranks said nothing for ``after`` seconds (a host or network cut off), by
    host."""

    lost: Mapping[int, str]
    after: float
    at: float


@dataclass(frozen=True)
class WorldFailed:
    """The rendezvous could not plan the ranks' world (``reason`` says why)."""

    reason: str
    at: float


@dataclass(frozen=True)
class Timeout:
    """The job ran ``after`` seconds (``--timeout``)."""

    after: float
    at: float


@dataclass(frozen=True)
class Cancel:
    """The user cancelled (``%dist_cancel``, ``job.cancel()``, the stop button)."""

    reason: str
    at: float


@dataclass(frozen=True)
class StacksTaken:
    """The stacks a :class:`TakeStacks` asked for are in (or were given up on)."""

    at: float


Stimulus = Hello | RankFailing | Outcome | Silent | WorldFailed | Timeout | Cancel | StacksTaken


# -- actions --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SendWorld:
    """Every rank said hello: plan their world and send it to each."""


@dataclass(frozen=True)
class Refuse:
    """Send ``rank``, which connected after the job was stopped, the cancel instead."""

    rank: int
    reason: str


@dataclass(frozen=True)
class TakeStacks:
    """Take the running ranks' stacks (bounded), then hand in :class:`StacksTaken`.

    ``failure``: asked because a rank failed, heard on the thread that reads the ranks'
    events: take them on another, or their answers wait behind it."""

    ranks: tuple[int, ...]
    failure: bool = False


@dataclass(frozen=True)
class StopRanks:
    """Tell every rank to stop, and the backend to cancel."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """The ranks cannot go on: the job's owner (a session) says so and stops them."""

    reason: str


@dataclass(frozen=True)
class MarkFailed:
    """These ranks are taken for lost: failed in the state."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Drain:
    """Every rank ended: wait for their channels to drain, then settle the job."""


Action = SendWorld | Refuse | TakeStacks | StopRanks | Fail | MarkFailed | Drain


class End(str, enum.Enum):
    """How a job ended, which decides its error (``JobMachine.verdict``)."""

    DONE = "done"
    FAILED = "failed"  # a rank failed: the error names the root cause first (``blame``)
    LOST = "lost"  # connected ranks fell silent: the error names their hosts
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"


@dataclass
class JobMachine:
    """One job's life, from its launch to the verdict; see the module's docstring.

    ``owned``: a session owns the ranks (``job.Owner``): when they cannot go on it decides
    (:class:`Fail`), and a cancel takes no stacks (between cells they hang nowhere).
    """

    np: int
    owned: bool = False
    hellos: set[int] = field(default_factory=set)
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    #: The first rank heard to fail (by its supervisor's word or its outcome).
    first_failure: int | None = None
    #: Why the ranks were told to stop (None: they were not).
    cancel_reason: str | None = None
    timed_out: bool = False
    #: The ranks still running when they were told to stop.
    running_at_cancel: list[int] = field(default_factory=list)
    #: Ranks that fell silent while connected, by host.
    unheard: dict[int, str] = field(default_factory=dict)
    #: A stop waiting for the stacks (reason, whether a timeout).
    pending: tuple[str, bool] | None = None
    drained: bool = False

    # -- the one way in ----------------------------------------------------------------------------
    def handle(self, stimulus: Stimulus) -> list[Action]:
        """Take one stimulus; the actions to carry out, in order."""
        if isinstance(stimulus, Hello):
            return self._hello(stimulus.rank)
        if isinstance(stimulus, RankFailing):
            return self._failing(stimulus.rank)
        if isinstance(stimulus, Outcome):
            return self._outcome(stimulus.outcome)
        if isinstance(stimulus, Silent):
            return self._silent(stimulus.lost, stimulus.after)
        if isinstance(stimulus, WorldFailed):
            return self._cannot_go_on(f"the rendezvous failed: {stimulus.reason}")
        if isinstance(stimulus, Timeout):
            return self._ask_stop(f"timed out after {stimulus.after:g} s", timeout=True)
        if isinstance(stimulus, Cancel):
            return self._ask_stop(stimulus.reason, timeout=False)
        if isinstance(stimulus, StacksTaken):
            pending, self.pending = self.pending, None
            return [] if pending is None else self._stop(*pending)
        raise TypeError(f"not a stimulus of a job: {stimulus!r}")

    # -- what the shell reads ----------------------------------------------------------------------
    @property
    def running(self) -> list[int]:
        """Ranks without an outcome yet."""
        return [r for r in range(self.np) if r not in self.outcomes]

    @property
    def complete(self) -> bool:
        return len(self.outcomes) == self.np

    def verdict(self) -> End:
        """How the job ended, once every rank did: lost ranks over a timeout over a failure
        over a cancel."""
        statuses = [o.status for o in self.outcomes.values()]
        if self.unheard:
            return End.LOST
        if self.timed_out:
            return End.TIMEOUT
        if RankStatus.FAILED in statuses:
            return End.FAILED
        if RankStatus.CANCELLED in statuses:
            return End.CANCELLED
        return End.DONE

    # -- transitions -------------------------------------------------------------------------------
    def _hello(self, rank: int) -> list[Action]:
        self.hellos.add(rank)
        if self.cancel_reason is not None:
            return [Refuse(rank, self.cancel_reason)]
        return [SendWorld()] if len(self.hellos) >= self.np else []

    def _failing(self, rank: int) -> list[Action]:
        if self.first_failure is not None or self.cancel_reason is not None:
            return []
        self.first_failure = rank
        return self._after_failure(rank)

    def _outcome(self, outcome: RankOutcome) -> list[Action]:
        self.outcomes[outcome.rank] = outcome
        first = outcome.status == RankStatus.FAILED and self.first_failure is None
        if first:
            self.first_failure = outcome.rank
        if self.complete:
            if self.drained:
                return []
            self.drained = True
            return [Drain()]
        return self._after_failure(outcome.rank) if first else []

    def _after_failure(self, rank: int) -> list[Action]:
        """The first failure: where the others stand (their stacks and collectives: did they
        wait for the failed rank?), then stop them. Before the world went out they ran no
        code of the user's: stop them at once."""
        reason = f"rank {rank} failed"
        others = tuple(r for r in self.running if r != rank)
        if self.owned or self.pending is not None or not others or \
                len(self.hellos) < self.np:
            return self._stop(reason)
        self.pending = (reason, False)
        return [TakeStacks(others, failure=True)]

    def _silent(self, lost: Mapping[int, str], after: float) -> list[Action]:
        if self.cancel_reason is not None:
            return []  # ending anyway: the ranks were told to stop before they went silent
        self.unheard.update(lost)
        reason = f"{on_hosts(dict(lost))} not heard from for {after:g} s"
        return [MarkFailed(tuple(sorted(lost))), *self._cannot_go_on(reason)]

    def _cannot_go_on(self, reason: str) -> list[Action]:
        return [Fail(reason)] if self.owned else self._stop(reason)

    def _ask_stop(self, reason: str, *, timeout: bool) -> list[Action]:
        if self.drained or self.cancel_reason is not None or self.pending is not None:
            return []
        running = tuple(self.running)
        if self.owned or not running:
            return self._stop(reason, timeout)
        self.pending = (reason, timeout)
        return [TakeStacks(running)]

    def _stop(self, reason: str, timeout: bool = False) -> list[Action]:
        if self.cancel_reason is not None:
            return []
        self.cancel_reason = reason
        self.timed_out = timeout
        self.running_at_cancel = self.running
        return [StopRanks(reason)]


# -- a session's cell -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CellValue:
    """A rank's value for the cell arrived whole and checked."""

    rank: int
    at: float


@dataclass(frozen=True)
class CellError:
    """A rank's cell raised (``kind``: the exception's type; ``KeyboardInterrupt`` is an
    interrupt's doing, never the failure the cell is blamed for)."""

    rank: int
    kind: str
    message: str
    at: float


@dataclass(frozen=True)
class GraceOver:
    """The ranks an interrupt was sent to had ``INTERRUPT_GRACE_S`` to stop."""

    at: float


@dataclass(frozen=True)
class Interrupt:
    """KeyboardInterrupt in the cell on ``ranks``, and arm the grace timer."""

    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class BreakSession:
    """Ranks did not stop within the grace: the session is broken."""

    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class SettleCell:
    """Every rank ended: settle the cell with ``end``."""

    end: End


CellStimulus = CellValue | CellError | Cancel | GraceOver
CellAction = Interrupt | BreakSession | SettleCell


@dataclass
class CellMachine:
    """A session cell's life: its ranks end with a value or an error, the first failure
    interrupts the others (they may wait for it in a collective), a second cancel adds
    nothing, and ranks that do not stop within the grace break the session."""

    #: The ranks the cell runs on (``--targets``; every rank of the session by default).
    ranks: tuple[int, ...]
    values: set[int] = field(default_factory=set)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank → (kind, message)
    #: The rank the cell's error names: the first to fail other than by an interrupt.
    first_error: int | None = None
    #: Why the cell was interrupted (None: it was not).
    interrupted: str | None = None
    settled: bool = False

    def handle(self, stimulus: CellStimulus) -> list[CellAction]:
        """Take one stimulus; the actions to carry out, in order."""
        if isinstance(stimulus, (CellValue, CellError)):
            return self._rank_ended(stimulus)
        if isinstance(stimulus, Cancel):
            return self._interrupt(stimulus.reason)
        if isinstance(stimulus, GraceOver):
            if self.settled:
                return []
            return [BreakSession(tuple(self.running), self.interrupted or "")]
        raise TypeError(f"not a stimulus of a session cell: {stimulus!r}")

    @property
    def running(self) -> list[int]:
        return [r for r in self.ranks if r not in self.values and r not in self.errors]

    def verdict(self) -> End:
        if self.first_error is not None:
            return End.FAILED
        return End.CANCELLED if self.errors else End.DONE

    def _rank_ended(self, stimulus: CellValue | CellError) -> list[CellAction]:
        rank = stimulus.rank
        if self.settled or rank in self.values or rank in self.errors:
            return []
        actions: list[CellAction] = []
        if isinstance(stimulus, CellValue):
            self.values.add(rank)
        else:
            self.errors[rank] = (stimulus.kind, stimulus.message)
            if self.first_error is None and stimulus.kind != "KeyboardInterrupt":
                self.first_error = rank
            if self.interrupted is None and self.running:
                actions += self._interrupt(f"rank {rank} failed")
        if not self.running:
            self.settled = True
            actions.append(SettleCell(self.verdict()))
        return actions

    def _interrupt(self, reason: str) -> list[CellAction]:
        if self.settled or self.interrupted is not None:
            return []
        self.interrupted = reason
        return [Interrupt(tuple(self.running), reason)]


# -- a restart waiting for the slots of its ranks --------------------------------------------------
class Step(str, enum.Enum):
    """What a restart waiting for capacity does next (:meth:`CapacityWait.step`)."""

    CANCEL = "cancel"  # the job was cancelled meanwhile: end it as cancelled
    START = "start"  # the backend has the slots: start the attempt
    GIVE_UP = "give up"  # the wait is over (``--capacity-wait`` or the job's ``--timeout``)
    WAIT = "wait"  # ask again later (at most the seconds left)


@dataclass(frozen=True)
class CapacityWait:
    """A job that restarts (``elastic.ElasticJob``) waiting for the slots of its ranks: until
    ``--capacity-wait`` passes, or the job's own ``--timeout`` if that comes first (a timeout
    during a restart wait ends the job then, naming the timeout)."""

    until: float
    bound: str  # the words for ``until``

    @classmethod
    def begin(cls, now: float, capacity_wait: float, job_deadline: float | None,
              job_timeout: float | None) -> CapacityWait:
        until, bound = now + capacity_wait, f"{capacity_wait:g} s (--capacity-wait)"
        if job_deadline is not None and job_deadline < until:
            until, bound = job_deadline, f"the job's --timeout of {job_timeout or 0:g} s"
        return cls(until, bound)

    def step(self, now: float, *, cancelled: bool, fits: bool) -> tuple[Step, float]:
        """What to do at ``now``: a cancel first, then the slots, then the bound; with
        :attr:`Step.WAIT`, the seconds left."""
        if cancelled:
            return Step.CANCEL, 0.0
        if fits:
            return Step.START, 0.0
        left = self.until - now
        return (Step.GIVE_UP, 0.0) if left <= 0 else (Step.WAIT, left)


# -- words ----------------------------------------------------------------------------------------
def ranks_text(ranks: list[int]) -> str:
    """``rank 2`` / ``ranks 1, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def on_hosts(by_rank: dict[int, str]) -> str:
    """``rank 2 on h1`` / ``ranks 1, 3 on h1 and rank 4 on h2``."""
    hosts: dict[str, list[int]] = {}
    for rank, host in sorted(by_rank.items()):
        hosts.setdefault(host, []).append(rank)
    return " and ".join(f"{ranks_text(r)} on {h}" for h, r in hosts.items())

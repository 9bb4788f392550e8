"""The result handle of work on ranks, and this kernel's list of them.

``Handle`` is what the magics, the views and ``nbdist.run``'s caller hold of a job
(``job.Job``), a job that restarts (``elastic.ElasticJob``) or a session's cell
(``session.SessionCell``): read through one set of methods, and ended through one
(``Handle._settle``), which sets the outcome once. The registry keeps the last
``settings.history`` of them for ``%dist_status`` and lets go of old values beyond
``settings.history_mb`` (``retain``).
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nbdist.errors import OutputLostWarning, ValuesDroppedError
from nbdist.settings import settings

if TYPE_CHECKING:
    from nbdist import state
    from nbdist.stacks import Stacks

#: How long ``stacks()`` waits for the ranks' answers (a supervisor gives a dump 2 s).
STACKS_WAIT_S = 3.0

_ids = itertools.count(1)


def new_id(prefix: str = "j") -> str:
    """A job id not used before in this kernel (``j1``, ``j2``, ...)."""
    return f"{prefix}{next(_ids)}"

class Handle:
    """What the magics and views use of work on ranks: a :class:`Job`, a session's cell
    (``session.SessionCell``) or a job that restarts (``elastic.ElasticJob``), in the mould of
    :class:`concurrent.futures.Future`: :meth:`done`, :meth:`wait`, :meth:`result`,
    :meth:`exception`, :meth:`cancel`.

    What the work gave back is kept here and read here, once for all three: the error it ended
    with, every rank's value and their pickled size, whether the values were let go
    (``settings.history_mb``), what output never reached the notebook. A subclass hands them
    to :meth:`_settle`, the one method that ends any of them; it says how to wait
    (:meth:`wait`: the one wait loop, ``nbdist.waiting``) and to cancel (:meth:`cancel`).
    Where another handle holds the values (a job that restarts: its last attempt), the
    subclass names it with the one override hook, :meth:`_holder`.
    """

    id: str
    np: int
    state: state.JobState
    #: What the messages call it ("job", "cell").
    noun = "job"
    #: The ranks whose values it gives, in rank order (None: every rank): ``result()`` is the
    #: first one's value, ``results`` theirs (a session cell's ``--targets``).
    targets: tuple[int, ...] | None = None

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._values: dict[int, Any] = {}  # rank → value, once the work is over
        self._size = 0  # pickled size of _values
        self._dropped = False
        self._lost: str | None = None  # what output never reached the notebook, in words
        self._warned = False
        self._values_lock = threading.Lock()
        self._settled = False  # the outcome is set (``_settle``), perhaps not yet told

    # -- what a subclass says ------------------------------------------------------------------
    def wait(
        self, timeout: float | None = None, on_tick: Callable[[], None] | None = None
    ) -> bool:
        """Block until the work is over (True) or ``timeout`` passed (False); ``on_tick`` is
        called about ten times a second meanwhile (views render there)."""
        raise NotImplementedError

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop the work on every rank; it ends as cancelled."""
        raise NotImplementedError

    def _holder(self) -> Handle:
        """The handle that holds the values (this one, or a job's last attempt)."""
        return self

    # -- written once --------------------------------------------------------------------------
    def _settle(
        self,
        error: BaseException | None,
        close: Callable[[], None] | None = None,
        *,
        values: dict[int, Any] | None = None,
        size: int | None = None,
        lost: str | None = None,
    ) -> bool:
        """The one place the work's outcome is set, once: ``error`` (None: it succeeded), and
        the ranks' ``values``, their pickled ``size`` and the ``lost`` output where the caller
        gathered them at the end (a session cell gathers its values as they come).

        Then ``close`` runs (the subclass closes its state, its timers: what a waiter may
        read the moment it sees the work done), then the values are counted against
        ``settings.history_mb`` (``retain``: older jobs let theirs go), then :meth:`done` turns
        true, so that a waiter finds the bound kept. False, and nothing done,
        when the outcome was set already: a job, a restarting job and a session cell may each
        be told to end from several threads (their last rank, a timeout, a cancel).
        """
        with self._values_lock:
            if self._settled:
                return False
            self._settled = True
            self._error = error
            if values is not None:
                self._values = values
            if size is not None:
                self._size = size
            if lost is not None:
                self._lost = lost
        try:
            if close is not None:
                close()
        finally:
            try:
                if self.retained_bytes():
                    retain(self)
            finally:
                self._done.set()
        return True

    @property
    def settled(self) -> bool:
        """True once the outcome is set (``done`` follows once the state is closed)."""
        return self._settled

    def done(self) -> bool:
        """True once every rank has ended and the outcome is known."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's value; raises :class:`DistributedError` if the work failed, and
        TimeoutError if it still runs after ``timeout`` seconds."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self.noun} {self.id} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        holder = self._holder()
        if holder is not self:
            return holder.result()
        if self._dropped:
            raise dropped_error(self.id)
        if self._lost is not None and not self._warned:
            self._warned = True
            warnings.warn(self._lost, OutputLostWarning, stacklevel=2)
        return self._values.get(self.targets[0] if self.targets else 0)

    @property
    def results(self) -> list[Any]:
        """Every rank's value, index = rank (waits for the work); ``targets``' only, in rank
        order, where it has them."""
        self.result()
        holder = self._holder()
        ranks = holder.targets if holder.targets is not None else range(holder.np)
        return [holder._values.get(r) for r in ranks]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the work ended with (None: it succeeded), once it is over."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self.noun} {self.id} is still running after {timeout} s")
        return self._error

    @property
    def error(self) -> BaseException | None:
        """The error the work ended with; None while it runs and when it succeeded."""
        return self._error

    @property
    def lost_output(self) -> str | None:
        """What the ranks printed or reported that never reached the notebook, in words."""
        holder = self._holder()
        return self._lost if holder is self else holder.lost_output

    def retained_bytes(self) -> int:
        """Pickled size of the values it holds (0 when it holds none)."""
        holder = self._holder()
        if holder is self:
            return self._size
        # Nothing until the outcome is set: the holder's own end counts its values then.
        return holder.retained_bytes() if self._settled else 0

    def stacks(self, timeout: float = STACKS_WAIT_S) -> Stacks:
        """Every live rank's stacks, grouped (``%dist_stacks``)."""
        raise NotImplementedError

    def drop_values(self) -> None:
        """Let its values go (see ``settings.history_mb``): ``result()`` then says so."""
        holder = self._holder()
        if holder is not self:
            holder.drop_values()
            return
        with self._values_lock:
            self._dropped = True
            self._values, self._size = {}, 0
        self.state.values_dropped = True


_jobs: OrderedDict[str, Handle] = OrderedDict()
_jobs_lock = threading.Lock()


def register(job: Handle) -> None:
    """Add a job to this kernel's list (``%dist_status``), forgetting the oldest ones."""
    with _jobs_lock:
        _jobs[job.id] = job
        while len(_jobs) > settings.history:
            _jobs.popitem(last=False)


def forget(job: Handle) -> None:
    """Take a job off this kernel's list: one whose launch failed (its cell got the error; it
    never ran, and %dist_status must not show it pending for ever)."""
    with _jobs_lock:
        if _jobs.get(job.id) is job:
            del _jobs[job.id]


def retain(newest: Handle) -> None:
    """``newest`` holds its values now: let go of those of jobs that ended before it, once
    they and the jobs that ended after them hold more than ``settings.history_mb``."""
    with _jobs_lock:
        older = [j for j in _jobs.values() if j is not newest and j.retained_bytes()]
    older.sort(key=lambda j: j.state.ended or 0.0, reverse=True)  # the last to end first
    total = newest.retained_bytes()
    for job in older:
        total += job.retained_bytes()
        if total > settings.history_bytes:
            job.drop_values()


def dropped_error(job_id: str) -> ValuesDroppedError:
    """What ``.result()`` says of a job whose values were let go."""
    return ValuesDroppedError(
        f"job {job_id}'s values were let go to bound the kernel's memory: the jobs after it "
        f"hold more than {settings.history_mb:g} MiB of values (%config DistMagics.history_mb). "
        f"To keep a value, take it when the job ends (x = job.result(), or %%distributed "
        f"-o VAR for every rank's), or raise %config DistMagics.history_mb."
    )


def jobs() -> list[Handle]:
    """This kernel's jobs, oldest first (the last ``settings.history`` of them)."""
    with _jobs_lock:
        return list(_jobs.values())


def get_job(job_id: str | None = None) -> Handle | None:
    """A job by id; without an id the newest job still running, else the newest."""
    all_jobs = jobs()
    if job_id is not None:
        return next((j for j in all_jobs if j.id == job_id), None)
    running = [j for j in all_jobs if not j.done()]
    candidates = running or all_jobs
    return candidates[-1] if candidates else None

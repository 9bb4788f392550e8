"""One job's life: register with the event server, launch, do the rendezvous, wait, cancel,
gather results and failures.

Which backend runs it is the registry's choice (``nbdist.launch.backends``); how ranks start is
the launcher's business (``nbdist.launch``); how the job is shown is the
views' (``nbdist.views``). When the job stops its ranks, and how it ended, is its machine's
(``nbdist.lifecycle.JobMachine``): this module is that machine's I/O shell, which turns what
the event server, the backend and the timers say into stimuli, carries out the actions, keeps
the state (``nbdist.state``) up to date and settles the job's ``Handle`` once.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from nbdist import (
    _pickling,
    channel,
    collectives,
    endings,
    events,
    launch,
    lifecycle,
    logfiles,
    state,
    timeline,
    tracking,
)
from nbdist._timer import after
from nbdist.capture import call_code
from nbdist.endings import unreachable_hint as unreachable_hint
from nbdist.errors import (
    DistributedError,
    LaunchError,
    Reason,
    launch_failed,
)
from nbdist.handle import STACKS_WAIT_S as STACKS_WAIT_S
from nbdist.handle import Handle as Handle
from nbdist.handle import dropped_error as dropped_error
from nbdist.handle import forget
from nbdist.handle import get_job as get_job
from nbdist.handle import jobs as jobs
from nbdist.handle import new_id as new_id
from nbdist.handle import register as register
from nbdist.handle import retain as retain
from nbdist.launch import Launcher, backends
from nbdist.launch.payload import payload_env, payload_modules
from nbdist.options import JobOptions, options_from
from nbdist.protocol import (
    CallPayload,
    DriverEvent,
    LaunchRequest,
    Payload,
    RankOutcome,
    RankStatus,
)
from nbdist.settings import settings
from nbdist.stacks import Stacks, rank_ranges
from nbdist.waiting import wait_loop
from nbdist.world import Hello, plan_world

#: How long a cancel may take before the job is declared over anyway.
TEARDOWN_S = 15.0
#: How long a finished job waits for its ranks' event channels to drain (their last lines).
DRAIN_S = 10.0
#: How often the driver pings the ranks of a remote job (they stop when they hear nothing
#: for their heartbeat timeout) and looks for ranks it has not heard of itself.
PING_S = state.HEARTBEAT_S
#: Lines of a rank's output shown for a rank that gave no stacks.
STACKS_TAIL_LINES = 5
#: What a rank's pdb asks with; the notebook's prompt says which rank asks.
PDB_PROMPT = "(Pdb) "
#: How long a timeout or a cancel waits for the ranks' stacks before it stops them: ranks that
#: answer end the wait at once (tens of ms); 2.5 s was too short on a machine loaded 8 times
#: over (a fresh clone's CI run: a timed-out job came back without its stacks).
FORENSICS_S = 5.0
#: Kinds of event that only feed the job's state (output also its log files): a write made of
#: these is folded at once (``Job.on_events``).
_FOLDED = frozenset({"out", "progress", "metrics", "res", "hb"})

log = logging.getLogger(__name__)


def default_gpu(launcher: Launcher) -> bool:
    return launcher.capacity().gpus > 0


class Owner(Protocol):
    """What owns a job's ranks besides the job itself: a session, whose ranks take cells after
    they start (``nbdist.session``). The job tells it what happens to them; ``job`` is the job
    calling, which the owner may not have been handed yet (ranks talk as soon as they start).
    """

    def on_event(self, job: Job, rank: int, event: channel.Event) -> bool:
        """An event of a rank, before the job folds it in; True: the owner took it whole."""
        ...

    def block_buffer(self, job: Job, rank: int, event: channel.Event) -> memoryview | None:
        """Where a binary block goes (``events.JobChannel``)."""
        ...

    def on_failure(self, job: Job, reason: str) -> None:
        """The ranks cannot go on (the rendezvous failed, connected ranks fell silent): the
        owner says so and cancels the job."""
        ...

    def on_outcome(self, job: Job, outcome: RankOutcome) -> None:
        """A rank ended (before the job records it)."""
        ...

    def on_finish(self, job: Job) -> None:
        """Every rank ended and the job's outcome is known."""
        ...


class Job(Handle):
    """A distributed job: ``np`` ranks running one payload.

    Use :meth:`result` for rank 0's value, :attr:`results` for every rank's, :meth:`cancel`
    to stop it. ``state`` is the live :class:`nbdist.state.JobState` that views render.
    """

    def __init__(
        self,
        payload: Payload | None,
        np: int,
        launcher: Launcher,
        options: JobOptions | None = None,
        *,
        owner: Owner | None = None,
        job_state: state.JobState | None = None,
        world_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        options = JobOptions() if options is None else options
        #: How the job runs (its ``backend`` was chosen already: ``launcher``).
        self.options = options
        #: A session's ranks: started without a payload, owned by the session (``Owner``).
        session = owner is not None
        self._owner = owner
        self._payload = payload
        self._payload_bytes = 0  # what the payload pickled to (Job.start)
        self.id = new_id("s" if session else "j")
        self.label = options.label
        self.np = np
        self.launcher = launcher
        self.gpu = default_gpu(launcher) if options.gpu is None else options.gpu
        self.timeout = options.timeout
        # Given: this job is one attempt of a job that restarts (``nbdist.elastic``), which
        # owns the state the views render and is the one listed by %dist_status.
        self._attempt = job_state is not None
        self.state = job_state if job_state is not None else state.JobState(
            self.id, launcher.name, np)
        self.run_id = secrets.token_hex(8)
        # Every line of every rank, in a file per rank (an attempt appends to its job's).
        # Written by a thread of the job's own, never the event server's (``logfiles``).
        self._logs = logfiles.for_job(self.state.id, options.log_dir, self.state.set_log_error)
        self.state.log_dir = self._logs.folder
        self._secret = channel.new_secret()
        # The notebook's active MLflow run, for the ranks' own logging (nbdist.tracking);
        # the user's --env wins.
        # torch's flight recorder on in every rank (nbdist.collectives), unless turned off.
        self._env = {**collectives.recorder_env(settings.flight_recorder),
                     **tracking.run_env(), **dict(options.env)}
        # Variables given at the rendezvous only (an attempt of a job that restarts: its
        # restart count): they must not key the local backend's warm ranks. Ranks that plan
        # their world without the driver (the supervisor's fallback) get them with the launch
        # request; remote ranks get them in their environment at launch too.
        self._world_env = dict(world_env or {})
        #: Logs rank 0's reported metrics into that run (``--mlflow``), else None.
        self._mlflow = tracking.MetricsLogger.for_active_run() if options.mlflow else None
        self._hellos: dict[int, Hello] = {}
        # Open event connections per rank. A rank's outcome comes back through the launcher,
        # its output through the event channel: the job only ends once every channel has
        # been read to its end, or the last lines a rank printed would be lost.
        self._open: dict[int, int] = {}
        # The job's life (``lifecycle``): what happened and what to do about it is decided
        # there, under ``_lock``; this class carries the actions out.
        self._machine = lifecycle.JobMachine(np, owned=session)
        self._outcomes = self._machine.outcomes
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._stacks_in = threading.Condition(self._lock)  # answers to stacks requests
        self._stacks_asked = 0
        self._stacks: dict[int, dict[int, channel.Event]] = {}  # request → rank → answer
        self._forensics: str | None = None  # the stacks taken before nbdist stopped it
        self._collectives = ""  # where its ranks stood in their collectives, then
        #: Ranks' debuggers waiting for a line typed in the notebook: (rank, what they wrote).
        self._questions: queue.Queue[tuple[int, str]] = queue.Queue()
        self._started = time.monotonic()
        #: Ranks the driver stopped hearing from while their connection stayed open (a host
        #: or network cut off), by host: they are what the job's error names.
        self._unheard = self._machine.unheard
        self._heartbeat = launch.heartbeat_timeout() if launcher.remote else None
        self._timer: threading.Timer | None = None

    def start(self) -> Job:
        """Launch the ranks, once: check the backend's capacity, register with the event
        server, hand the backend the launch request, arm the timeout and the keepalive.

        Returns the job. Until it is called nothing runs, so whoever owns the job (an
        ``Owner``) has it in hand before the first event of a rank arrives.
        """
        np, launcher, payload, timeout = self.np, self.launcher, self._payload, self.timeout
        session = self._owner is not None
        self._payload = None  # the pickle below is what travels; the values need not stay
        launcher.check(np, self.gpu)
        # A session's ranks start without a payload: its cells follow on the event channel.
        body = b"" if payload is None else _pickling.dumps(payload)
        self._payload_bytes = len(body)
        self.address = launcher.driver_address()
        self._server = _server(self.address)
        self._server.add_job(self.id, self._secret, self)
        if not session and not self._attempt:  # a session's cells are the jobs users see
            register(self)
        request = LaunchRequest(
            job_id=self.id, np=np, secret=self._secret, driver=self._server.address,
            # What the cell sets in os.environ first thing (KERAS_BACKEND, ...) is given to the
            # ranks from the start, so that modules imported ahead see it too.
            payload=body, gpu=self.gpu, env={
                **self._env, **(payload_env(payload) if payload else {}),
                **(self._world_env if launcher.remote else {})},
            run_id=self.run_id, world_env=self._world_env,
            modules=payload_modules(payload) if payload else (), session=session,
            heartbeat_timeout=self._heartbeat,
        )
        try:
            launcher.start(request, self._on_outcome)
        except BaseException:
            self._server.remove_job(self.id)
            forget(self)
            raise
        if timeout is not None:
            self._timer = after(timeout, self._on_timeout)
        quiet = settings.stacks_when_quiet
        if quiet and not session:
            threading.Thread(target=self._watch_quiet, args=(quiet,), daemon=True,
                             name=f"nbdist-quiet-{self.id}").start()
        if self._heartbeat is not None:
            threading.Thread(target=self._keepalive, args=(self._heartbeat,), daemon=True,
                             name=f"nbdist-keepalive-{self.id}").start()
        return self

    # -- the event channel (called on the server's thread) -------------------------------------
    def on_connect(self, rank: int, hello: channel.Event) -> None:
        h = Hello.from_event(rank, hello)
        self.state.apply(rank, {"t": "hello", "host": h.host, "gpus": list(h.gpus)})
        with self._lock:
            self._open[rank] = self._open.get(rank, 0) + 1
            self._hellos[rank] = h
        self._act(lifecycle.Hello(rank, time.time()))

    def _act(self, stimulus: lifecycle.Stimulus) -> None:
        """Hand the machine a stimulus, then carry out what it says (outside the lock)."""
        with self._lock:
            actions = self._machine.handle(stimulus)
            if isinstance(stimulus, lifecycle.Outcome):
                self._stacks_in.notify_all()  # an ended rank gives no stacks: wait no more
        for action in actions:
            self._do(action)

    def _do(self, action: lifecycle.Action) -> None:  # noqa: C901 - one branch per action
        if isinstance(action, lifecycle.SendWorld):
            self._send_world()
        elif isinstance(action, lifecycle.Refuse):
            # A rank that connects after the cancel (a Spark task that started late) must not
            # get the rendezvous and run the user's code: stop it instead.
            self.send(action.rank, {"t": "cancel", "reason": action.reason})
        elif isinstance(action, lifecycle.TakeStacks):
            if action.failure:  # heard on the thread the answers come on
                threading.Thread(target=self._forensics_then_stop, daemon=True,
                                 name=f"nbdist-forensics-{self.id}").start()
            else:
                self._forensics_then_stop()
        elif isinstance(action, lifecycle.StopRanks):
            for rank in range(self.np):
                self.send(rank, {"t": "cancel", "reason": action.reason})
            self.launcher.cancel()
        elif isinstance(action, lifecycle.Fail):
            assert self._owner is not None
            self._owner.on_failure(self, action.reason)
        elif isinstance(action, lifecycle.MarkFailed):
            for rank in action.ranks:
                self.state.set_rank(rank, state.FAILED)
        elif isinstance(action, lifecycle.Drain):
            with self._lock:
                self._drained.wait_for(self._all_drained, DRAIN_S)
            self._finish()

    def _send_world(self) -> None:
        with self._lock:
            hellos = dict(self._hellos)
        try:
            envs = plan_world(
                hellos, self.np, self.run_id, self.id, use_gpus=self.gpu,
                user_env={**self._env, **self._world_env},
            )
        except ValueError as exc:
            self._act(lifecycle.WorldFailed(str(exc), time.time()))
            return
        for rank_, env in envs.items():
            self.send(rank_, {"t": "world", "env": env})

    def on_event(self, rank: int, event: channel.Event) -> None:
        kind = event.get("t")
        if kind == "out" and isinstance(text := event.get("text"), str):
            self._logs.write(rank, text)
        elif kind == "debug":
            self._questions.put((rank, str(event.get("text", ""))))
            return
        elif kind == "stacks":
            with self._lock:
                answers = self._stacks.get(event.get("id"))  # type: ignore[arg-type]
                if answers is not None:
                    answers[rank] = event
                    self._stacks_in.notify_all()
            return
        if self._owner is not None and self._owner.on_event(self, rank, event):
            return
        self.state.apply(rank, event)
        if rank == 0 and self._mlflow is not None and event.get("t") == "metrics":
            self._mlflow.put(event.get("values") or {})
        if event.get("t") == "state" and event.get("state") == "failed":
            # The supervisor's last word before its outcome. A backend may hand outcomes over
            # only once every rank has ended (Spark's collect()): stop the others now.
            self._act(lifecycle.RankFailing(rank, time.time()))

    def on_events(self, rank: int, events: list[channel.Event]) -> None:
        """The events of one write (``events.JobChannel``): those that only feed the state,
        folded together; anything else, or a job with an owner, one by one."""
        if self._owner is not None or any(e.get("t") not in _FOLDED for e in events):
            for event in events:
                try:
                    self.on_event(rank, event)
                except Exception:  # as the server does for each: the others still count
                    log.exception("nbdist: event handler failed for %r", event.get("t"))
            return
        for event in events:
            if event.get("t") == "out" and isinstance(text := event.get("text"), str):
                self._logs.write(rank, text)
        mlflow = self._mlflow if rank == 0 else None
        if mlflow is None:
            self.state.apply_many(rank, events)
            return
        folded: list[Mapping[str, Any]] = []
        try:
            self.state.apply_many(rank, events, folded)
        finally:  # the metrics of the events that folded, even if another one raised
            for done in folded:
                if done.get("t") == "metrics":
                    mlflow.put(done.get("values") or {})

    def block_buffer(self, rank: int, event: channel.Event) -> memoryview | None:
        """Where a binary block goes (``events.JobChannel``); a plain job takes none."""
        return None if self._owner is None else self._owner.block_buffer(self, rank, event)

    def on_disconnect(self, rank: int) -> None:
        with self._lock:
            self._open[rank] = self._open.get(rank, 1) - 1
            self._drained.notify_all()

    # -- keepalive (remote ranks) -------------------------------------------------------------
    def _keepalive(self, timeout: float) -> None:
        """Ping the ranks, and fail the job when connected ranks fall silent for ``timeout``.

        A host that is cut off (a network down, a machine powered off) never closes its
        connections: without this the job would wait for Spark to give up on the executor
        (``spark.network.timeout``), and a session would never know.
        """
        next_ping = 0.0
        while not self._done.wait(1.0):
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + PING_S
                for rank in range(self.np):
                    self.send(rank, {"t": "ping"})
            lost = self._silent_connected(timeout)
            if lost:
                self._lose(lost, timeout)
                return

    def _silent_connected(self, timeout: float) -> dict[int, str]:
        """Ranks whose connection is open but who said nothing for ``timeout``, by host.

        A rank whose connection closed is not one of them: it runs on without the channel
        and its outcome still comes back through the backend.
        """
        now = time.time()
        with self._lock:
            open_ranks = [r for r, n in self._open.items() if n > 0 and r not in self._outcomes]
        with self.state.lock:
            return {
                r: self.state.ranks[r].host or "?" for r in open_ranks
                if (seen := self.state.ranks[r].last_seen) is not None and now - seen > timeout
            }

    def _lose(self, lost: dict[int, str], timeout: float) -> None:
        self._act(lifecycle.Silent(lost, timeout, time.time()))

    # -- outcomes ---------------------------------------------------------------------------
    def _on_outcome(self, outcome: RankOutcome) -> None:
        if self._owner is not None:
            self._owner.on_outcome(self, outcome)
        self.state.apply(outcome.rank, {"t": "marks", "at": {timeline.DELIVERED: time.time()}})
        host = outcome.lost_host
        hello = self._hellos.get(outcome.rank)
        ended_badly = outcome.status in (RankStatus.FAILED, RankStatus.CANCELLED)
        if host is not None and hello is not None and ended_badly:
            # The backend lost a host: the ranks that were on it went with it, the others
            # were stopped with the stage, whichever rank Spark happened to blame.
            if not hello.on(host):
                outcome = dataclasses.replace(outcome, status=RankStatus.CANCELLED, error=None,
                                              lost_host=None)
            elif outcome.status == RankStatus.CANCELLED:
                outcome = dataclasses.replace(outcome, status=RankStatus.FAILED, error={
                    "type": "ExecutorLost", "traceback": "",
                    "message": f"its Spark executor on {host} was lost",
                })
        if outcome.lost_lines and outcome.tail:
            # The rank's live output never arrived; its last lines came with its outcome.
            self._logs.write(outcome.rank, "".join(f"{t}\n" for t in outcome.tail))
            self.state.apply(outcome.rank, {"t": "out", "s": "o",
                                            "text": "".join(f"{t}\n" for t in outcome.tail)})
        self.state.set_rank(outcome.rank, outcome.status, outcome.exit_code)
        if outcome.status == RankStatus.FAILED or outcome.peak_rss:
            self.state.set_end(outcome.rank, outcome.how() if outcome.status ==
                               RankStatus.FAILED else "", outcome.peak_rss)
        self._act(lifecycle.Outcome(outcome, time.time()))

    def _all_drained(self) -> bool:
        """Every connection that can still deliver has closed (called with the lock held).

        The connections of ranks that fell silent are not waited for: a host cut off from
        the driver never closes them, and what they held back cannot arrive anyway.
        """
        now = time.time()
        for rank, n in self._open.items():
            if n <= 0 or rank in self._unheard:
                continue
            seen = self.state.ranks[rank].last_seen
            if seen is None or now - seen < state.SILENT_AFTER_S:
                return False
        return True

    def _on_timeout(self) -> None:
        if not self._done.is_set() and self.timeout is not None:
            self._act(lifecycle.Timeout(self.timeout, time.time()))

    def _watch_quiet(self, seconds: float) -> None:
        """Take the stacks once, when a running rank printed nothing for ``seconds``."""
        while not self._done.wait(min(1.0, seconds / 4)):
            quiet = self.state.quiet_ranks(seconds)
            if not quiet or self._machine.cancel_reason is not None:
                continue
            taken = self.stacks(FORENSICS_S)
            if taken.groups and not self.state.forensics:
                self.state.set_forensics(
                    f"{rank_ranges(quiet)} printed nothing for {seconds:g} s "
                    f"(%config DistMagics.stacks_when_quiet):\n" + taken.text())
            return

    def _forensics_then_stop(self) -> None:
        """Before stopping a running job: where each rank is, and where the ranks stand in
        their collectives, for the error and the views (bounded by ``FORENSICS_S``); then
        the stop (also after a second interrupt while they come in)."""
        try:
            self._forensics_now()
        finally:
            self._act(lifecycle.StacksTaken(time.time()))

    def _forensics_now(self) -> None:
        with self._lock:
            if self._forensics is not None:
                return
            running = self._machine.running
        if not running:
            return
        try:
            taken = self.stacks(FORENSICS_S)
        except Exception:  # forensics never stand in the way of the cancel
            return
        self._collectives = taken.collectives.text()
        if taken.groups or taken.collectives:
            self._forensics = taken.text()
            self.state.set_forensics(self._forensics)

    def _finish(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server.remove_job(self.id)
        self._logs.close()
        if self._payload_bytes >= TRIM_AFTER_BYTES:
            _trim_heap()
        outcomes = [self._outcomes[r] for r in range(self.np)]
        error = self._verdict_error(outcomes)
        values: dict[int, Any] | None = None
        size: int | None = None
        if error is None:
            try:
                values = {o.rank: self._load(o) for o in outcomes}
            except DistributedError as exc:
                error = exc
            else:
                size = sum(len(o.result or b"") for o in outcomes)
        for o in outcomes:
            o.result = None  # the values are kept, not their pickles too
        if self._collectives and isinstance(error, DistributedError) and \
                error.reason in (Reason.TIMEOUT, Reason.CANCELLED, Reason.FAILED):
            # The collectives line in the message itself: the first thing a hung job says
            # (and a failed one: did the others wait for the rank that failed?).
            error = DistributedError(f"{error}\n{self._collectives}", job_id=self.id,
                                     reason=error.reason, failures=error.failures,
                                     stacks=error.stacks)
        lost = endings.lost_output(outcomes, self.address)
        if lost is not None and isinstance(error, DistributedError):
            error = DistributedError(f"{error}\n{lost}", job_id=self.id,
                                     reason=error.reason, failures=error.failures,
                                     stacks=error.stacks)
        final = state.DONE if error is None else (
            state.CANCELLED if getattr(error, "reason", "") == Reason.CANCELLED else state.FAILED
        )

        def close() -> None:
            if self._mlflow is not None:
                self._mlflow.close(timeout=5.0)  # what rank 0 reported is in the run on return
            self.state.finish(final, str(error) if error is not None else lost or "")

        self._settle(error, close, values=values, size=size, lost=lost)
        if self._owner is not None:
            self._owner.on_finish(self)

    def _verdict_error(self, outcomes: list[RankOutcome]) -> BaseException | None:
        """The error the machine's verdict ends the job with; None when it succeeded."""
        failed = [o for o in outcomes if o.status == RankStatus.FAILED]
        error: BaseException | None = None
        end = self._machine.verdict()
        if end is lifecycle.End.LOST:
            error = endings.unheard_error(self.id, self._unheard, self._outcomes, self.state.ranks,
                                          self._heartbeat or 0.0)
        elif end is lifecycle.End.TIMEOUT:
            error = endings.timeout_error(self.id, self.timeout or 0.0,
                                          self._machine.running_at_cancel, self.state.ranks,
                                          self._forensics or "")
        elif end is lifecycle.End.FAILED:
            error = endings.failure_error(self.id, self.np, failed, self._outcomes,
                                          self._machine.first_failure)
        elif end is lifecycle.End.CANCELLED:
            error = DistributedError(
                f"job {self.id} was cancelled ({self._machine.cancel_reason}); all {self.np} ranks "
                f"were stopped", job_id=self.id, reason=Reason.CANCELLED,
                stacks=self._forensics or "",
            )
        return error

    def _load(self, outcome: RankOutcome) -> Any:
        try:
            return pickle.loads(outcome.result or pickle.dumps(None))
        except Exception as exc:
            raise DistributedError(
                f"rank {outcome.rank}'s result (a {outcome.result_type}) cannot be unpickled "
                f"in the notebook: {type(exc).__name__}: {exc}. Return plain values "
                f"(numbers, lists, numpy arrays, CPU tensors, state dicts) from the cell, or "
                f"make the class importable in the notebook.",
                job_id=self.id, reason=Reason.FAILED, failures={outcome.rank: str(exc)},
            ) from None

    # -- public -----------------------------------------------------------------------------
    @property
    def secret(self) -> str:
        """The job's secret: it signs the ranks' hellos and a session's values."""
        return self._secret

    @property
    def cancel_reason(self) -> str | None:
        """Why the job was cancelled (by the user, a failure, a timeout), or None."""
        return self._machine.cancel_reason

    def send(self, rank: int, event: DriverEvent, direct: bool = False) -> bool:
        """Send ``event`` to ``rank`` on the event channel; False if it is not connected.

        ``direct``: hand it to the rank's supervisor in the calling thread where it is a
        thread of this process (``Launcher.deliver``; a local rank), the channel elsewhere.
        Messages sent so may overtake those sent on the channel just before."""
        if direct and self.launcher.deliver(rank, event):
            return True
        return self._server.send(self.id, rank, event)

    def stacks(self, timeout: float = STACKS_WAIT_S, job_id: str | None = None) -> Stacks:
        """The stacks of every thread of every rank still running, grouped (``nbdist.stacks``).

        Each rank's supervisor has its interpreter write them (``faulthandler``: also from C
        code); a rank that gives none within ``timeout`` is named with its last lines.
        """
        started = time.monotonic()
        with self._lock:
            self._stacks_asked += 1
            req = self._stacks_asked
            answers: dict[int, channel.Event] = {}
            self._stacks[req] = answers
            live = [r for r in range(self.np) if r not in self._outcomes]
        asked = [r for r in live if self.send(r, {"t": "stacks", "id": req})]
        with self._lock:
            self._stacks_in.wait_for(
                lambda: all(r in answers or r in self._outcomes for r in asked), timeout)
            self._stacks.pop(req, None)
            got = dict(answers)
        dumps: dict[int, str] = {}
        native: dict[int, str] = {}
        packages: dict[int, str] = {}
        missing: dict[int, str] = {}
        fr = {r: a["fr"] for r, a in got.items() if isinstance(a.get("fr"), str) and a["fr"]}
        for rank in live:
            answer = got.get(rank)
            text = answer.get("text") if answer is not None else None
            if isinstance(text, str) and text:
                dumps[rank] = text
                package = answer.get("package") if answer is not None else None
                if isinstance(package, str) and package:
                    packages[rank] = package
                frames = answer.get("native") if answer is not None else None
                if isinstance(frames, str) and frames:
                    native[rank] = frames
                continue
            if answer is not None:
                why = str(answer.get("error") or "no stacks")
            elif rank in asked:
                why = f"did not answer within {timeout:g} s"
            else:
                why = "is not connected to the driver"
            r = self.state.ranks[rank]
            with self.state.lock:
                tail = [ln.text for ln in list(r.log)[-STACKS_TAIL_LINES:]]
            missing[rank] = why + ("; its last lines:\n" + "\n".join(tail) if tail else
                                   "; it printed nothing")
        taken = Stacks.from_dumps(job_id or self.state.id, dumps, missing,
                                  time.monotonic() - started, native, fr, live,
                                  packages)
        if fr and taken.collectives:
            # The raw dumps beside the logs, for torch's own analyser (its pickle format).
            taken.saved = logfiles.write_flight_records(self._logs.folder, fr)
        return taken

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every rank (SIGTERM, SIGKILL after 2 s); the job ends as cancelled.

        The stacks of the ranks still running are taken first (at most ``FORENSICS_S``) and
        kept with the job's error and state: where a hung job hung.
        """
        if not self._done.is_set():  # a session's ranks between cells: no stacks (lifecycle)
            self._act(lifecycle.Cancel(reason, time.time()))

    def wait(
        self, timeout: float | None = None, on_tick: Callable[[], None] | None = None
    ) -> bool:
        """Block until the job is over (True) or ``timeout`` passed (False).

        ``on_tick`` is called about ten times a second while waiting (views render there).
        A KeyboardInterrupt cancels the job, waits for the teardown and re-raises.
        """
        return wait_loop(self._done, timeout, self.with_debugger(on_tick), cancel=self.cancel,
                         teardown_s=TEARDOWN_S)

    def with_debugger(self, on_tick: Callable[[], None] | None) -> Callable[[], None]:
        """``on_tick``, then the questions of the ranks' debuggers (``breakpoint()``), asked
        in the waiting thread: the notebook's input box."""
        def tick() -> None:
            if on_tick is not None:
                on_tick()
            self.serve_debugger()
        return tick

    def serve_debugger(self) -> None:
        """Ask the notebook's input box (``input()``: the frontend's stdin in Jupyter, the
        terminal in IPython) for each line a rank's debugger waits for, labelled with the rank,
        and send it to that rank. Only in the main thread, where a cell runs and waits: a
        job that restarts waits on its attempts from a thread of its own, which must not ask."""
        if threading.current_thread() is not threading.main_thread():
            return
        while True:
            try:
                rank, text = self._questions.get_nowait()
            except queue.Empty:
                return
            shown = text.removesuffix(PDB_PROMPT)
            if shown:
                print(shown, end="" if shown.endswith("\n") else "\n", flush=True)
            try:
                line = input(f"[rank {rank}] {PDB_PROMPT}")
            except (EOFError, NotImplementedError) as exc:
                # No input box: an end of input (a terminal's ^D, a closed stdin), or a
                # frontend without stdin (nbclient, papermill: ipykernel's input() raises
                # StdinNotImplementedError, a NotImplementedError). Raised from here it would
                # leave the rank in pdb and the job (or the session's cell) running until its
                # timeout; the documented answer is ``c``, said where the cell's output goes.
                line = "c"
                print(f"[rank {rank}] no input box to ask "
                      f"({'no stdin' if isinstance(exc, NotImplementedError) else 'end of input'}"
                      f"): answered c (continue)", flush=True)
            if not self._done.is_set():
                self.send(rank, {"t": "debug", "text": line})

    @property
    def outcomes(self) -> dict[int, RankOutcome]:
        """How each rank ended so far (every rank once the job is done), without values."""
        with self._lock:
            return dict(self._outcomes)

    @property
    def lost_hosts(self) -> dict[int, str]:
        """Ranks the driver stopped hearing from while they were connected, with their host."""
        with self._lock:
            return dict(self._unheard)

    def __repr__(self) -> str:
        where = f"{self.np} ranks on {self.launcher.name}"
        return f"<nbdist job {self.id}: {where}, {self.state.status}>"


def _server(address: events.DriverAddress) -> events.EventServer:
    """The kernel's event server for ``address``; a clear error when it cannot listen there."""
    try:
        return events.shared_server(address)
    except OSError as exc:
        where = f"{events.interface_text(address.bind)} port {address.port or '(any)'}"
        raise LaunchError(
            f"nbdist cannot listen for its ranks on {where}: {exc.strerror or exc}. Its event "
            f"server would be {address.source or 'there'}. Pick a free port "
            f"(%config DistMagics.driver_port / NBDIST_DRIVER_PORT) and an address of this "
            f"machine to listen on (spark.driver.bindAddress); the address told to the ranks "
            f"(DistMagics.driver_host) need not be this machine's."
        ) from None


#: A job whose payload pickled to this much gives the freed memory back to the system when it
#: ends (``_trim_heap``): a large notebook package read and pickled in pieces left the kernel
#: that much bigger, free but kept by the C allocator.
TRIM_AFTER_BYTES = 32 << 20


def _trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's ``malloc_trim``; nothing
    elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def start(payload: Payload, np: int, options: JobOptions | None = None) -> Job:
    """Start a job; ``np`` < 0 means |np| local ranks even when Spark is active."""
    options = JobOptions() if options is None else options
    launcher, n = backends.choose(np, options.backend)
    if options.timeout is not None and options.timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {options.timeout!r}")
    try:
        return Job(payload, n, launcher, options).start()
    except OSError as exc:
        raise launch_failed(n, launcher.name, exc) from exc


def run(
    fn: Callable[..., Any],
    *args: Any,
    np: int = 2,
    backend: str = "auto",
    gpu: bool | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    mlflow: bool = False,
    log_dir: str | None = None,
    **kwargs: Any,
) -> Job:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the :class:`Job`.

    Parameters
    ----------
    fn : callable
        Shipped with cloudpickle; runs once per rank with the torchrun environment set.
    np : int
        Number of ranks; negative means that many local ranks even when Spark is active.
    backend : {"auto", "local", "spark"}
    gpu : bool, optional
        One GPU per rank; default: when the backend has GPUs.
    timeout : float, optional
        Seconds after which every rank is stopped and the job fails.
    env : dict, optional
        Extra environment variables for every rank.
    mlflow : bool
        Log rank 0's reported metrics (``nbdist.report``) into the notebook's active MLflow
        run, with steps (``nbdist.tracking``); a ValueError when there is none. The ranks
        get that run's ``MLFLOW_*`` variables whether or not this is set.
    log_dir : str, optional
        Where every rank's complete log goes (``rank-R.log``); default: a folder of the
        job's under the temporary folder (``--log-dir``).

    Returns
    -------
    Job
        ``.result()`` is rank 0's return value, ``.results`` every rank's.
    """
    payload: CallPayload = {"kind": "call", "code": call_code(fn, args, kwargs), "fn": fn,
                            "args": args, "kwargs": kwargs}
    options = options_from(getattr(fn, "__name__", "fn"), backend=backend, gpu=gpu,
                           timeout=timeout, env=env, mlflow=mlflow, log_dir=log_dir)
    return start(payload, np, options)

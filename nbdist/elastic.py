"""Restarts: a job that launches its whole rank group again after a lost rank or host.

``%%distributed -np N --max-restarts K`` (``nbdist.run(..., max_restarts=K)``) runs an
:class:`ElasticJob`: attempts of an ordinary :class:`~nbdist.job.Job`, one after another, up
to ``K + 1`` of them. When an attempt fails, a small table of rules (:data:`RULES`, the first
that matches decides) says whether it is worth another: a lost host, a signal or a process
that exited without its result is a fault and is restarted; a Python exception raised by the
cell is a bug and is not, unless ``restart_on_error``. Every verdict names its rule.

Each attempt starts all N ranks afresh (a new barrier stage on Spark, on whatever executors
are there; fresh local processes), with torchrun's ``TORCHELASTIC_RESTART_COUNT`` (0 for the
first attempt) and ``TORCHELASTIC_MAX_RESTARTS``, one ``TORCHELASTIC_RUN_ID`` for all
attempts, and ``NBDIST_CHECKPOINT_DIR`` (``nbdist.checkpoint_dir()``), so code written for
torchrun's restarts resumes from its last checkpoint unchanged. After a loss the backend may
lack the slots for N ranks: the job waits for them up to ``capacity_wait`` seconds, saying so
in the panel, then fails with the numbers.

The attempts share one :class:`ElasticState` (the views render it as one job): its ranks are
reset for each attempt, their logs are kept and every attempt's lines are preceded by a
marked line. ``%dist_status JOB`` lists the attempts, their causes and durations.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nbdist import _checkpoint, handle, lifecycle, state, tracking
from nbdist import job as jobs
from nbdist import settings as _settings
from nbdist.capture import call_code
from nbdist.errors import CapacityError, DistributedError, LaunchError, Reason, launch_failed
from nbdist.launch import backends
from nbdist.options import JobOptions, options_from
from nbdist.protocol import CallPayload, Payload, RankOutcome
from nbdist.stacks import Stacks
from nbdist.state import Attempt, ElasticState
from nbdist.waiting import wait_loop

#: How long a restart waits for the backend to have the slots again, by default (seconds).
CAPACITY_WAIT_S = _settings.CAPACITY_WAIT_S
#: How often the capacity is asked for while waiting.
CAPACITY_POLL_S = 2.0


#: The defaults of restarts live with every other knob (``nbdist.settings``).
settings = _settings.settings


# -- the judge ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended, as the rules see it: the job's error and every rank's outcome."""

    error: DistributedError | BaseException | None
    outcomes: Mapping[int, RankOutcome]
    lost_hosts: Mapping[int, str]  # ranks not heard from while connected, with their host
    cancelled: bool = False  # the user (or the job's caller) cancelled it

    @property
    def reason(self) -> str:
        return str(getattr(self.error, "reason", "failed"))

    def failed(self) -> list[RankOutcome]:
        return [o for _, o in sorted(self.outcomes.items()) if o.status == "failed"]


@dataclass(frozen=True)
class Rule:
    """One row of the judge's table: what it matches, whether it restarts, and why."""

    name: str
    restart: bool | None  # None: only with restart_on_error
    why: str
    matches: Callable[[AttemptEnd], bool]


#: Exception types a backend reports for a rank whose process or host it lost (not the cell).
_LOST_TYPES = frozenset({"ExecutorLost", "SparkTaskFailed"})


def _exceptions(end: AttemptEnd) -> list[RankOutcome]:
    return [o for o in end.failed() if o.error is not None and o.error.get("type")
            not in _LOST_TYPES]


def _same_exception(end: AttemptEnd) -> bool:
    raised = _exceptions(end)
    kinds = {o.error.get("type") for o in raised if o.error is not None}
    messages = {o.error.get("message") for o in raised if o.error is not None}
    return bool(raised) and len(kinds) == 1 and len(messages) == 1 and \
        len(raised) == len(end.failed())


def _signalled(o: RankOutcome) -> bool:
    return o.error is None and o.exit_code is not None and o.exit_code < 0


#: The judge's table, in order: the first rule that matches decides.
RULES: tuple[Rule, ...] = (
    Rule("cancelled", False, "the job was cancelled (the stop button, %dist_cancel, "
         ".cancel()): a cancel stops every attempt",
         lambda e: e.cancelled or e.reason == "cancelled"),
    Rule("timeout", False, "--timeout bounds the whole job, every attempt included",
         lambda e: e.reason == "timeout"),
    Rule("lost host", True, "a host (a Spark executor) went away, or stopped answering, with "
         "its ranks: a fault of the cluster, not of the cell",
         lambda e: bool(e.lost_hosts) or any(
             o.lost_host is not None
             or (o.error is not None and o.error.get("type") in _LOST_TYPES)
             for o in e.failed())),
    Rule("signal", True, "a rank was killed by a signal (SIGKILL from the out-of-memory "
         "killer or a reclaimed machine, a segfault): a fault, not an exception of the cell",
         lambda e: any(_signalled(o) for o in e.failed())),
    Rule("exit", True, "a rank's process ended without its result and without a Python "
         "exception (os._exit, a crash in a library): taken for a fault",
         lambda e: any(o.error is None for o in e.failed())),
    Rule("same exception", None, "the cell raised the same Python exception on every rank "
         "that failed: a bug in the code, which another attempt would hit again "
         "(--restart-on-error restarts on it too)", _same_exception),
    Rule("exception", None, "the cell raised a Python exception: taken for a bug, not a "
         "fault (--restart-on-error restarts on it too)",
         lambda e: bool(_exceptions(e))),
    Rule("other", False, "the job failed without a rank failing (its results could not be "
         "read back): another attempt would end the same way", lambda e: True),
)


@dataclass(frozen=True)
class Verdict:
    """What the judge decided for an attempt, and the rule that decided it."""

    restart: bool
    rule: Rule

    def text(self) -> str:
        return f"{'restarted' if self.restart else 'not restarted'} (rule '{self.rule.name}')"


def judge(end: AttemptEnd, *, restart_on_error: bool = False) -> Verdict:
    """The first rule of :data:`RULES` that matches ``end``, and whether it restarts."""
    for rule in RULES:
        if rule.matches(end):
            restart = restart_on_error if rule.restart is None else rule.restart
            return Verdict(restart, rule)
    raise AssertionError("the last rule matches everything")  # pragma: no cover


# -- the job --------------------------------------------------------------------------------------
class ElasticJob(handle.Handle):
    """A job whose rank group is launched again after a fault, up to ``max_restarts`` times.

    Used like a :class:`~nbdist.job.Job` (``result()``, ``results``, ``cancel()``, ``wait()``,
    ``state``); ``attempts`` lists the attempts so far. Built from its options, it launches
    nothing until :meth:`start`, which starts the first attempt in the caller's thread, so a
    job that cannot start at all (too many ranks) fails at once.
    """

    _current: jobs.Job  # the attempt running or the last one; set by start()

    def __init__(
        self,
        payload: Payload,
        np: int,
        options: JobOptions,
    ) -> None:
        super().__init__()
        restarts = options.restarts
        max_restarts, label, timeout = restarts.max_restarts, options.label, options.timeout
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, not {max_restarts}")
        launcher, self.np = backends.choose(np, options.backend)
        self._new_launcher = backends.same_backend(launcher)
        self.id = handle.new_id()
        self.label = label
        self.max_restarts = max_restarts
        self.restart_on_error = restarts.restart_on_error
        self.capacity_wait = settings.capacity_wait if restarts.capacity_wait is None \
            else restarts.capacity_wait
        self._state = ElasticState(self.id, launcher.name, self.np, max_restarts)
        self.state: state.JobState = self._state  # what views and %dist_status read
        self.run_id = secrets.token_hex(8)
        self.checkpoint_dir = restarts.checkpoint_dir or _checkpoint.default_dir(
            label or "job", self.run_id, settings.checkpoint_root or None)
        self._payload = payload
        # Taken here, in the caller's thread: MLflow's active run is per thread, and restarts
        # start from a thread of the job's own. One logger for all attempts (``--mlflow``).
        env = {**tracking.run_env(), **dict(options.env)}
        self._mlflow = tracking.MetricsLogger.for_active_run() if options.mlflow else None
        if self._mlflow is not None:
            self._state.metrics_sink = self._mlflow.put
        # Each attempt is a plain job: the restarts, the time left and MLflow are this job's.
        self._attempt_options = JobOptions(gpu=options.gpu, env=env, label=label,
                                           log_dir=options.log_dir)
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout
        self._stop = threading.Event()
        self._cancel_reason: str | None = None
        self._lock = threading.Lock()
        self.launcher = launcher

    def start(self) -> ElasticJob:
        """Launch the first attempt (its errors raise here: too many ranks, a backend that
        cannot start them), list the job for ``%dist_status`` and watch it from a thread of
        its own, which starts the attempts after it. Returns the job."""
        self._current = self._attempt(1, self.launcher, "")
        handle.register(self)
        threading.Thread(target=self._supervise, daemon=True,
                         name=f"nbdist-restarts-{self.id}").start()
        return self

    # -- attempts ---------------------------------------------------------------------------
    def _world_env(self, number: int) -> dict[str, str]:
        return {
            "TORCHELASTIC_RESTART_COUNT": str(number - 1),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            _checkpoint.ENV: self.checkpoint_dir,
        }

    def _attempt(self, number: int, launcher: Any, why: str) -> jobs.Job:
        timeout = None
        if self._deadline is not None:
            timeout = max(0.1, self._deadline - time.monotonic())
        self._state.begin(number, f"{self.id}.{number}", why)
        job = jobs.Job(self._payload, self.np, launcher,
                       dataclasses.replace(self._attempt_options, timeout=timeout),
                       job_state=self.state, world_env=self._world_env(number)).start()
        with self._state.lock:  # an attempt that could not start has no job (as before)
            self._state.attempts[-1].job_id = job.id
        return job

    def _supervise(self) -> None:
        number = 1
        try:
            while True:
                current = self._current
                current.wait()
                end = AttemptEnd(current.error, current.outcomes, current.lost_hosts,
                                 cancelled=self._cancel_reason is not None)
                if current.error is None:
                    self._state.end_attempt("done", "")
                    self._end(None)
                    return
                if not self.max_restarts:  # no restarts: the attempt's error as it is
                    self._state.end_attempt(_first_line(current.error), "")
                    self._end(current.error)
                    return
                verdict = judge(end, restart_on_error=self.restart_on_error)
                cause = _first_line(current.error)
                left = number <= self.max_restarts
                restart = verdict.restart and left
                said = verdict.text()
                if verdict.restart and not left:
                    said = f"not restarted: no restarts left (rule '{verdict.rule.name}')"
                self._state.end_attempt(cause, said)
                if not restart:
                    self._end(self._final_error(current.error, verdict, left))
                    return
                number += 1
                why = f"attempt {number - 1} ended: {cause} — {verdict.text()}"
                launcher = self._wait_for_capacity(number, why)
                if launcher is None:
                    return  # _wait_for_capacity ended the job
                try:
                    attempt = self._attempt(number, launcher, why)
                except (CapacityError, LaunchError, OSError, ValueError) as exc:
                    self._state.end_attempt(f"could not start: {exc}", "not restarted")
                    self._end(self._final_error(exc, None, False))
                    return
                with self._lock:
                    self._current = attempt
                    reason = self._cancel_reason
                if reason is not None:  # cancelled while it was being started
                    attempt.cancel(reason)
        except BaseException as exc:  # never leave a cell waiting on a dead thread
            self._end(DistributedError(f"job {self.id}: nbdist's restart logic failed: "
                                       f"{type(exc).__name__}: {exc}", job_id=self.id))
            raise

    def _wait_for_capacity(self, number: int, why: str) -> Any:
        """A launcher that can run the N ranks now, or None once the wait is over (ended).
        What to do at each turn is ``lifecycle.CapacityWait``'s to say."""
        wait = lifecycle.CapacityWait.begin(time.monotonic(), self.capacity_wait,
                                            self._deadline, self.timeout)
        while True:
            if wait.step(time.monotonic(), cancelled=self._cancel_reason is not None,
                         fits=False)[0] is lifecycle.Step.CANCEL:
                self._end(self._cancelled_error())
                return None
            launcher = self._new_launcher()
            gpu = self._current.gpu  # as the first attempt chose it
            try:
                launcher.check(self.np, gpu)
                fits = True
            except CapacityError as exc:
                fits, short = False, exc
                try:
                    cap = launcher.capacity()
                    free: int | str = min(cap.slots, cap.gpus) if gpu else cap.slots
                except Exception:  # the backend cannot say; the error below will
                    free = "?"
            step, left = wait.step(time.monotonic(), cancelled=False, fits=fits)
            if step is lifecycle.Step.START:
                return launcher
            if step is lifecycle.Step.GIVE_UP:
                self._state.set_note(f"attempt {number} of {self._state.total} could not start")
                self._end(DistributedError(
                    f"job {self.id} could not restart: the backend did not have the slots for "
                    f"{self.np} ranks within {wait.bound}: {short}\n" + self._attempts_text(),
                    job_id=self.id, reason=Reason.FAILED))
                return None
            self._state.set_note(
                f"attempt {number} of {self._state.total} waiting for {self.np} slots, {free} "
                f"free ({left:.0f} s left of --capacity-wait {self.capacity_wait:g}) · {why}")
            if self._stop.wait(min(CAPACITY_POLL_S, max(left, 0.0))):
                continue  # cancelled: the loop says so

    def _end(self, error: BaseException | None) -> None:
        if error is None:
            final, reason = state.DONE, self._current.lost_output or ""
        elif getattr(error, "reason", "") == Reason.CANCELLED:
            final, reason = state.CANCELLED, str(error)
        else:
            final, reason = state.FAILED, str(error)

        def close() -> None:
            if self._mlflow is not None:
                self._mlflow.close(timeout=5.0)  # what rank 0 reported is in the run on return
            if error is None and len(self._state.attempts) > 1:
                self._state.set_note(f"done on attempt {len(self._state.attempts)} of "
                                     f"{self._state.total}")
            self._state.close(final, reason)

        self._settle(error, close)

    # -- errors -----------------------------------------------------------------------------
    def _attempts_text(self) -> str:
        lines = []
        for a in self._state.attempts:
            verdict = f" → {a.verdict}" if a.verdict else ""
            lines.append(f"  attempt {a.number} of {self._state.total} ({a.job_id}, "
                         f"{a.duration:.1f} s): {a.cause or 'running'}{verdict}")
        return "attempts:\n" + "\n".join(lines)

    def _final_error(self, error: BaseException, verdict: Verdict | None,
                     left: bool) -> BaseException:
        if verdict is not None and verdict.rule.name == "cancelled":
            return self._cancelled_error()
        if verdict is not None and not verdict.restart:
            head = (f"job {self.id}: attempt {len(self._state.attempts)} of {self._state.total} "
                    f"failed and was not restarted: rule '{verdict.rule.name}': "
                    f"{verdict.rule.why}.")
        elif verdict is not None:
            head = (f"job {self.id} failed on all {self._state.total} attempts "
                    f"(--max-restarts {self.max_restarts}).")
        else:
            head = f"job {self.id} could not start attempt {len(self._state.attempts)}."
        failures = getattr(error, "failures", None) or {}
        return DistributedError(
            f"{head}\n{self._attempts_text()}\nlast attempt: {error}", job_id=self.id,
            reason=str(getattr(error, "reason", "failed")), failures=failures)

    def _cancelled_error(self) -> DistributedError:
        return DistributedError(
            f"job {self.id} was cancelled ({self._cancel_reason or 'cancelled'}); all "
            f"{self.np} ranks were stopped\n{self._attempts_text()}",
            job_id=self.id, reason=Reason.CANCELLED)

    # -- what a job offers (handle.Handle) ----------------------------------------------------
    @property
    def attempts(self) -> list[Attempt]:
        with self._state.lock:
            return [dataclasses.replace(a) for a in self._state.attempts]

    @property
    def gpu(self) -> bool:
        return self._current.gpu

    def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop every rank of the running attempt; no further attempt starts."""
        if self._done.is_set():
            return
        with self._lock:
            if self._cancel_reason is None:
                self._cancel_reason = reason
            current = self._current
        self._stop.set()
        current.cancel(reason)

    def wait(self, timeout: float | None = None,
             on_tick: Callable[[], None] | None = None) -> bool:
        """Block until the last attempt is over (True) or ``timeout`` passed (False).

        Meanwhile the questions of the current attempt's debuggers (``breakpoint()``) are
        asked in this thread, as a job's are.
        """
        def tick() -> None:
            self._current.with_debugger(on_tick)()

        return wait_loop(self._done, timeout, tick, cancel=self.cancel,
                         teardown_s=jobs.TEARDOWN_S)

    def _holder(self) -> handle.Handle:
        """The values are the last attempt's (the one that succeeded, if any did)."""
        return self._current

    def stacks(self, timeout: float = handle.STACKS_WAIT_S) -> Stacks:
        """The stacks of the current attempt's ranks (``%dist_stacks``)."""
        return self._current.stacks(timeout, job_id=self.id)

    def __repr__(self) -> str:
        return (f"<nbdist job {self.id}: {self.np} ranks on {self.state.backend}, "
                f"{self.state.status}, attempt {len(self._state.attempts)} of {self._state.total}>")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def start(payload: Payload, np: int, options: JobOptions | None = None) -> jobs.Job | ElasticJob:
    """Start a job that restarts (``options.restarts.max_restarts`` > 0), else an ordinary
    one (the magics).

    ``checkpoint_dir`` alone (no restarts) only sets ``nbdist.checkpoint_dir()`` on the ranks.
    """
    options = JobOptions() if options is None else options
    folder = options.restarts.checkpoint_dir
    if not options.restarts.max_restarts:
        if folder is not None:
            options = dataclasses.replace(
                options, env={**options.env, _checkpoint.ENV: _absolute(folder)})
        return jobs.start(payload, np, options)
    return _elastic(payload, np, options)


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _elastic(payload: Payload, np: int, options: JobOptions) -> ElasticJob:
    folder = options.restarts.checkpoint_dir
    if folder is not None:
        options = dataclasses.replace(options, restarts=dataclasses.replace(
            options.restarts, checkpoint_dir=_absolute(folder)))
    try:
        return ElasticJob(payload, np, options).start()
    except OSError as exc:
        raise launch_failed(np, options.backend, exc) from exc


def run(
    fn: Callable[..., Any],
    *args: Any,
    max_restarts: int = 0,
    restart_on_error: bool = False,
    capacity_wait: float | None = None,
    checkpoint_dir: str | None = None,
    np: int = 2,
    backend: str = "auto",
    gpu: bool | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    mlflow: bool = False,
    log_dir: str | None = None,
    **kwargs: Any,
) -> ElasticJob:
    """:func:`nbdist.job.run` with restarts (``nbdist.run(..., max_restarts=K)``).

    Parameters
    ----------
    max_restarts : int
        Launch every rank again after a fault (a lost host, a signal), up to this many times;
        0: one attempt, as a plain job (the job still offers ``attempts``).
    restart_on_error : bool
        Restart after a Python exception of the cell too (taken for a bug otherwise).
    capacity_wait : float, optional
        Seconds a restart waits for the slots of N ranks (default ``settings.capacity_wait``).
    checkpoint_dir : str, optional
        What ``nbdist.checkpoint_dir()`` returns on the ranks: a path every rank can reach.

    Returns
    -------
    ElasticJob
        Used as a :class:`~nbdist.job.Job`; ``.attempts`` lists the attempts.
    """
    options = options_from(
        getattr(fn, "__name__", "fn"), backend=backend, gpu=gpu, timeout=timeout, env=env,
        mlflow=mlflow, log_dir=log_dir, max_restarts=max_restarts,
        restart_on_error=restart_on_error, capacity_wait=capacity_wait,
        checkpoint_dir=checkpoint_dir)
    payload: CallPayload = {"kind": "call", "code": call_code(fn, args, kwargs), "fn": fn,
                            "args": args, "kwargs": kwargs}
    return _elastic(payload, np, options)

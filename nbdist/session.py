"""Persistent distributed sessions (``%dist_session``): ranks that keep their state across cells.

A session is a launch like any job's, on the same backends and supervisors, except that the
ranks get no payload when they start. Each cell then travels to them over the event channel
(``{"t": "cell"}``; a local rank's supervisor, a thread of the kernel, takes it as a call:
``Launcher.deliver``), runs in one namespace that lives as long as the rank's interpreter (as a
kernel's ``user_ns`` does), and its value or error comes back the same way. The process group
that ``dist.init_process_group()`` set up in one cell is still there in the next.

The states, and who moves between them::

    starting ──(every rank ready)──> idle <──(cell ends)──> running a cell
        │                             │                         │
        └──────(a rank dies, the driver stops it, idle timeout, kernel exit)──> ended

A cell that raises leaves the session usable; a rank that dies ends it ("broken"), and so does
a rank that does not stop within ``INTERRUPT_GRACE_S`` of an interrupt.

Values come back pickled, over the channel that never unpickles anything else: each value
travels in pieces, signed with HMAC-SHA256 under the session's secret by the supervisor as they
pass, and the signature is checked before the driver unpickles it (Jupyter's own messages are
signed the same way); see ``nbdist.values``.
"""

from __future__ import annotations

import atexit
import base64
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nbdist import _pickling, channel, lifecycle, state, values
from nbdist._timer import after
from nbdist.errors import DistributedError, Reason
from nbdist.errors import SessionError as SessionError
from nbdist.handle import STACKS_WAIT_S, Handle, register
from nbdist.job import Job, unreachable_hint
from nbdist.launch import Launcher, backends
from nbdist.options import JobOptions
from nbdist.protocol import CellEvent, CellPartEvent, Payload, RankOutcome, RankStatus
from nbdist.stacks import Stacks
from nbdist.waiting import wait_loop

#: How long ``start`` waits for every rank's interpreter to be up.
START_S = 300.0
#: After an interrupt (or another rank's failure), how long a cell's ranks have to stop before
#: the session is torn down: a rank blocked in a collective never sees the KeyboardInterrupt.
INTERRUPT_GRACE_S = 5.0
#: How long ``stop`` waits for ranks to leave on their own before killing them.
STOP_S = 10.0
#: The idle-timeout warning comes this long before the session is stopped (or at half way).
IDLE_WARNING_S = 60.0
#: A cell's payload up to this size goes to a local rank's supervisor as a call from the
#: notebook's thread (``Launcher.deliver``), which writes it into the rank's control pipe: it
#: fits the pipe (64 KiB), so the write never waits for the rank. A larger one (a push, a
#: scatter's slice) goes on the event channel, whose socket buffers take a few MB, and the
#: supervisor's own thread writes it to the pipe: the notebook never blocks on a rank that
#: cannot read (busy, stopped), where an interrupt would leave half a frame in the pipe.
DIRECT_BYTES = 60 * 1024


_current: Session | None = None
_current_lock = threading.Lock()


def current() -> Session | None:
    """This kernel's session, live or ended (None if none was started)."""
    return _current


def start(
    np: int,
    options: JobOptions | None = None,
    *,
    idle_timeout: float | None = None,
) -> Session:
    """Start this kernel's session and wait until every rank is ready (``options``: its
    backend, GPUs and environment; a session's cells have their own timeout)."""
    options = JobOptions() if options is None else options
    global _current
    with _current_lock:
        if _current is not None and _current.alive:
            raise SessionError(
                f"session {_current.id} is already running ({_current.np} ranks on "
                f"{_current.launcher.name}); stop it first with %dist_session stop"
            )
        launcher, n = backends.choose(np, options.backend)
        _current = Session(n, launcher, options, idle_timeout=idle_timeout)
    _current.wait_ready(START_S)
    return _current


def shutdown(reason: str) -> None:
    """Stop this kernel's session if one is live, and forget it (``%unload_ext nbdist``)."""
    global _current
    with _current_lock:
        live, _current = _current, None
    if live is not None and live.alive:
        live.stop(reason)


class Session:
    """Ranks that stay up between cells; see the module docstring.

    ``run_cell`` starts a cell on every rank and returns a :class:`SessionCell`, which the
    magics and views use like a job. The ranks are a :class:`~nbdist.job.Job` without a
    payload (``job``), which this session owns (``job.Owner``): it starts, waits on, cancels
    and ends them as it does any job's, and tells the session what happens to them.
    """

    def __init__(
        self,
        np: int,
        launcher: Launcher,
        options: JobOptions | None = None,
        *,
        idle_timeout: float | None = None,
    ) -> None:
        self._ready: set[int] = set()
        self._ready_event = threading.Event()
        self._cell: SessionCell | None = None
        self._cell_ids = 0
        self._stopping = False
        self.broken: str | None = None
        self.names: dict[int, set[str]] = {}  # rank → names its cells defined
        #: rank → resident memory at its last resources sample or cell end
        self.rss: dict[int, int] = {}
        self.idle_timeout = idle_timeout
        self.idle_since = time.time()
        self.warning = ""
        self._idle_timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._dead: RankOutcome | None = None  # the rank whose death broke the session
        #: The session's ranks, started once the session holds them (the hooks below still
        #: get the job they come from).
        self.job = Job(None, np, launcher, options, owner=self)
        self.job.start()
        self._arm_idle()

    # -- the ranks ----------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.job.id

    @property
    def np(self) -> int:
        return self.job.np

    @property
    def launcher(self) -> Launcher:
        return self.job.launcher

    @property
    def state(self) -> state.JobState:
        """The ranks' state (hosts, pids, output between cells)."""
        return self.job.state

    def done(self) -> bool:
        """True once every rank has ended."""
        return self.job.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every rank has ended (True) or ``timeout`` passed (False)."""
        return self.job.wait(timeout)

    # -- state --------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True until the session is stopped or broken."""
        return not self.done() and not self._stopping and self.broken is None

    @property
    def last_cell(self) -> SessionCell | None:
        """The cell that ran last (or runs now), None before the first."""
        return self._cell

    @property
    def busy(self) -> SessionCell | None:
        """The cell running now, if any."""
        cell = self._cell
        return cell if cell is not None and not cell.done() else None

    def defined_names(self) -> set[str]:
        """Names the session's cells defined on the ranks (every rank's, together)."""
        with self._lock:
            return set().union(*self.names.values()) if self.names else set()

    def wait_ready(self, timeout: float) -> None:
        """Block until every rank's interpreter is up; raise if the session failed first."""
        # Set by every rank's "ready", and by the session's end: stop() ends the wait too.
        if not wait_loop(self._ready_event, timeout, None, cancel=self.stop,
                         teardown_s=2 * STOP_S):
            late = sorted(set(range(self.np)) - self._ready)
            self.stop()
            raise SessionError(
                f"session {self.id}: only {len(self._ready)} of {self.np} ranks were "
                f"ready after {timeout:g} s; not ready: {_ranks_on(self.state, late)}. It was "
                f"stopped; %dist_status {self.id} shows their last lines and how they ended"
            )
        if self.done():
            why = self.broken or self.job.cancel_reason or "its ranks ended before they were ready"
            raise SessionError(f"session {self.id} could not start: {why}")

    # -- cells --------------------------------------------------------------------------------
    def targets(self, spec: str) -> list[int]:
        """The session's ranks that ``spec`` names (``0,2``, ``1-3``, ``host=NAME``), in rank
        order; ValueError for a spec that names none or is not understood."""
        ranks = state.select_ranks(spec, self.state.ranks)
        if not ranks:
            raise ValueError(f"no rank of session {self.id} matches it (ranks 0-{self.np - 1})")
        return ranks

    def run_cell(
        self, payload: Payload, *, timeout: float | None = None, label: str = "",
        per_rank: Callable[[int], Mapping[str, Any]] | None = None,
        targets: Sequence[int] | None = None,
    ) -> SessionCell:
        """Run ``payload`` (a captured cell, a pull or a push) on every rank of the session,
        or on ``targets`` only (``--targets``: the others' state stays untouched).

        ``per_rank(r)``, when given, adds rank ``r``'s own keys to its payload (a scatter's
        slice). Every rank's payload is pickled before the cell exists: a payload that cannot
        be pickled raises here and leaves the session as it was (HARDENING.md rule 11).

        A push's value (``data``) is pickled once, by the caller: it travels after the pickle
        of the payload's other keys, as it is (``_frame``). Payloads larger than
        ``DIRECT_BYTES`` go from a thread of their own, to one rank after another; on the
        event channel in pieces of ``values.CHUNK`` (never as one base64 line per rank), to a
        local rank's supervisor as a call with the bytes themselves (``Launcher.deliver``).
        """
        ranks = sorted(set(targets)) if targets is not None else list(range(self.np))
        if not ranks or not all(0 <= r < self.np for r in ranks):
            raise ValueError(f"targets {list(ranks)}: session {self.id} has ranks "
                             f"0-{self.np - 1}")
        with self._lock:
            self.check_usable()
            number = self._cell_ids + 1
            common = {**payload, "session": True, "keep": True, "cell": number}
            frames: dict[int, list[bytes] | None]
            if per_rank is None:
                shared = _frame(common)  # one frame, every rank's
                frames = {rank: shared for rank in ranks}
            else:
                frames = {rank: _frame({**common, **per_rank(rank)}) for rank in ranks}
            self._cell_ids = number
            cell = SessionCell(self, f"{self.id}.{number}", timeout, label, ranks)
            self._cell = cell
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self.warning = ""
        register(cell)
        if all(sum(len(p) for p in parts or ()) <= DIRECT_BYTES for parts in frames.values()):
            self._send_frames(number, frames)
        else:
            # Writing a large payload waits for each rank to read it: not the notebook's
            # thread, which must stay free to wait on the cell and take the stop button.
            threading.Thread(target=self._send_frames, args=(number, frames), daemon=True,
                             name=f"nbdist-send-{cell.id}").start()
        return cell

    def _send_frames(self, number: int, frames: dict[int, list[bytes] | None]) -> None:
        """Send each rank its payload frame (dropping it once sent)."""
        last: tuple[list[bytes], CellEvent] | None = None  # a frame every rank shares: encoded once
        for rank in list(frames):
            parts = frames[rank]
            frames[rank] = None
            assert parts is not None
            if sum(map(len, parts)) <= DIRECT_BYTES:
                if last is None or last[0] is not parts:
                    last = (parts, {"t": "cell", "id": number,
                                    "payload": base64.b64encode(b"".join(parts)).decode()})
                message = last[1]
                # Direct: a local rank's supervisor takes it in this thread
                # (``Launcher.deliver``); elsewhere the channel.
                ok = self.job.send(rank, message, direct=True)
            else:
                ok = (self.job.launcher.deliver(rank, {"t": "cell", "id": number,
                                                       "payload": "", "frame": parts})
                      or self._send_chunks(rank, number, parts))
            del parts
            if not ok:
                self._fail(f"rank {rank} of session {self.id} is not connected")
                return

    def _send_chunks(self, rank: int, number: int, parts: list[bytes]) -> bool:
        """A large payload on the event channel: pieces of at most ``values.CHUNK``, then the
        cell (the kernel encodes one piece at a time)."""
        chunks = 0
        for part in parts:
            view = memoryview(part)
            for at in range(0, len(view), values.CHUNK):
                piece: CellPartEvent = {"t": "cell_part", "id": number, "data": base64.b64encode(
                    view[at:at + values.CHUNK]).decode()}
                if not self.job.send(rank, piece):
                    return False
                chunks += 1
        return self.job.send(rank, {"t": "cell", "id": number, "payload": "", "chunks": chunks})

    def check_usable(self) -> None:
        if self.broken is not None:
            raise SessionError(
                f"session {self.id} is broken: {self.broken}. Its ranks and their variables "
                f"are gone; start a new one with %dist_session start -np {self.np}"
            )
        if self._stopping or self.done():
            raise SessionError(
                f"session {self.id} was stopped; start a new one with "
                f"%dist_session start -np {self.np}"
            )
        busy = self.busy
        if busy is not None:
            raise SessionError(
                f"session {self.id} is still running cell {busy.id}; wait for it to end "
                f"(%dist_status {busy.id}) or interrupt it with %dist_cancel {busy.id}"
            )

    def _cell_over(self, cell: SessionCell) -> None:
        with self._lock:
            if self._cell is cell:
                self.idle_since = time.time()
        self._arm_idle()

    def interrupt(self, cell: SessionCell, ranks: list[int]) -> None:
        """KeyboardInterrupt in ``cell`` on ``ranks`` (also if it has not started there yet)."""
        number = int(cell.id.rpartition(".")[2])
        for rank in ranks:
            self.job.send(rank, {"t": "interrupt", "id": number})

    # -- what the ranks' job tells the session (``job.Owner``) ----------------------------------
    def on_event(self, job: Job, rank: int, event: channel.Event) -> bool:
        kind = event.get("t")
        cell = self._cell
        if isinstance(event.get("rss"), int):
            self.rss[rank] = event["rss"]
        if kind in ("cell_value", "cell_data", "cell_result", "cell_error"):
            if cell is not None:
                cell.on_rank_end(rank, event, job.secret)
            return True
        if kind == "names":
            with self._lock:
                self.names[rank] = {str(n) for n in event.get("names") or ()}
            return True
        if kind == "state" and event.get("state") == "ready":
            with self._lock:
                self._ready.add(rank)
                if len(self._ready) == job.np:
                    self._ready_event.set()
        if cell is not None and not cell.done() and kind not in ("hb", "state"):
            cell.state.apply(rank, event)
        elif cell is not None and kind == "state" and event.get("state") == "running":
            cell.state.apply(rank, event)
        return False  # the job folds it into the ranks' state too

    def block_buffer(self, job: Job, rank: int, event: channel.Event) -> memoryview | None:
        """A piece of a rank's value is read straight into the value's buffer."""
        cell = self._cell
        if event.get("t") != "cell_data" or cell is None:
            return None
        return cell.buffer_for(rank, event)

    def on_failure(self, job: Job, reason: str) -> None:
        self._fail(reason, job)

    def on_outcome(self, job: Job, outcome: RankOutcome) -> None:
        if outcome.status == RankStatus.FAILED and not self._stopping:
            with self._lock:
                if self.broken is None:
                    self.broken = (
                        f"{outcome.channel_error}. {unreachable_hint(job.address)}"
                        if outcome.channel_error else outcome.describe().splitlines()[0]
                    )
                    self._dead = outcome

    def on_finish(self, job: Job) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        cell = self._cell
        if cell is not None and not cell.done():
            dead = self._dead
            failures = {dead.rank: dead.describe()} if dead is not None else {}
            cell.end(DistributedError(
                f"session {job.id} ended while cell {cell.id} ran: "
                f"{self.broken or job.cancel_reason}", job_id=cell.id, reason=Reason.FAILED,
                failures=failures,
            ))
        self._ready_event.set()

    # -- the end ------------------------------------------------------------------------------
    def _fail(self, reason: str, job: Job | None = None) -> None:
        """The session cannot go on: mark it broken and tear every rank down."""
        with self._lock:
            if self.broken is None and not self._stopping:
                self.broken = reason
        (job or self.job).cancel(reason)

    def stop(self, reason: str = "stopped with %dist_session stop") -> None:
        """End the session: every rank leaves (killed after ``STOP_S``); nothing lingers."""
        with self._lock:
            self._stopping = True
        cell = self.busy
        if cell is not None:
            cell.end(DistributedError(
                f"cell {cell.id} was stopped with its session {self.id} ({reason})",
                job_id=cell.id, reason=Reason.CANCELLED,
            ))
        for rank in range(self.np):
            self.job.send(rank, {"t": "quit"})
        if not self.wait(STOP_S):
            self.job.cancel(reason)
            self.wait(STOP_S)

    # -- idle timeout -------------------------------------------------------------------------
    def _arm_idle(self) -> None:
        if self.idle_timeout is None or not self.alive:
            return
        warn_in = max(self.idle_timeout - IDLE_WARNING_S, self.idle_timeout / 2)
        with self._lock:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self._idle_timer = after(warn_in, self._idle_warn, self.idle_since)

    def _idle_warn(self, since: float) -> None:
        if self.busy is not None or since != self.idle_since or not self.alive:
            return
        assert self.idle_timeout is not None
        left = self.idle_timeout - (time.time() - since)
        self.warning = (
            f"session {self.id} has been idle for {time.time() - since:.0f} s and will be "
            f"stopped in {left:.0f} s (--idle-timeout {self.idle_timeout:g}); run a cell on it "
            f"to keep it"
        )
        # A thread's print reaches the notebook under the cell that ran last.
        print(f"nbdist: {self.warning}", flush=True)
        with self._lock:
            self._idle_timer = after(left, self._idle_stop, since)

    def _idle_stop(self, since: float) -> None:
        if self.busy is None and since == self.idle_since and self.alive:
            print(f"nbdist: session {self.id} was idle for {self.idle_timeout:g} s "
                  f"(--idle-timeout): stopping it to release its ranks", flush=True)
            self.stop(f"idle for {self.idle_timeout:g} s (--idle-timeout)")

    def __repr__(self) -> str:
        how = "broken" if self.broken else "live" if self.alive else "ended"
        return f"<nbdist session {self.id}: {self.np} ranks on {self.launcher.name}, {how}>"


class SessionCell(Handle):
    """One cell run on a session's ranks: used like a :class:`~nbdist.job.Job` (``Handle``)."""

    noun = "cell"

    def __init__(
        self, session: Session, cell_id: str, timeout: float | None, label: str,
        targets: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.id = cell_id
        self.session = session
        self.np = session.np
        #: The ranks it runs on, in rank order (``--targets``; every rank by default): its
        #: result is the first one's value, its results theirs (``Handle.targets``).
        self._ranks = tuple(targets) if targets is not None else tuple(range(session.np))
        self.targets = self._ranks
        self.label = label
        self.launcher = session.launcher
        self.timeout = timeout
        self.state = state.JobState(cell_id, session.launcher.name, session.np)
        self.state.log_dir = session.state.log_dir  # the session's ranks write one log each
        self.state.log_error = session.state.log_error
        for r in session.state.ranks:  # the ranks' hosts and pids are the session's
            self.state.apply(r.rank, {"t": "hello", "host": r.host,
                                      "gpus": r.gpu.split(",") if r.gpu else []})
            if r.rank in self._ranks:
                self.state.apply(r.rank, {"t": "state", "state": "starting", "pid": r.pid})
        if len(self._ranks) < self.np:
            self.state.set_note(f"runs on ranks {', '.join(map(str, self._ranks))} of "
                                f"{self.np} (--targets); the others keep their state")
        self._lock = threading.Lock()
        self._number = int(cell_id.rpartition(".")[2])
        self._incoming: dict[int, values.Receiver] = {}  # rank → its value, arriving
        self._errors: dict[int, str] = {}  # rank → its traceback
        # The cell's life (``lifecycle.CellMachine``): decided there, under ``_lock``.
        self._machine = lifecycle.CellMachine(self._ranks)
        self._grace: threading.Timer | None = None
        self._timer: threading.Timer | None = None
        if timeout is not None:
            self._timer = after(timeout, self.cancel, f"timed out after {timeout:g} s")

    # -- from the session's channel -----------------------------------------------------------
    def on_rank_end(self, rank: int, event: channel.Event, secret: str) -> None:
        """A rank's value (announced, in pieces, then its signature) or error for this cell."""
        kind = event.get("t")
        if event.get("cell") != self._number:
            return  # a late word about an earlier cell
        if kind == "cell_error":
            error = event.get("error") or {}
            text = str(error.get("traceback") or "") or (
                f"{error.get('type')}: {error.get('message')}\n")
            self._rank_ended(rank, None, (str(error.get("type")), str(error.get("message")),
                                          text))
            return
        if kind == "cell_value":
            try:
                receiver = values.Receiver(secret, self._number, event.get("sizes"),
                                           event.get("bytes") or ())
            except (ValueError, MemoryError) as exc:
                self._rank_ended(rank, None, (type(exc).__name__, str(exc), (
                    f"rank {rank}'s value ({event.get('sizes')} bytes, a {event.get('type')}) "
                    f"cannot be received in the notebook: {type(exc).__name__}: {exc}\n")))
                return
            with self._lock:
                self._incoming[rank] = receiver
            return
        with self._lock:
            found = self._incoming.get(rank) if kind == "cell_data" else (
                self._incoming.pop(rank, None))
        if found is None:
            if kind == "cell_result":  # a supervisor of nbdist before values went in pieces
                self._rank_ended(rank, None, ("RuntimeError", "no value announced", (
                    f"rank {rank}'s nbdist is older than the notebook's: install the same "
                    f"nbdist version on both\n")))
            return  # pieces of a value refused above
        receiver = found
        if kind == "cell_data":
            data = event.get("data")
            try:
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise ValueError(f"a piece of {type(data).__name__}")
                receiver.feed(data)
            except ValueError as exc:
                with self._lock:
                    self._incoming.pop(rank, None)
                self._rank_ended(rank, None, ("ValueError", str(exc),
                                              f"rank {rank}'s value was garbled: {exc}\n"))
            return
        try:
            value = receiver.finish(event.get("mac"))
        except values.SignatureError as exc:
            self._rank_ended(rank, None, ("SecurityError", "bad signature", f"{exc}\n"))
            return
        except Exception as exc:
            what = event.get("type")
            self._rank_ended(rank, None, (
                "UnpicklingError", f"{type(exc).__name__}: {exc}",
                f"rank {rank}'s value (a {what}) cannot be unpickled in the notebook: "
                f"{type(exc).__name__}: {exc}. Return plain values or make the class "
                f"importable in the notebook.\n"))
            return
        with self._lock:
            self._size += receiver.size
        self._rank_ended(rank, value, None)

    def buffer_for(self, rank: int, event: channel.Event) -> memoryview | None:
        """Where the piece of a value that ``event`` announces goes (see ``block_buffer``)."""
        if event.get("cell") != self._number:
            return None
        with self._lock:
            receiver = self._incoming.get(rank)
        size = event.get("raw")
        return receiver.next_buffer(size) if receiver is not None and type(size) is int else None

    def _rank_ended(self, rank: int, value: Any, error: tuple[str, str, str] | None) -> None:
        stimulus: lifecycle.CellStimulus
        with self._lock:
            if self.settled or rank in self._values or rank in self._errors:
                return
            if error is None:
                self._values[rank] = value
                stimulus = lifecycle.CellValue(rank, time.time())
            else:
                self._errors[rank] = error[2]
                stimulus = lifecycle.CellError(rank, error[0], error[1], time.time())
            actions = self._machine.handle(stimulus)
        self.state.set_rank(rank, state.DONE if error is None else state.FAILED)
        self._do(actions)

    def _act(self, stimulus: lifecycle.CellStimulus) -> None:
        with self._lock:
            actions = self._machine.handle(stimulus)
        self._do(actions)

    def _do(self, actions: list[lifecycle.CellAction]) -> None:
        for action in actions:
            if isinstance(action, lifecycle.Interrupt):
                # The first failure: others may wait for this rank in a collective, so they
                # are stopped as an interrupt does; a rank that does not stop breaks the session.
                self.session.interrupt(self, list(action.ranks))
                self._grace = after(INTERRUPT_GRACE_S, self._stuck, action.reason)
            elif isinstance(action, lifecycle.BreakSession):
                self.session._fail(
                    f"ranks {', '.join(map(str, action.ranks))} did not stop within "
                    f"{INTERRUPT_GRACE_S:g} s of the interrupt ({action.reason}; a rank blocked "
                    f"in a collective never sees it)")
            elif isinstance(action, lifecycle.SettleCell):
                self._complete()

    def _complete(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
        first_error = self._machine.first_error
        if first_error is not None:
            first = first_error
            others = sorted(r for r in self._errors if r != first)
            kind, message = self._machine.errors[first]
            msg = f"rank {first} of {self.np} failed: {kind}: {message}"
            if others:
                msg += (f" (rank {others[0]} was interrupted after it)" if len(others) == 1
                        else f" (ranks {', '.join(map(str, others))} were interrupted after it)")
            msg += f"; session {self.session.id} is still running"
            failures = {first: self._errors[first]}
            self.end(DistributedError(msg, job_id=self.id, reason=Reason.FAILED, failures=failures))
        elif self._errors:
            self.end(DistributedError(
                f"cell {self.id} was interrupted ({self._machine.interrupted}) on ranks "
                f"{', '.join(map(str, sorted(self._errors)))}; session {self.session.id} is "
                f"still running, its variables intact", job_id=self.id, reason=Reason.CANCELLED,
            ))
        else:
            self.end(None)

    def end(self, error: BaseException | None) -> None:
        """The cell is over, with ``error`` or rank values; idempotent. Its state is closed
        (and the session free for the next cell) before it reads as done."""
        if error is None:
            final = state.DONE
        else:
            final = state.CANCELLED if getattr(error, "reason", "") == Reason.CANCELLED else (
                state.FAILED)

        def close() -> None:
            for timer in (self._timer, self._grace):
                if timer is not None:
                    timer.cancel()
            for r in self._ranks:
                if r not in self._values and r not in self._errors:
                    self.state.set_rank(r, state.CANCELLED if final != state.DONE else state.DONE)
            with self._lock:
                self._incoming.clear()  # values still arriving are of no use now
                if error is not None:  # result() raises: the values of the other ranks go too
                    self._values, self._size = {}, 0
            self.state.finish(final, "" if error is None else str(error))
            self.session._cell_over(self)

        self._settle(error, close)

    # -- the Handle interface -------------------------------------------------------------------
    def cancel(self, reason: str = "interrupted from the notebook") -> None:
        """Interrupt the cell on every rank; a second cancel, or a rank that does not stop
        within ``INTERRUPT_GRACE_S``, tears the session down."""
        if not self.settled:
            self._act(lifecycle.Cancel(reason, time.time()))

    def _stuck(self, reason: str) -> None:
        if not self.settled:
            self._act(lifecycle.GraceOver(time.time()))

    def wait(
        self, timeout: float | None = None, on_tick: Callable[[], None] | None = None
    ) -> bool:
        """Block until the cell is over (True) or ``timeout`` passed (False).

        A KeyboardInterrupt interrupts the cell on the ranks and waits for them; a second one
        tears the session down.
        """
        return wait_loop(
            self._done, timeout, self.session.job.with_debugger(on_tick), cancel=self.cancel,
            teardown_s=INTERRUPT_GRACE_S + STOP_S,
            force=lambda: self.session._fail(f"interrupted twice while cell {self.id} ran"),
        )

    def stacks(self, timeout: float = STACKS_WAIT_S) -> Stacks:
        """The stacks of the session's ranks, labelled with this cell (``%dist_stacks``)."""
        return self.session.job.stacks(timeout, job_id=self.id)

    def __repr__(self) -> str:
        return f"<nbdist cell {self.id} on session {self.session.id}: {self.state.status}>"


def _frame(payload: Mapping[str, Any]) -> list[bytes]:
    """A payload's frame for its rank, in parts: its pickle; for a large push, the pickle of
    its other keys and then its value's pickle as it is (``protocol.PushPayload``), so that
    the value is never copied into a second pickle."""
    data = payload.get("data")
    if payload.get("kind") == "push" and isinstance(data, bytes) and len(data) > DIRECT_BYTES:
        return [_pickling.dumps({k: v for k, v in payload.items() if k != "data"}), data]
    return [_pickling.dumps(payload)]


def _stop_at_exit() -> None:
    session = _current
    if session is not None and session.alive:
        session.stop("the kernel is shutting down")


atexit.register(_stop_at_exit)


def _ranks_on(ranks: state.JobState, which: list[int]) -> str:
    """``rank 3 (host a)``, ``ranks 1, 2 (not connected)``: the ranks, with where each is."""
    def where(rank: int) -> str:
        host = ranks.ranks[rank].host if rank < len(ranks.ranks) else ""
        return f"on {host}" if host else "not connected"

    noun = "rank" if len(which) == 1 else "ranks"
    return f"{noun} " + ", ".join(f"{r} ({where(r)})" for r in which)

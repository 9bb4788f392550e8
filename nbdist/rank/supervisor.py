"""The rank supervisor: runs on a rank's host, whichever backend started it.

It says hello to the driver's event server, learns the rank's environment from the driver
(the rendezvous), starts the rank's interpreter (``rank/runtime.py``) in a new process group, pumps
its stdout/stderr at the file-descriptor level and its structured events to the driver, and
returns how the rank ended. It kills the rank's whole process group when cancelled, when the
driver asks, and after the rank exits (so nothing the rank started lingers).

When the event server cannot be reached, the rank still runs: the backend shares the ranks'
hellos its own way (``gather``: in memory for local ranks, ``BarrierTaskContext.allGather`` on
Spark), each supervisor plans the world from them as the driver would, and the result returns
through the backend as always. What could not be sent (output lines, progress, metrics) is
counted in the outcome, and the driver reports it.

Imports only the standard library and psutil: it runs inside Spark's Python workers too.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal, Protocol, cast

from nbdist import channel, protocol, timeline
from nbdist._timer import after
from nbdist.lines import LineBatcher, cut_long_lines
from nbdist.protocol import (
    DriverEvent,
    EnvFrame,
    ErrorRecord,
    Frame,
    HelloEvent,
    LaunchRequest,
    RankEvent,
    RankOutcome,
    RankStatus,
    StacksEvent,
    read_frame,
    write_frame,
    write_frame_parts,
)
from nbdist.rank import signals
from nbdist.rank.cells import JobWork, RankWork, SessionCells
from nbdist.rank.client import EventClient
from nbdist.rank.death import OomWatch
from nbdist.rank.host import environ
from nbdist.resources import Sampler
from nbdist.world import Hello, plan_world

#: Output is sent at most once per this interval per stream while lines keep coming; a line
#: after a quiet spell goes at once. A rank printing in a tight loop then costs the driver one
#: event per few thousand lines instead of one per line.
BATCH_S = 0.005
#: Pipe buffer asked for (Linux allows up to 1 MiB unprivileged) and the most read at once,
#: so a rank printing fast does not block while its supervisor waits out ``BATCH_S``.
PIPE_BYTES = 1 << 20
#: A running rank's supervisor says it is alive this often, even when the rank is silent, so
#: the driver can tell a quiet rank from a lost one: the driver's state expects this pace and
#: shows a rank it has not heard of for three heartbeats as silent.
HEARTBEAT_S = protocol.HEARTBEAT_S
#: How often a session's supervisor checks that the driver is still there.
DRIVER_CHECK_S = 0.5
#: How long the output pumps may read on after the rank and everything it started are gone:
#: only a process out of reach (no longer a descendant) can still hold the pipes then.
PUMP_GRACE_S = 2.0
#: Time between SIGTERM and SIGKILL when a rank is torn down.
TERM_GRACE_S = 2.0
#: Lines of output kept to explain a rank that died without a traceback.
TAIL_LINES = 20
#: How long a rank's stack dump may take to be written, and the quiet that ends one.
STACKS_S = 2.0
STACKS_QUIET_S = 0.05
#: How long py-spy may take to read a rank's native frames (``native_stacks``): within the
#: driver's wait for the answers (``job.STACKS_WAIT_S``) after the dump (``STACKS_S``).
NATIVE_STACKS_S = 1.0
#: How long a rank's flight recorder dump is waited for, before its stacks are taken (the
#: dump itself takes under a millisecond once the rank's thread has the GIL).
FR_S = 0.5
#: Pieces of a session cell's value read from the interpreter and not yet forwarded to the
#: driver: the reader waits for room, so the kernel holds a few ``values.CHUNK`` at a time.
PIECES_QUEUED = 2


class Proc(Protocol):
    """What the supervisor needs of a rank's process: a ``Popen``, or a zygote's fork."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def new_sync_marker() -> str:
    """A marker no program prints by chance: a rank writes it after each session cell."""
    return f"\x1fnbdist-sync-{secrets.token_hex(8)}\x1f\n"


class RankProcess:
    """A rank's interpreter with its pipes: started here, taken warm from a pool, or forked.

    The interpreter runs in a new session (its own process group). Closing ``ctl_in`` is how
    it learns that its supervisor is gone: it then kills its group.
    """

    proc: Proc

    def __init__(self, python: str, env: dict[str, str], cwd: str | None) -> None:
        ctl_in_r, ctl_in_w = os.pipe()
        ctl_out_r, ctl_out_w = os.pipe()
        full = {**environ(), **env}
        full["NBDIST_CTL_IN"], full["NBDIST_CTL_OUT"] = str(ctl_in_r), str(ctl_out_w)
        full["NBDIST_SYNC"] = sync = new_sync_marker()
        full.setdefault("PYTHONIOENCODING", "utf-8")
        try:
            proc = subprocess.Popen(
                [python, "-c", "from nbdist.rank.runtime import main; main()"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(ctl_in_r, ctl_out_w), start_new_session=True, env=full, cwd=cwd,
            )
        except BaseException:
            for fd in (ctl_in_w, ctl_out_r):
                os.close(fd)
            raise
        finally:
            os.close(ctl_in_r)
            os.close(ctl_out_w)
        self._attach(proc, ctl_in_w, ctl_out_r, sync)

    @classmethod
    def attach(cls, proc: Proc, ctl_in_w: int, ctl_out_r: int, sync: str) -> RankProcess:
        """A rank's interpreter started elsewhere (a zygote's fork), given its control pipes
        and the sync marker it was told (``NBDIST_SYNC``)."""
        rp = cls.__new__(cls)
        rp._attach(proc, ctl_in_w, ctl_out_r, sync)
        return rp

    def _attach(self, proc: Proc, ctl_in_w: int, ctl_out_r: int, sync: str) -> None:
        self.proc = proc
        #: What the interpreter writes on stdout and stderr after a session cell's output.
        self.sync_marker = sync
        self.ctl_in = os.fdopen(ctl_in_w, "wb")
        self.started = time.monotonic()
        #: Frames from the interpreter, None at the end; one reader for its whole life, so a
        #: warm interpreter can be watched by its pool and then handed to a supervisor.
        self.frames: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        #: Set once the modules of a warm-up are imported, or once the interpreter is gone (it
        #: will never be warmer: a pool that let it go must not be waited for).
        self.warm = threading.Event()
        self._room = threading.Semaphore(PIECES_QUEUED)
        #: Frames are written whole: the driver's messages come on the event channel's reader
        #: thread, and a session's cells from the notebook's thread (``Supervisor.deliver``).
        self._send_lock = threading.Lock()
        threading.Thread(
            target=self._read, args=(os.fdopen(ctl_out_r, "rb"),), daemon=True
        ).start()

    def _read(self, f: Any) -> None:
        with f:
            while (frame := read_frame(f)) is not None:
                if frame[0] == Frame.PIECE:
                    self._room.acquire()  # released by piece_done, once forwarded
                if frame[0] == Frame.EVENT and b'"warm"' in frame[1]:
                    try:
                        if json.loads(frame[1]).get("t") == "warm":
                            self.warm.set()
                    except ValueError:
                        pass
                self.frames.put(frame)
        self.frames.put(None)
        self.warm.set()

    def piece_done(self) -> None:
        """A ``PIECE`` frame taken from ``frames`` was dealt with: room for the next one."""
        self._room.release()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, kind: int, body: bytes) -> bool:
        """Write a frame; False if the interpreter is gone.

        Anything that stops a frame half-written (a KeyboardInterrupt in the notebook's thread
        while the pipe is full) closes the pipe, then is raised: the interpreter would read
        the frames after it as garbage and never hear of an interrupt again; this way it sees
        its supervisor gone and ends (its rank fails, with the reason)."""
        with self._send_lock:
            try:
                write_frame(self.ctl_in, kind, body)
            except (BrokenPipeError, ValueError):  # ValueError: already closed
                return False
            except BaseException:
                self._abandon()
                raise
        return True

    def send_parts(self, kind: int, parts: list[bytes]) -> bool:
        """:meth:`send` of a frame whose body is ``parts`` joined, written without joining."""
        with self._send_lock:
            try:
                write_frame_parts(self.ctl_in, kind, parts)
            except (BrokenPipeError, ValueError):
                return False
            except BaseException:
                self._abandon()
                raise
        return True

    def _abandon(self) -> None:
        """Close the control pipe without writing what its buffer holds (half a frame)."""
        try:
            self.ctl_in.raw.close()  # the buffered file then closes without a flush
        except OSError:
            pass

    def close(self) -> None:
        """Let go of the interpreter: it kills its own process group when it sees this."""
        for f in (self.ctl_in,):
            try:
                f.close()
            except OSError:
                pass

    def discard(self) -> None:
        """Kill an interpreter nobody will use (an idle warm one) and reap it."""
        self.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


@dataclass
class RankSpec:
    """Everything a supervisor needs; plain data, so it pickles small into a Spark closure."""

    rank: int
    world_size: int
    job_id: str
    secret: str
    driver: tuple[str, int]
    payload: bytes
    host: str = "127.0.0.1"
    cwd: str | None = None
    gpus: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # set at spawn, before the rendezvous env
    python: str = sys.executable
    rendezvous_timeout: float = 300.0
    run_id: str = ""  # TORCHELASTIC_RUN_ID, for a world planned without the driver
    #: What the driver's rendezvous adds to the environment (``LaunchRequest.world_env``),
    #: for a world planned without the driver.
    world_env: dict[str, str] = field(default_factory=dict)
    #: A persistent session's rank (``%dist_session``): no payload at start; cells arrive from
    #: the driver over the event channel, one after another, until it says ``quit``.
    session: bool = False
    #: The rank's host as its backend's scheduler names it (a Spark executor's address), so
    #: that the driver can tell which ranks a lost executor took along.
    executor: str = ""
    #: Stop the rank when the driver has said nothing (not even its pings) for this long:
    #: the driver is gone, or the network to it is (None: only a closed connection counts).
    heartbeat_timeout: float | None = None
    #: When the backend scheduled the rank (``time.time()`` of its host: a Spark task's
    #: start), the launch timeline's ``scheduled`` mark; 0: when the supervisor starts.
    scheduled: float = 0.0
    #: Variables of the host process that differ between its worker processes (Ray's
    #: ``RAY_JOB_ID``: a worker started before the job has another): a rank has them as this
    #: process has them, set or unset, also when it is forked from a zygote that another
    #: worker started, so the zygote's key leaves them out (``executor_zygote.key``).
    volatile: tuple[str, ...] = ()

    @classmethod
    def for_rank(cls, request: LaunchRequest, rank: int, *, env: dict[str, str] | None = None,
                 **where: Any) -> RankSpec:
        """Rank ``rank``'s spec from its job's request: the one mapping every backend uses.

        ``env``: what the backend adds under the request's own environment (the user's paths);
        ``where``: what only the backend knows of the rank's host (``host``, ``gpus``, ``cwd``,
        ``executor``, ``scheduled``...)."""
        return cls(
            rank=rank, world_size=request.np, job_id=request.job_id, secret=request.secret,
            driver=request.driver, payload=request.payload, env={**(env or {}), **request.env},
            run_id=request.run_id, world_env=dict(request.world_env), session=request.session,
            heartbeat_timeout=request.heartbeat_timeout, **where,
        )


def env_frame(spec: RankSpec, world: dict[str, str]) -> EnvFrame:
    """The rank's ``Frame.ENV``: its variables over what its interpreter has (a forked rank:
    its zygote's environment, which matches this process's but for ``spec.volatile``)."""
    frame: EnvFrame = {"env": {**spec.env, **world}, "cwd": spec.cwd or ""}
    if spec.volatile:
        here = environ()
        frame["env"] = {**{k: here[k] for k in spec.volatile if k in here}, **frame["env"]}
        frame["unset"] = [k for k in spec.volatile if k not in here and k not in frame["env"]]
    return frame


#: How a backend shares the ranks' hellos without the event channel: called by every rank with
#: its own hello, returns all of them in rank order (or raises).
#: The backend's own rendezvous, used when the event server is out of reach: this rank's hello
#: in, every rank's out (in rank order).
Gather = Callable[[HelloEvent], list[HelloEvent]]


@dataclass(frozen=True)
class Taken:
    """What a backend's ``take`` gives a supervisor: the rank's interpreter, obtained warm, or
    None (the rank starts as a fresh interpreter).

    ``how``: ``forked`` (from a zygote), ``warm`` (an interpreter started ahead) or ``fresh``;
    ``why``: why the rank was not forked from a zygote, in words a user can act on ("" when it
    was). The driver shows it in ``%dist_status JOB`` and its ``--timeline``.
    """

    proc: RankProcess | None
    how: str = "fresh"
    why: str = ""


#: A backend's warm start: a rank's interpreter (``Taken``) for a spec.
Take = Callable[[RankSpec], Taken]


class Supervisor:
    """Supervises one rank: ``run()`` blocks until the rank is over; ``cancel()`` works anywhere.

    ``take`` gives a warm interpreter (the local backend's pool, a Spark executor's zygote) and
    says why when it has none; ``gather`` is the backend's rendezvous for when the driver's
    event server cannot be reached (see the module docstring).
    """

    def __init__(
        self,
        spec: RankSpec,
        take: Take | None = None,
        gather: Gather | None = None,
    ) -> None:
        self.spec = spec
        self._take = take
        #: How the rank's interpreter was obtained, and why not forked (``Taken``).
        self.start = Taken(None)
        self._gather = gather
        self._channel_error: str | None = None
        self._gather_error: str | None = None
        self._gathered = threading.Event()  # the fallback rendezvous ended, with a world or not
        self._lost_lines = 0
        self._dropped = 0
        self._rp: RankProcess | None = None
        self.modules: list[str] = []  # top-level modules the rank's code imported
        self._client: EventClient | None = None
        self._world = threading.Event()
        self._world_env: dict[str, str] = {}
        self._cancelled = threading.Event()
        #: Whether a cancel signalled the rank while it was alive: a rank that died on its
        #: own before a cancel came (the cancel another rank's failure caused) failed, it was
        #: not stopped. The cancel can reach this supervisor before the rank's end does (a
        #: zygote's fork is reaped and told by the zygote, a beat later), so :meth:`cancel`
        #: looks at the rank's process itself.
        self._stopped_alive = False
        self._lock = threading.Lock()
        self._proc: Proc | None = None
        self._result: bytes | None = None
        self._error: ErrorRecord | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._result_type: str | None = None
        self._escapees: list[Any] = []
        self._oom = OomWatch()  # the rank's memory cgroups, to tell an OOM kill when it dies
        self._sampler: Sampler | None = None
        self._reported_rss: int | None = None  # the rank's own memory after its last cell
        #: What the rank runs: all that differs between a job's rank and a session's.
        self._work: RankWork = (SessionCells(spec.secret, self._send_all, self._rank_rss)
                                if spec.session else JobWork(spec.payload))
        # The work holds the payload until it is sent; the spec (kept by the backend with the
        # job) need not (a large notebook package was kept in the kernel after its job).
        spec.payload = b""
        self._killer: threading.Timer | None = None  # SIGKILL after SIGTERM's grace period
        self._rank_pid: int | None = None  # the rank's own pid (a guardian's child)
        self._stacks_path: str | None = None  # where the rank writes its stack dumps
        self._stacks_lock = threading.Lock()  # one dump at a time
        #: The rank's flight recorder dumps, as they come (``Frame.COLLECTIVES``).
        self._fr_dumps: queue.Queue[bytes] = queue.Queue()
        self._tf_reservation: socket.socket | None = None  # the TF worker's port, held until spawn
        self._jax_reservation: socket.socket | None = None  # rank 0: JAX's coordinator, the same
        #: The launch's marks so far (``nbdist.timeline``), sent to the driver as they happen.
        self.marks: dict[str, float] = {}
        #: Called with each new mark's name, from the thread that made it (a backend's hook:
        #: Spark starts its executor's zygote once the rank has imported its modules).
        self.on_mark: Callable[[str], None] | None = None
        #: Called with the modules the rank reports it imported, after its code (a backend's
        #: hook: the executor's zygote imports them for the next run).
        self.on_modules: Callable[[list[str]], None] | None = None

    # -- driver messages -----------------------------------------------------------------------
    def _on_message(self, msg: channel.Event) -> None:
        if msg.get("t") == "world":
            self._world_env = {str(k): str(v) for k, v in msg.get("env", {}).items()}
            self.mark(timeline.WORLD)
            self._world.set()
        elif msg.get("t") == "cancel":
            self.cancel()
        elif msg.get("t") == "debug" and self._rp is not None:
            self._rp.send(Frame.DEBUG, str(msg.get("text", "")).encode())
        elif msg.get("t") == "stacks":
            # Off the client's reader thread: the dump takes up to STACKS_S.
            threading.Thread(target=self._answer_stacks, args=(msg.get("id"),), daemon=True,
                             name=f"nbdist-stacks-{self.spec.rank}").start()
        else:
            self._work.on_message(msg, self._rp)

    def deliver(self, msg: DriverEvent) -> bool:
        """A driver message handed over in the driver's process (``LocalLauncher.deliver``),
        as if it came on the event channel; False while the channel is not up (the driver
        then sends it there, and learns that the rank is not connected)."""
        client = self._client
        if client is None or not client.alive:
            return False
        self._on_message(cast(channel.Event, msg))
        return True

    def world(self) -> dict[str, str]:
        """The rank's environment from the rendezvous (empty before it)."""
        return dict(self._world_env)

    def mark(self, name: str, at: float | None = None) -> None:
        """Stamp a moment of the launch (``nbdist.timeline``); the first stamp of each counts.
        Kept until the channel is up, then sent (lost without a channel, and not counted)."""
        if name in self.marks:
            return
        at = self.marks[name] = time.time() if at is None else at
        if self._client is not None:
            self._send({"t": "marks", "at": {name: at}})
        if self.on_mark is not None:
            self.on_mark(name)

    def _rank_pid_now(self) -> int | None:
        rp = self._rp
        return self._rank_pid or (rp.pid if rp is not None else None)

    def _send(self, event: RankEvent, lazy: bool = False) -> None:
        self._send_all((event,), lazy)

    def _send_all(self, events: Sequence[RankEvent], lazy: bool = False) -> None:
        """Send ``events`` together (one write); count what is lost. ``lazy``: they may wait
        for other events to go with (``EventClient.send_all``)."""
        client = self._client
        if client is not None and client.send_all(events, lazy):
            return
        # Lost: without a channel, or the channel broke. Counted, so the driver can say so.
        with self._lock:  # the pumps, the control reader and the heartbeat all send
            for event in events:
                kind = event.get("t")
                if kind == "out":
                    # Whole lines, as the driver counts them (a "\r" redraw of a bar is not one).
                    self._lost_lines += str(event.get("text", "")).count("\n")
                elif kind not in ("hb", "state", "res", "marks"):  # bookkeeping is no loss
                    self._dropped += 1

    # -- life -----------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        spec = self.spec
        self.mark(timeline.SCHEDULED, spec.scheduled or None)
        hello = self._hello()
        try:
            self._connect(hello)
            self._send({"t": "marks", "at": dict(self.marks)})
        except OSError as exc:
            self._channel_error = (
                f"rank {spec.rank} on {spec.host} cannot reach the driver's event server at "
                f"{spec.driver[0]}:{spec.driver[1]}: {type(exc).__name__}: {exc}"
            )
            if self._gather is None or self._work.needs_channel:
                return RankOutcome(
                    spec.rank, RankStatus.FAILED, channel_error=self._channel_error, error={
                        "type": "ConnectionError", "traceback": "",
                        "message": self._channel_error,
                    })
            threading.Thread(
                target=self._world_without_channel, args=(self._gather, hello), daemon=True,
                name=f"nbdist-gather-{spec.rank}",
            ).start()
        ended = threading.Event()
        threading.Thread(target=self._beat, args=(ended,), daemon=True,
                         name=f"nbdist-beat-{spec.rank}").start()
        sampler = self._sampler = Sampler(self._rank_pid_now, spec.gpus, self._send,
                                          seen=self._oom.see)
        if self._client is not None:
            sampler.start()
        try:
            return self._run_rank()
        finally:
            sampler.stop()
            ended.set()
            if self._killer is not None:
                self._killer.cancel()  # the SIGKILL below makes it moot; no thread outlives us
            self._release_ports()
            self._kill_group(signal.SIGKILL)
            if self._rp is not None:
                self._rp.close()
            if self._client is not None:
                self._client.close()

    def _hello(self) -> HelloEvent:
        spec = self.spec
        hello: HelloEvent = {
            "host": spec.host, "pid": os.getpid(), "cpus": os.cpu_count() or 1,
            "gpus": list(spec.gpus),
        }
        # Every rank reserves a port for its TensorFlow worker (TF_CONFIG, planned by the
        # driver from all hellos). It stays bound until the rank starts, so no other rank on
        # this host is offered it meanwhile (nor rank 0's MASTER_PORT, chosen after it).
        # Costs about 0.2 ms and one descriptor during the rendezvous (docs/keras.md).
        self._tf_reservation = _reserve_port()
        if self._tf_reservation is not None:
            hello["tf_port"] = self._tf_reservation.getsockname()[1]
        if spec.rank == 0:
            # JAX's coordinator (jax.distributed.initialize(), rank/jax_cluster.py) gets a port
            # of its own, held like the TF port, so a cell may use torch.distributed too.
            self._jax_reservation = _reserve_port()
            if self._jax_reservation is not None:
                hello["jax_port"] = self._jax_reservation.getsockname()[1]
            hello["port"] = channel.free_port()
        if spec.executor:
            hello["executor"] = spec.executor
        return hello

    def _release_ports(self) -> None:
        """Free the reserved TensorFlow and JAX ports for the rank to bind (both bind all
        interfaces)."""
        for held in (self._tf_reservation, self._jax_reservation):
            if held is not None:
                held.close()
        self._tf_reservation = self._jax_reservation = None

    def _connect(self, hello: HelloEvent) -> None:
        spec = self.spec
        self._client = EventClient(
            spec.driver, spec.job_id, spec.rank, spec.secret, hello, self._on_message
        )

    def _world_without_channel(self, gather: Gather, hello: HelloEvent) -> None:
        """The rendezvous through the backend (``gather``), planned here as the driver would."""
        spec = self.spec
        try:
            hellos = gather({**hello, "rank": spec.rank})
            # spec.env: the job's --env (which wins, as on the driver) and the PYTHONPATH the
            # backend adds, which the rank gets anyway; spec.world_env: what the driver's
            # rendezvous adds (a restart's count).
            envs = plan_world(
                {r: Hello.from_event(r, h) for r, h in enumerate(hellos)}, spec.world_size,
                spec.run_id or spec.job_id, spec.job_id, use_gpus=bool(spec.gpus),
                user_env={**spec.env, **spec.world_env},
            )
        except Exception as exc:  # the backend's own error (a Spark barrier failure, ...)
            self._gather_error = f"{type(exc).__name__}: {exc}"
        else:
            self._world_env = envs[spec.rank]
            self.mark(timeline.WORLD)
            self._world.set()
        finally:
            self._gathered.set()

    def _wait_world(self) -> bool:
        deadline = time.monotonic() + self.spec.rendezvous_timeout
        while not self._world.wait(0.1):
            client = self._client
            if self._cancelled.is_set() or time.monotonic() > deadline:
                return False
            if client is None and self._gathered.is_set():
                # The fallback rendezvous ended; it may have set the world just after the wait
                # above timed out (it sets the world before ``_gathered``), so look again.
                return self._world.is_set() and not self._cancelled.is_set()
            if client is not None and not client.alive:
                return False
            # (A driver that went silent is caught by _beat, which cancels.)
        return not self._cancelled.is_set()

    def _run_rank(self) -> RankOutcome:
        spec = self.spec
        if not self._wait_world():
            status = RankStatus.CANCELLED if self._cancelled.is_set() else RankStatus.FAILED
            why = f"rank {spec.rank} got no rendezvous from the driver"
            if self._channel_error is not None:
                why = (f"{self._channel_error}; and the rendezvous without it failed: "
                       f"{self._gather_error or 'no answer'}")
            return RankOutcome(
                spec.rank, status, channel_error=self._channel_error,
                error=None if status == RankStatus.CANCELLED else {
                    "type": "TimeoutError" if self._channel_error is None else "ConnectionError",
                    "traceback": "", "message": why,
                },
            )
        proc = self._spawn()
        if proc is None:
            return RankOutcome(spec.rank, RankStatus.CANCELLED)
        self._send({"t": "state", "state": "starting", "pid": proc.pid, "host": spec.host,
                    "start": self.start.how, "why": self.start.why})
        # Readable once the pumps are to stop (the rank is gone, PUMP_GRACE_S passed).
        self._stop_r, stop_w = os.pipe()
        try:
            code = self._watch(proc, stop_w)
        finally:
            os.close(self._stop_r)
            os.close(stop_w)
        self._ctl_thread.join(timeout=5)
        outcome = RankOutcome(
            spec.rank, RankStatus.FAILED, result=self._result, error=self._error, exit_code=code,
            pid=proc.pid, tail=list(self._tail), result_type=self._result_type,
            peak_rss=self._sampler.peak_rss if self._sampler is not None else None,
            # A job's rank: its own stamp of its code's end, the supervisors of two ranks
            # reading their frames in either order (a peer that lost this rank read its error
            # 0.1 ms before this rank's supervisor read the cause). A session's rank (no
            # ``result`` mark: its cells end on the channel, ``end`` is its first cell's):
            # its exit.
            ended=(self.marks.get(timeline.END, self.marks[timeline.RESULT])
                   if timeline.RESULT in self.marks else self.marks.get(timeline.EXIT)),
        )
        stopped = self._stopped_alive
        if code == -signal.SIGKILL and self._result is None and not stopped:
            kill = self._oom.killed(self._rank_pid_now())
            if kill is not None:
                outcome.oom = kill.evidence
                if kill.rss is not None:
                    outcome.peak_rss = max(outcome.peak_rss or 0, kill.rss)
        if self._result is not None or (self._work.quitting and code == 0):
            # The value was delivered and output flushed: a crash after that (torch's teardown
            # abort) does not make the rank a failure. A session's rank ends on ``quit``.
            outcome.status = RankStatus.DONE
        elif stopped and self._error is None:
            outcome.status = RankStatus.CANCELLED
        self._result = None  # the outcome has it: the launcher may keep this supervisor
        self._send({"t": "state", "state": outcome.status, "exit": code})
        outcome.dropped_events, outcome.lost_lines = self._dropped, self._lost_lines
        outcome.channel_error = self._channel_error
        if outcome.channel_error is None and (self._dropped or self._lost_lines):
            outcome.channel_error = (
                f"rank {spec.rank} on {spec.host} lost its connection to the driver's event "
                f"server at {spec.driver[0]}:{spec.driver[1]} while it ran"
            )
        return outcome

    def _spawn(self) -> Proc | None:
        spec = self.spec
        self._release_ports()
        world = dict(self._world_env)
        if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in spec.env:
            world.pop("OMP_NUM_THREADS", None)  # the user's setting wins
        world.update(socket_ifnames(world, spec.env))
        with self._lock:
            if self._cancelled.is_set():
                return None
            taken = self._take(spec) if self._take is not None else Taken(None)
            rp = taken.proc
            if rp is None:
                rp = RankProcess(spec.python, {**spec.env, **world}, spec.cwd)
                taken = Taken(None, "fresh", taken.why)
            self.start = taken
            self._proc = rp.proc
            self._rp = rp
        self.mark(timeline.SPAWNED)
        # The environment also travels as a frame: a warm interpreter was started before the
        # rendezvous and sets it itself before running anything of the user's.
        env = json.dumps(env_frame(spec, world)).encode()
        self._work.begin(rp, env)
        self._ctl_thread = threading.Thread(
            target=self._read_control, args=(rp,), daemon=True
        )
        self._ctl_thread.start()
        return rp.proc

    def _watch(self, proc: Proc, stop_w: int) -> int:
        """Pump the rank's output until it ended and its pipes are done with; its exit code."""
        pumps = [
            threading.Thread(target=self._pump, args=(proc.stdout, "o"), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, "e"), daemon=True),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        self.mark(timeline.EXIT)
        # Whatever the rank left in its group (servers, data loader workers) goes with it; this
        # also closes the pipes those processes inherited, so the pumps reach end of file.
        # (What it started in sessions of their own, its guardian has killed already.)
        self._kill_group(signal.SIGKILL)
        deadline = time.monotonic() + PUMP_GRACE_S
        for t in pumps:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        # A process out of reach still holding a pipe (no descendant any more): stop reading
        # rather than wait on it, and leave no thread or descriptor behind.
        os.write(stop_w, b"x")
        for t in pumps:
            t.join()
        return code

    def _beat(self, ended: threading.Event) -> None:
        """Heartbeats to the driver from the hello on, and the keepalive the other way.

        A session's rank goes when its connection to the driver closes (the kernel stopped).
        With ``heartbeat_timeout`` any rank goes when the driver said nothing for that long
        while the connection looked open: the driver's host or the network to it is gone,
        and no reset will ever come to say so. A job's rank too: its result could not reach
        the driver anyway, and its GPUs would stay taken until Spark gives up on the driver
        (its ``spark.network.timeout``, minutes). A job's rank whose connection was *closed*
        runs on: its result still returns through the backend.
        """
        spec = self.spec
        timeout = spec.heartbeat_timeout
        last = time.monotonic()
        watch = self._work.ends_with_driver
        while not ended.wait(DRIVER_CHECK_S if watch or timeout else HEARTBEAT_S):
            client = self._client
            if watch and (client is None or not client.alive):
                self.cancel()
                return
            if timeout and client is not None and client.alive:
                quiet = time.monotonic() - client.last_heard
                if quiet > timeout:
                    # Only the executor's log can tell: the driver is out of reach.
                    print(f"nbdist: stopping rank {spec.rank}: nothing from the driver at "
                          f"{spec.driver[0]}:{spec.driver[1]} for {quiet:.0f} s "
                          f"(heartbeat timeout {timeout:g} s)", file=sys.stderr, flush=True)
                    self.cancel()
                    return
            if time.monotonic() - last >= HEARTBEAT_S:
                last = time.monotonic()
                self._send({"t": "hb"})

    def _read_control(self, rp: RankProcess) -> None:
        while (frame := rp.frames.get()) is not None:
            kind, body = frame
            if kind == Frame.EVENT:
                self._rank_event(rp, body)
            elif kind == Frame.COLLECTIVES:
                self._fr_dumps.put(body)
            elif kind == Frame.PIECE:
                self._work.piece(body)
                rp.piece_done()
            elif kind in (Frame.RESULT, Frame.ERROR) and \
                    self._work.ended(kind, body, self._result_type):
                pass  # a session cell's end, sent to the driver
            elif kind == Frame.RESULT:
                self._result = body
                self.mark(timeline.RESULT)
            elif kind == Frame.ERROR:
                self._error = json.loads(body)
                self.mark(timeline.RESULT)

    def _rank_event(self, rp: RankProcess, body: bytes) -> None:
        """An event of the interpreter's: kept here (its state, marks, result type, modules)
        or forwarded to the driver."""
        try:
            event = json.loads(body)
        except ValueError:
            return
        kind = event.get("t")
        if kind == "warm":
            return
        if kind == "state" and event.get("state") == "ready":
            self._rank_pid = int(event.get("pid") or rp.pid)
            self._stacks_path = event.get("stacks") or None
            at = event.get("at")
            self.mark(timeline.READY, at if isinstance(at, (int, float)) else None)
        if kind == "marks":  # the interpreter's (imports, end): first ones
            for name, at in timeline.clean(event.get("at") or {}).items():
                self.mark(name, at)
        elif kind == "result":
            self._result_type = str(event.get("type"))
            self._work.value(event, self._result_type)
        elif kind == "modules":
            self.modules = [str(m) for m in event.get("names", ())]
            if self.on_modules is not None:
                self.on_modules(self.modules)
        else:
            self._forward(event)

    def _forward(self, event: Any) -> None:
        """An event of the interpreter's on to the driver: progress, metrics, its state, a
        session cell's names (with the rank's own memory, kept for the cell's end)."""
        kind = event.get("t")
        if kind == "names":
            rss = event.get("rss")
            self._reported_rss = rss if type(rss) is int else None
        elif kind == "state":  # a cell starts (a failed cell's names come after its end)
            self._reported_rss = None
        self._send(event, self._work.lazy_start and kind == "state"
                   and event.get("state") == "running")

    def _answer_stacks(self, req: Any) -> None:
        # The flight recorder first, its answer awaited: the rank's thread that answers must
        # not be starting while faulthandler walks the threads (``runtime._ask_collectives``).
        with self._stacks_lock:  # one flight recorder request at a time too
            fr = self._collectives(FR_S) if self._ask_collectives() else ""
        text, error = self.stacks()
        answer: StacksEvent = {"t": "stacks", "id": req if isinstance(req, int) else 0,
                               "package": _PACKAGE_DIR}
        if text:
            answer["text"] = text
        if error:
            answer["error"] = error
        if fr:
            answer["fr"] = fr
        pid = self._rank_pid
        if text and pid is not None:
            native = native_stacks(pid)
            if native:
                answer["native"] = native
        self._send(answer)

    def _ask_collectives(self) -> bool:
        """Ask the rank for its flight recorder's dump (answered on ``_fr_dumps``)."""
        rp, proc = self._rp, self._proc
        if rp is None or proc is None or proc.poll() is not None:
            return False
        while not self._fr_dumps.empty():  # a late answer to an earlier request
            self._fr_dumps.get_nowait()
        return rp.send(Frame.COLLECTIVES, b"")

    def _collectives(self, timeout: float) -> str:
        """The dump asked for by ``_ask_collectives`` (torch's JSON), or "" (none, or late)."""
        try:
            return self._fr_dumps.get(timeout=timeout).decode("utf-8", "replace")
        except queue.Empty:
            return ""

    def stacks(self, timeout: float = STACKS_S) -> tuple[str, str]:
        """The stacks of every thread of the rank (``faulthandler``'s text), and "" — or ""
        and why there are none.

        ``STACKS_SIGNAL`` goes to the rank only where it is safe (``signals.hazard``: its
        dispositions and what its threads wait in). Elsewhere (a library reset the handler,
        the rank sleeps in C) nothing is signalled: the rank's control-pipe thread writes the
        dump (``Frame.STACKS``), and where that gives none (the GIL held in C code), py-spy
        reads the Python frames from outside; failing that the rank is named with why.
        """
        path, pid, proc, rp = self._stacks_path, self._rank_pid, self._proc, self._rp
        if proc is None or proc.poll() is not None or pid is None:
            return "", "the rank is not running"
        if path is None:
            return "", ("the rank's interpreter takes no stack dumps (no SIGUSR2 on this "
                        "platform, or no temporary folder it could write them to)")
        sig = getattr(signal, protocol.STACKS_SIGNAL)
        with self._stacks_lock:
            hurt = signals.hazard(pid, sig)
            try:
                with open(path, "rb") as f:
                    start = f.seek(0, os.SEEK_END)
                    if not hurt:
                        os.kill(pid, sig)
                    elif rp is None or not rp.send(Frame.STACKS, b""):
                        return "", f"not signalled ({hurt}), and its control pipe is closed"
                    data = _read_dump(f, start, timeout)
            except OSError as exc:
                return "", f"its stacks could not be read: {exc}"
        if data:
            return data.decode("utf-8", "replace"), ""
        if not hurt:
            return "", f"no stack dump within {timeout:g} s"
        outside = python_stacks(pid)
        if outside.startswith("Thread"):
            return outside, ""
        return "", (f"unreachable: not signalled ({hurt}); its own thread gave no stacks "
                    f"within {timeout:g} s (C code holding the GIL?)"
                    + (f"; {outside.strip('()')}" if outside else
                       "; py-spy is not installed to read them from outside"))

    def _rank_rss(self) -> int | None:
        """Memory of the rank and its children (not of its guardian, which shares most pages
        with the rank and would count them twice): what the rank said of its own after the
        cell, with its children's at the last sample (``Sampler.rss_with``); or as
        ``Sampler.rss_now`` measures it."""
        own, self._reported_rss = self._reported_rss, None
        sampler = self._sampler
        if sampler is None:
            return own
        return sampler.rss_now() if own is None else sampler.rss_with(own)

    def _pump(self, pipe: Any, stream: Literal["o", "e"]) -> None:
        """Forward one output pipe in batches of whole lines (``\\r`` ends a line too).

        Sends ``{"t": "out", "s": stream, "text": chunk}``; what a chunk holds is
        ``lines.LineBatcher``'s business. The driver splits it.
        """
        fd = pipe.fileno()
        _grow_pipe(fd)
        work, rp = self._work, self._rp
        marker = rp.sync_marker if rp is not None else ""
        batcher = LineBatcher(lambda text: work.strip_sync(marker, text))
        # Read into one buffer: ``os.read(fd, PIPE_BYTES)`` allocates (and maps) a fresh MiB
        # per read, ~20 µs where this costs 1.5, paid by 2 pumps per rank at every session
        # cell's end (its sync markers).
        buf = bytearray(PIPE_BYTES)
        view = memoryview(buf)
        stopping = False  # the supervisor said stop: one more read of what is there
        # poll, not select.select: a kernel (or Spark worker) holding more than 1024 files gets
        # pipe descriptors above select's FD_SETSIZE, which it refuses.
        with pipe, selectors.PollSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            sel.register(self._stop_r, selectors.EVENT_READ)
            while True:
                wait = batcher.wait(time.monotonic())
                ready = wait is not None and wait <= 0
                if not ready:
                    readable = {key.fd for key, _ in sel.select(wait)}
                    if self._stop_r in readable and (fd not in readable or stopping):
                        break  # told to stop, and what was there to read is read
                    stopping = self._stop_r in readable
                    if fd in readable:
                        # Batching: within BATCH_S of the last send, let the pipe fill up
                        # instead of waking for every line a busy rank writes.
                        gap = batcher.last_sent + BATCH_S - time.monotonic()
                        if gap > 0:
                            time.sleep(gap)
                        n = os.readv(fd, [buf])
                        if not n:
                            break
                        data = bytes(view[:n])
                        chunks, marks = batcher.feed(data, time.monotonic())
                        if marks:
                            # A session cell ended: what it printed goes now, then its value.
                            for chunk in chunks:
                                self._emit(stream, chunk)
                            work.synced(stream, marks)
                            continue
                for chunk in batcher.take(time.monotonic()):
                    self._emit(stream, chunk)
            rest = batcher.close()
            if rest:
                self._emit(stream, rest)

    def _emit(self, stream: Literal["o", "e"], text: str) -> None:
        text = cut_long_lines(text)
        # The last lines, kept to explain a rank that dies without a traceback.
        parts = text.rsplit("\n", TAIL_LINES + 1)
        parts.pop()  # after the last newline: unfinished
        for line in parts[-TAIL_LINES:]:
            self._tail.append(line.rstrip("\r").rsplit("\r", 1)[-1])
        if timeline.OUTPUT not in self.marks:
            self.mark(timeline.OUTPUT)
        self._send({"t": "out", "s": stream, "text": text})

    # -- teardown -------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the rank: SIGTERM to its process group, SIGKILL after a grace period."""
        with self._lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
            proc = self._proc
        if proc is None or proc.poll() is not None or _ended(self._rank_pid_now()):
            return
        self._stopped_alive = True
        # Remember the rank's descendants now: once SIGTERM ends the rank, those that left
        # its process group (setsid) can no longer be found through it.
        self._escapees = _descendants(proc.pid)
        self._kill_group(signal.SIGTERM)
        self._killer = after(TERM_GRACE_S, self._kill_group, signal.SIGKILL)

    def _kill_group(self, sig: int) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL:
            for child in [*self._escapees, *_descendants(proc.pid)]:
                try:
                    child.kill()
                except Exception:  # psutil.Error: already gone
                    pass


#: The variables torch's gloo and NCCL read to choose the interface they listen on.
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def socket_ifnames(world: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a rank: the interface of this host
    that routes to ``MASTER_ADDR``; those the user set (host environment, ``--env``) are kept.

    Without them gloo listens on the address this host's name resolves to, which on Debian
    and Ubuntu hosts is ``127.0.1.1`` (``/etc/hosts``): peers on other hosts are then told to
    connect to a loopback address and ``init_process_group`` times out.
    """
    wanted = [k for k in SOCKET_IFNAME_VARS if k not in os.environ and k not in env
              and k not in world]
    master = world.get("MASTER_ADDR")
    if not wanted or not master:
        return {}
    name = interface_to(master)
    return dict.fromkeys(wanted, name) if name else {}


def interface_to(address: str) -> str | None:
    """The name of this host's interface that packets to ``address`` leave from, if known.

    The interface holding the source address the kernel picks for it
    (``channel.source_address``), as psutil names it.
    """
    source = channel.source_address(address)
    try:
        import psutil
    except ImportError:
        return None
    if source is None:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == source for a in addrs):
            return str(name)
    return None
def _reserve_port() -> socket.socket | None:
    """A socket bound to a free port on all interfaces (``channel.free_port``), or None."""
    for _ in range(10):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("", channel.free_port()))
        except OSError:  # taken between free_port's check and this bind
            sock.close()
            continue
        return sock
    return None  # no TF_CONFIG for this job, which only TensorFlow's own jobs would miss


def _ended(pid: int | None) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped yet);
    False for None (not known yet)."""
    if pid is None:
        return False
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _descendants(pid: int) -> list[Any]:
    """The rank's descendants, also those that left its process group (``setsid``)."""
    try:
        import psutil

        return list(psutil.Process(pid).children(recursive=True))
    except Exception:  # psutil.Error: the rank is gone; ImportError: psutil is missing
        return []


def py_spy() -> str | None:
    """py-spy's executable, where it is installed: ``NBDIST_PY_SPY``, beside this Python (a
    virtual environment's ``bin``), or on ``PATH``; None when there is none."""
    named = os.environ.get("NBDIST_PY_SPY")
    if named:
        return named
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


#: Where nbdist is installed on this host: the driver leaves out the frames of the files under
#: it (``nbdist.stacks``), wherever that is, whatever the folder is called.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(protocol.__file__))


def native_stacks(pid: int, timeout: float = NATIVE_STACKS_S) -> str:
    """The rank's threads with their native (C) frames as ``py-spy dump --native`` reads them
    from outside (the rank is paused for the moment it takes), where py-spy is installed;
    "" where it is not; a line saying why when it could not (no permission to trace the
    process: ``ptrace_scope``, a container without ``CAP_SYS_PTRACE``)."""
    exe = py_spy()
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid), "--native"], capture_output=True,
                              text=True, timeout=timeout, check=False, errors="replace")
    except subprocess.TimeoutExpired:
        return f"(py-spy gave no native frames within {timeout:g} s)"
    except OSError as exc:
        return f"(py-spy could not run: {exc})"
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")
        return f"(py-spy could not read the native frames: {why.splitlines()[-1]})"
    # Its header (the process's command line and Python) says nothing the driver does not know.
    lines = done.stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Thread ")), 0)
    return "\n".join(lines[first:])


def python_stacks(pid: int, timeout: float = NATIVE_STACKS_S) -> str:
    """The rank's Python stacks read from outside by ``py-spy dump`` (no signal: the rank is
    paused for the moment it takes, and a system call it is in resumes), in ``faulthandler``'s
    text (``nbdist.stacks.parse`` reads it); "" without py-spy; a line in parentheses saying
    why it could not."""
    exe = py_spy()
    if exe is None:
        return ""
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=timeout, check=False, errors="replace")
    except subprocess.TimeoutExpired:
        return f"(py-spy gave no stacks within {timeout:g} s)"
    except OSError as exc:
        return f"(py-spy could not run: {exc})"
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")
        return f"(py-spy could not read the stacks: {why.splitlines()[-1]})"
    out: list[str] = []
    for line in done.stdout.splitlines():
        if line.startswith("Thread "):
            out.append(f"Thread 0x{len(out):016x} (py-spy, most recent call first):")
        elif (hit := _PY_SPY_FRAME.match(line)) is not None and out:
            out.append(f'  File "{hit["file"]}", line {hit["line"]} in {hit["func"]}')
    return "\n".join(out)


#: A frame of ``py-spy dump``: ``    func (file:line)``.
_PY_SPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>.+):(?P<line>\d+)\)$")


def _read_dump(f: Any, start: int, timeout: float) -> bytes:
    """What a stack dump adds to the file after ``start``: read until it stops growing.

    ``faulthandler`` writes a thread at a time, in its signal handler, with no end marker; a
    dump is over when nothing more came for ``STACKS_QUIET_S``.
    """
    deadline = time.monotonic() + timeout
    data = b""
    quiet_since = None
    while time.monotonic() < deadline:
        f.seek(start + len(data))
        more = f.read()
        now = time.monotonic()
        if more:
            data += more
            quiet_since = now
        elif data and quiet_since is not None and now - quiet_since >= STACKS_QUIET_S:
            break
        time.sleep(0.01)  # polling a file that a signal handler writes: nothing to wait on
    return data


def _grow_pipe(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer works too


def supervise(spec: RankSpec, gather: Gather | None = None) -> RankOutcome:
    """Run one rank to its end (what a Spark barrier task calls)."""
    return Supervisor(spec, gather=gather).run()

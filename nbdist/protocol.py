"""The typed contract between the notebook (driver) and its ranks.

Everything that crosses a process boundary is defined here once, and both sides import it: the
driver side (``job``, ``session``, ``events``, ``state``, ``views``) and the rank side
(``rank/``: the supervisor, the runtime, the event client). This module imports neither side;
it uses the standard library only, so a rank pays nothing to import it.

A rank's status moves forward only::

    pending ──► starting ──► running ──► done
                    │            │
                    └────────────┴─────► failed | cancelled

``pending``: the driver asked for the rank; ``starting``: its supervisor runs and is starting the
interpreter; ``running``: the interpreter runs the payload; then one final status.

The boundaries, and what crosses each (all defined below):

- notebook → rank, in the launch request (a pipe, or Spark's closure): a **payload**
  (``CellPayload``, ``ScriptPayload``, ``CallPayload``; a session's cells, pulls and pushes
  travel on the event channel as ``{"t": "cell"}`` with the same payloads inside);
- supervisor ↔ rank interpreter, on two pipes: length-prefixed **frames** (``write_frame``,
  ``read_frame``; the kinds are the ``Frame`` constants); the environment frame is ``EnvFrame``,
  an error ``ErrorRecord``;
- rank ↔ driver, on the event channel (``nbdist.events``): JSON **events**, each a ``t`` word
  and its fields (``HelloEvent``, ``OutEvent``, ``ProgressEvent``, ``MetricsEvent``,
  ``StateEvent``, ...; driver → rank: ``WorldEvent``, ``CellEvent``, ``cancel``, ``pace``,
  ``ping``). What arrives from the network is checked where it is read (``state.JobState.apply``
  ignores what does not fit), so the receiving side takes a plain mapping and the sending side
  builds these types;
- job → backend → supervisor: the **launch contract**, ``LaunchRequest`` (a Spark task gets its
  plain fields); backend → job: how each rank ended, ``RankOutcome`` (from a Spark task,
  through ``collect()``, as its plain fields).

Two sockets stay inside one module each, both of their ends in it, and are typed there: the
local zygote's (``rank/zygote.py``: ``WarmMsg``, ``ForkMsg``, ``ReadyMsg``, ``ForkedMsg``,
``ExitMsg``) and the Spark executor zygote's (``rank/executor_zygote.py``: ``ChallengeMsg``,
``HelloMsg``, ``ExecutorReadyMsg``, ``ExecutorForkMsg`` and the ``ExecutorConfig`` on its stdin).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import signal
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, BinaryIO, Literal, TypedDict, cast


class RankStatus(str, Enum):
    """Where a rank (or a whole job) is in its life; the values are the words on the wire."""

    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    # A status prints as its word (``f"{s}"`` == ``"done"``) on every Python nbdist supports.
    # It hashes as its word too (Python 3.10's Enum hashes the member's name), so a word read
    # off the wire finds the same entry in a set or dict as the member.
    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # str's, on purpose (above)
    __hash__ = str.__hash__

    @property
    def final(self) -> bool:
        """Whether nothing more happens to the rank."""
        return self in FINAL

    @property
    def order(self) -> int:
        """Position in the forward-only order; the three final statuses share the last."""
        return _ORDER[self]


FINAL = frozenset({RankStatus.DONE, RankStatus.FAILED, RankStatus.CANCELLED})
_ORDER = {
    RankStatus.PENDING: 0,
    RankStatus.STARTING: 1,
    RankStatus.RUNNING: 2,
    RankStatus.DONE: 3,
    RankStatus.FAILED: 3,
    RankStatus.CANCELLED: 3,
}

#: A running rank's supervisor says it is alive this often (its supervisor sends at this pace), even
#: when the rank itself is quiet; the driver pings session ranks at the same pace.
HEARTBEAT_S = 5.0
#: A starting or running rank not heard of for this long (three missed heartbeats) is *silent*:
#: its supervisor, its host or the network to the driver is stuck or gone.
SILENT_AFTER_S = 3 * HEARTBEAT_S
#: The signal on which a rank's interpreter writes the stacks of all its threads
#: (``faulthandler``, so also while it is stuck in C code: a collective, a lock); its name, as
#: the ``signal`` module knows it.
STACKS_SIGNAL = "SIGUSR2"


# -- frames: supervisor ↔ rank interpreter --------------------------------------------------------
_HEADER = struct.Struct(">IB")


class Frame:
    """The kinds of frame on the pipes between a supervisor and its rank's interpreter."""

    PAYLOAD = ord("P")  #: supervisor → rank: a pickled payload
    QUIT = ord("Q")  #: supervisor → rank: no more payloads
    ENV = ord("V")  #: supervisor → rank: JSON ``EnvFrame``, set before the next payload runs
    WARM = ord("W")  #: supervisor → rank: JSON list of modules to import while waiting
    INTERRUPT = ord("I")  #: supervisor → rank: the number of a session cell to interrupt
    EVENT = ord("E")  #: rank → supervisor: a JSON event
    #: rank → supervisor: the pickled value of a payload (a session's: empty, after its pieces)
    RESULT = ord("R")
    PIECE = ord("B")  #: rank → supervisor: a piece of a session cell's value (``nbdist.values``)
    ERROR = ord("X")  #: rank → supervisor: JSON ``ErrorRecord``
    DEBUG = ord("D")  #: supervisor → rank: a line typed in the notebook for its debugger
    #: supervisor → rank: write every thread's stack to the dump file now, from the thread that
    #: reads this pipe (no signal: ``%dist_stacks`` where ``STACKS_SIGNAL`` would hurt the rank)
    STACKS = ord("S")
    #: supervisor → rank: dump your flight recorder; rank → supervisor: the dump (torch's JSON,
    #: empty without one: ``rank/flight.py``)
    COLLECTIVES = ord("C")


def write_frame(f: BinaryIO, kind: int, body: bytes | memoryview, flush: bool = True) -> None:
    """Write one frame (length, kind, body) and flush it (unless told not to)."""
    f.write(_HEADER.pack(len(body), kind))
    f.write(body)
    if flush:
        f.flush()


def write_frame_parts(f: BinaryIO, kind: int, parts: list[bytes]) -> None:
    """Write one frame whose body is ``parts`` joined, without joining them (a large value
    is written where it lies), and flush it."""
    f.write(_HEADER.pack(sum(len(p) for p in parts), kind))
    for part in parts:
        f.write(part)
    f.flush()


def read_frame(f: BinaryIO) -> tuple[int, bytes] | None:
    """The next frame, or None at end of file."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    size, kind = _HEADER.unpack(head)
    body = f.read(size)
    if len(body) < size:
        return None
    return kind, body


class FrameWriter:
    """The rank's end of *control out*: frames written whole, from any thread."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        #: Held while a frame is written; also over a fork (``runtime``'s fork guard), so a
        #: child never inherits half a frame.
        self.lock = threading.Lock()
        self._held = False

    def send(self, kind: int, body: bytes | memoryview) -> None:
        with self.lock:
            write_frame(self._f, kind, body, flush=not self._held)

    def hold(self) -> None:
        """Keep the frames sent from now on (from any thread) until :meth:`release`, which
        writes them together: a session cell's end is several frames, and each write wakes
        the supervisor's reader (a thread of the kernel, for local ranks). A large frame still
        goes at once (the buffer's size), after those held before it."""
        with self.lock:
            self._held = True

    def release(self) -> None:
        """Write the frames held since :meth:`hold`, and write each at once again."""
        with self.lock:
            self._held = False
            self._f.flush()

    def flush_held(self) -> None:
        """Write what is held, with ``lock`` taken (before a fork: a child that inherited the
        frames in the buffer would send them a second time).

        Never raises: where the pipe is broken (the supervisor is gone) nobody can read what
        was held, so it is dropped, and so is what is sent from then on (the rank ends once it
        sees its control pipe close). A fork hook that raised would leave locks held."""
        try:
            self._f.flush()
        except (OSError, ValueError):  # ValueError: closed
            broken, self._f = self._f, cast(BinaryIO, open(os.devnull, "wb"))
            raw = getattr(broken, "raw", None)
            try:  # the raw file: a buffered one's close would try to write what it holds
                (raw if raw is not None else broken).close()
            except (OSError, ValueError):
                pass

    def forget_hold(self) -> None:
        """In a forked child: write each frame at once (nobody will ``release`` it here)."""
        self._held = False

    def event(self, event: RankEvent) -> None:
        """Send a JSON event (``Frame.EVENT``)."""
        self.send(Frame.EVENT, json.dumps(event, default=str).encode())


class EnvFrame(TypedDict, total=False):
    """The rank's environment and working directory (``Frame.ENV``)."""

    env: dict[str, str]
    cwd: str
    unset: list[str]  # variables the rank must not have (``RankSpec.volatile``)


class ErrorRecord(TypedDict):
    """How a rank's exception travels: its type name, message and the user's traceback
    (without nbdist's frames); ``Frame.ERROR``, a ``cell_error`` event, a Spark task's fields."""

    type: str
    message: str
    traceback: str


# -- the launch contract: what a backend is asked, and what it answers per rank --------------------
@dataclass(frozen=True)
class LaunchRequest:
    """One job's ranks as the job asks for them; the backend fills in the per-rank parts
    (``rank.supervisor.RankSpec.for_rank``, the one mapping every backend uses). A Spark task
    gets it as plain fields (:meth:`fields`), since its closure must unpickle where nbdist is
    missing, and rebuilds it once its nbdist is known to be the notebook's."""

    job_id: str
    np: int
    secret: str
    driver: tuple[str, int]
    payload: bytes
    gpu: bool
    env: dict[str, str] = field(default_factory=dict)
    run_id: str = ""  # TORCHELASTIC_RUN_ID, for ranks that plan their world without the driver
    #: What the rendezvous adds to every rank's environment (a restart's count, its
    #: checkpoint directory), for ranks that plan their world without the driver. Not part
    #: of ``env``, which keys the local backend's warm ranks (a remote backend's ``env`` has
    #: them too).
    world_env: dict[str, str] = field(default_factory=dict)
    modules: tuple[str, ...] = ()  # what the payload imports, known before it runs (warm-up)
    session: bool = False  # ranks of a persistent session: cells arrive over the channel
    #: Seconds without a word from the driver after which a rank stops (None: never).
    heartbeat_timeout: float | None = None

    def fields(self) -> dict[str, Any]:
        """The request as plain values (builtins only), for a closure that pickles by value."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class RankOutcome:
    """How one rank ended. ``status`` is ``done``, ``failed`` or ``cancelled``.

    A Spark barrier task returns it to the driver as plain fields through ``collect()``
    (:meth:`fields`, :meth:`from_fields`): the status as its word, so that a row still
    unpickles where the executors cannot import nbdist."""

    rank: int
    status: RankStatus
    result: bytes | None = None
    error: ErrorRecord | None = None
    exit_code: int | None = None
    pid: int | None = None
    tail: list[str] = field(default_factory=list)
    dropped_events: int = 0  # progress, metrics and other events that never reached the driver
    result_type: str | None = None  # "module.Class" of the result, known even if unpicklable
    lost_lines: int = 0  # lines of output that never reached the driver
    channel_error: str | None = None  # why the event server could not be reached, if so
    #: Set by a backend whose host for this rank went away under it (a Spark executor lost):
    #: that host, so the driver can name every rank that was on it.
    lost_host: str | None = None
    #: The most resident memory the rank's processes held (bytes), as its supervisor saw it.
    peak_rss: int | None = None
    #: Evidence that the kernel's out-of-memory killer killed the rank (``rank.death``).
    oom: str | None = None
    #: When the rank ended (``time.time()`` on its host): a job's rank, when its code ended,
    #: as the rank stamped it before it sent its value or exception (``timeline.END``); a
    #: session's rank, or one that sent nothing, when its supervisor saw its process exit.
    #: Tells which of two failures came first when the driver heard neither (``nbdist.blame``).
    ended: float | None = None

    def fields(self) -> dict[str, Any]:
        """The outcome as plain values: every field, the status as its word."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["status"] = RankStatus(self.status).value
        return fields

    @classmethod
    def from_fields(cls, rank: int, fields: Mapping[str, Any]) -> RankOutcome:
        """The outcome of ``rank`` from a task's fields: fields this nbdist does not know (an
        executor with another nbdist) are dropped, a missing status is ``failed``; the rank is
        the caller's (the task's partition), whatever the fields say."""
        known = {f.name for f in dataclasses.fields(cls)}
        kept: dict[str, Any] = {k: v for k, v in fields.items() if k in known and k != "rank"}
        kept["status"] = RankStatus(kept.get("status", RankStatus.FAILED))
        return cls(rank, **kept)

    def how(self) -> str:
        """How a rank that did not deliver ended, in a few words: ``killed by the kernel's
        out-of-memory killer, peak RSS 21.7 GB``, ``killed by SIGSEGV``, ``exited with code
        3``, or the exception's type and message."""
        peak = f", peak RSS {size_text(self.peak_rss)}" if self.peak_rss else ""
        if self.error is not None:
            return f"{self.error.get('type')}: {self.error.get('message')}"
        code = self.exit_code
        if self.oom is not None:
            return f"killed by the kernel's out-of-memory killer{peak}"
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}{peak}"
        if self.status == RankStatus.CANCELLED:
            return "stopped by nbdist"
        return f"exited with code {code} before returning a result"

    def describe(self) -> str:
        """The failure as text: the remote traceback, or the exit status and last output."""
        if self.error is not None:
            text = self.error.get("traceback") or ""
            if not text.strip():
                text = f"{self.error.get('type')}: {self.error.get('message')}\n"
            return text
        words = self.how()
        how = f"rank {self.rank} {'' if words.startswith('exited') else 'was '}{words}"
        if self.oom is not None:
            how += f" ({self.oom})"
        lines = "".join(f"    {line}\n" for line in self.tail)
        return f"{how}\n" + (f"its last output:\n{lines}" if lines else "it printed nothing\n")


def size_text(n: float) -> str:
    """Bytes in words: ``812 MB``, ``1.2 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


# -- payloads: what a rank runs -------------------------------------------------------------------
@dataclass(frozen=True)
class CarriedHandler:
    """A root handler of the notebook that writes to ``stream``, with its level and format."""

    stream: Literal["stdout", "stderr"]
    level: int
    fmt: str | None
    datefmt: str | None
    style: Literal["%", "{", "$"] = "%"


@dataclass(frozen=True)
class CarriedLogging:
    """The notebook's root logging configuration, as it travels in a cell's payload
    (``nbdist._logcarry``)."""

    level: int
    handlers: tuple[CarriedHandler, ...]


@dataclass(frozen=True)
class ShippedCode:
    """The notebook's own modules, by value (``nbdist.capture``): modules and packages found
    through the notebook's directory or a ``sys.path`` entry that is not installed, which the
    ranks' hosts may not have. The rank writes ``files`` under a directory named by ``digest``
    and puts it first on its ``sys.path`` (``nbdist.rank.localcode``), so they import under
    their own names there, in the rank's children too."""

    digest: str  # sha256 of the files, paths and contents: the directory's name on the rank
    files: tuple[tuple[str, bytes], ...]  # (path relative to that directory, with "/", content)
    modules: tuple[tuple[str, int, int], ...]  # (top-level name, files, bytes), for show-source

    @property
    def size(self) -> int:
        """Bytes of all the files."""
        return sum(len(data) for _, data in self.files)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Through a function of its own, which the rank's payload loader replaces with one that
        # also installs the files, as the payload is read: a ``CallPayload`` holds ``code``
        # before ``fn``, so a function of a shipped module unpickles after its module exists.
        return shipped_code, (self.digest, self.files, self.modules)


def code_digest(files: Iterable[tuple[str, bytes]]) -> str:
    """``ShippedCode.digest`` of these files: sha256 of their paths and contents."""
    digest = hashlib.sha256()
    for rel, data in sorted(files):
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()[:32]


def shipped_code(digest: str, files: tuple[tuple[str, bytes], ...],
                 modules: tuple[tuple[str, int, int], ...]) -> ShippedCode:
    """A ``ShippedCode`` as unpickled anywhere but on a rank (see ``ShippedCode.__reduce__``)."""
    return ShippedCode(digest, files, modules)


class SessionKeys(TypedDict, total=False):
    """What a session adds to each payload it sends its ranks."""

    session: bool  # run in the session's namespace, which lives as long as the interpreter
    keep: bool
    cell: int  # the session cell's number


class _Cell(SessionKeys):
    kind: Literal["cell"]
    source: str
    filename: str


class CellPayload(_Cell, total=False):
    """A notebook cell (``nbdist.capture``): its source, the imports to replay and the values
    it reads, pickled in ``data`` in the order of ``value_names``."""

    line_offset: int  # lines above the cell body (the %%distributed line)
    flags: int  # compiler flags of the notebook's ``__future__`` features
    imports: list[tuple[str, str, str | None]]  # (name, module, attribute)
    submodules: list[str]
    data: bytes
    value_names: list[str]
    returns_last: bool
    logging: CarriedLogging | None
    code: ShippedCode | None  # the notebook's own modules, by value


class _Script(SessionKeys):
    kind: Literal["script"]
    path: str


class ScriptPayload(_Script, total=False):
    """``%distributed train.py ARGS``: a script file run as ``__main__``."""

    argv: list[str]


class _Call(SessionKeys):
    kind: Literal["call"]
    fn: Any  # a callable, pickled by value (cloudpickle)


class CallPayload(_Call, total=False):
    """``nbdist.run(fn, *args, **kwargs)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    code: ShippedCode | None  # the caller's own modules, by value


class PullPayload(SessionKeys):
    """``%dist_pull NAME --rank R``: a session variable's value from one rank (``rank`` -1:
    from every rank, ``%dist_gather NAME``)."""

    kind: Literal["pull"]
    name: str
    rank: int


@dataclass
class Pulled:
    """What ``%dist_pull`` brings back from the rank asked: the value, and the names of the
    threads that the session's cells started and that were running on that rank while it was
    read (a value they change may come back torn: ``errors.PullWarning``)."""

    value: Any
    threads: list[str]


class PushPayload(SessionKeys):
    """``%dist_push NAME``: set a session variable on every rank to the notebook's value
    (``%dist_scatter NAME``: each rank's ``data`` is its own slice).

    A large ``data`` travels after the pickle of the other keys, in the same frame, rather
    than inside it (``session.run_cell``: the driver pickles the value once); the rank's
    loader (``runtime._load_payload``) puts it back."""

    kind: Literal["push"]
    name: str
    data: bytes


# The namespace loader: how a cell's values find the namespace they run in.
def cell_namespace() -> dict[str, Any]:
    """The notebook's namespace, as the globals of notebook functions shipped by value.

    Capture pickles a reference to this function in its place; the loader of a cell's values
    (``load_values``) maps it to the namespace the cell runs in, so those functions see what
    the cell assigns, as in the notebook. Unpickled any other way, each gets a fresh one.
    """
    return {}


def load_values(data: bytes, names: list[str], ns: dict[str, Any]) -> None:
    """Unpickle a cell's values into ``ns``: one stream with one memo, one object per name."""
    class _Loader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("nbdist.protocol", "cell_namespace"):
                return lambda: ns
            return super().find_class(module, name)

    loader = _Loader(io.BytesIO(data))
    for name in names:
        ns[name] = loader.load()


Payload = CellPayload | ScriptPayload | CallPayload | PullPayload | PushPayload


# -- events: rank ↔ driver, on the event channel --------------------------------------------------
class HelloEvent(TypedDict, total=False):
    """A supervisor's hello: where and what it runs on, and ports it holds for the rank."""

    host: str
    pid: int
    cpus: int
    gpus: list[int | str]
    tf_port: int  # held for the rank's TensorFlow worker (``TF_CONFIG``)
    port: int  # rank 0: a free port for ``MASTER_PORT``
    jax_port: int  # rank 0: held for JAX's coordinator (``NBDIST_JAX_COORDINATOR``)
    executor: str  # Spark: the executor's id
    rank: int  # in the backend's own rendezvous (``rank.Gather``), where no connection says it


class OutEvent(TypedDict):
    """Rank output: a batch of lines of one stream (``o`` stdout, ``e`` stderr); a line ends
    with ``\n``, ``\r`` (a redraw) or not at all (flushed before its end)."""

    t: Literal["out"]
    s: Literal["o", "e"]
    text: str


class ProgressEvent(TypedDict, total=False):
    """A progress bar's latest state (``nbdist.progress``, tqdm)."""

    t: Literal["progress"]
    id: int
    n: int
    total: int | None
    desc: str | None
    rate: float | None
    elapsed: float
    step: int  # n counted on across the bar's resets
    postfix: dict[str, Any]  # tqdm's set_postfix: metrics at step n


class MetricsEvent(TypedDict, total=False):
    """``nbdist.report(**values)``."""

    t: Literal["metrics"]
    values: dict[str, Any]
    step: int | None


class StateEvent(TypedDict, total=False):
    """A rank's status moved (``RankStatus`` words; ``ready``: its interpreter is up)."""

    t: Literal["state"]
    state: str
    pid: int
    host: str
    exit: int | None
    at: float  # ``ready``: when (``time.time()``)
    #: ``starting``: how the rank's interpreter was obtained (``forked`` from a zygote,
    #: ``warm``, ``fresh``) and why it was not forked, in words ("" when it was).
    start: str
    why: str
    stacks: str  # ``ready``: the file its stack dumps go to (``STACKS_SIGNAL``)


class MarksEvent(TypedDict):
    """Moments of a rank's launch (``nbdist.timeline``), by name."""

    t: Literal["marks"]
    at: dict[str, float]


class HeartbeatEvent(TypedDict, total=False):
    """A supervisor is alive (every ``HEARTBEAT_S``). The rank's memory comes with its
    resources samples (``ResourcesEvent``), taken more often."""

    t: Literal["hb"]


class GpuSample(TypedDict, total=False):
    """One GPU's use, in a ``ResourcesEvent``."""

    id: str
    util: int  # percent
    mem: int  # bytes used
    total: int  # bytes


class ResourcesEvent(TypedDict, total=False):
    """What a rank's process tree uses (``nbdist.resources``)."""

    t: Literal["res"]
    rss: int
    peak: int  # the most resident memory so far (the rank's high-water mark, or a sample's)
    cpu: float  # percent of one core since the last sample
    gpus: list[GpuSample]


class CellValueEvent(TypedDict):
    """A session cell's value follows in pieces of these ``sizes`` (``nbdist.values``)."""

    t: Literal["cell_value"]
    cell: int | None
    sizes: list[int]
    type: str | None
    bytes: list[int]  # which sizes' segments are ``bytes`` objects (``values.bytes_segments``)


class CellDataEvent(TypedDict):
    """A piece of a session cell's value (a binary block on the channel)."""

    t: Literal["cell_data"]
    cell: int | None
    data: bytes


class CellErrorEvent(TypedDict):
    """A session cell failed on this rank."""

    t: Literal["cell_error"]
    cell: int | None
    error: ErrorRecord
    rss: int | None


class CellResultEvent(TypedDict):
    """A session cell's value is complete: its signature (HMAC of the pieces)."""

    t: Literal["cell_result"]
    cell: int | None
    type: str | None
    mac: str
    rss: int | None


class WarmEvent(TypedDict):
    """Interpreter → supervisor: the modules to warm up are imported."""

    t: Literal["warm"]


class _RankMemory(TypedDict, total=False):
    rss: int


class NamesEvent(_RankMemory):
    """``modules``: what the payload imported (the next warm interpreter imports them);
    ``names``: the session namespace's names after a cell, with the rank's own resident
    memory then (``rss``, where it could read it), to which its supervisor adds its children's
    (a read of ``/proc`` in the rank, not one more in the kernel at every cell's end)."""

    t: Literal["modules", "names"]
    names: list[str]


class StacksEvent(TypedDict, total=False):
    """Supervisor → driver: the answer to a ``stacks`` request ``id``: the rank's threads as
    ``faulthandler`` writes them (``text``), or why there are none (``error``); with their
    native (C) frames where py-spy is installed on the rank's host (``native``); its flight
    recorder's dump (torch's JSON, ``fr``) where it ran collectives; the folder nbdist is
    installed in there (``package``: its frames are left out)."""

    t: Literal["stacks"]
    id: int
    text: str
    error: str
    native: str
    fr: str
    package: str


class DebugEvent(TypedDict):
    """A rank's debugger (``breakpoint()``) asks for a line: what it wrote since the last
    question (its prompt last). Driver → rank, the same shape: the line typed."""

    t: Literal["debug"]
    text: str


class ResultEvent(TypedDict, total=False):
    """Interpreter → supervisor: a payload's value follows (its type; a session's: the sizes
    of its pieces)."""

    t: Literal["result"]
    type: str
    sizes: list[int]
    bytes: list[int]  # which of the sizes are ``bytes`` objects (``values.bytes_segments``)


#: The most a rank's one display may weigh, its mime bundle as sent (base64 for images): an
#: event travels as one line of the event channel (``events.MAX_LINE_BYTES``, 16 MiB) and
#: reaches the notebook as one IOPub message. A bigger representation is left out, and the
#: display says so (``DisplayEvent.note``).
MAX_DISPLAY_BYTES = 8_000_000


class DisplayEvent(TypedDict, total=False):
    """Rich output of a rank (``display(obj)``, a matplotlib figure): a Jupyter mime bundle
    (``data``: mime type → str, base64 for binary types, or JSON for ``application/json``;
    ``metadata`` likewise), as the kernel would publish it. ``size``: the bundle's bytes as
    sent; ``note``: what was left out to stay within ``MAX_DISPLAY_BYTES``, in words."""

    t: Literal["display"]
    data: dict[str, Any]
    metadata: dict[str, Any]
    size: int
    note: str


#: Everything a rank sends: its interpreter to its supervisor (``Frame.EVENT``), and its
#: supervisor to the driver (the event channel).
RankEvent = (OutEvent | ProgressEvent | MetricsEvent | StateEvent | MarksEvent | HeartbeatEvent
             | ResourcesEvent | CellValueEvent | CellDataEvent | CellErrorEvent
             | CellResultEvent | WarmEvent | NamesEvent | ResultEvent | HelloEvent | StacksEvent
             | DebugEvent | DisplayEvent)


class WorldEvent(TypedDict):
    """Driver → rank, after every hello: the rank's environment (``nbdist.world``)."""

    t: Literal["world"]
    env: dict[str, str]


class _Cell0(TypedDict):
    t: Literal["cell"]
    id: int
    payload: str


class CellEvent(_Cell0, total=False):
    """Driver → session rank: run a payload (pickled, base64 text) as cell ``id``.

    A large payload (a push, a scatter's slice: ``session.run_cell``) is never one message:
    on the channel it comes first as ``chunks`` ``CellPartEvent`` pieces (``payload`` then
    empty), which the supervisor joins; handed to a local supervisor as a call
    (``Launcher.deliver``) it is ``frame``, the payload frame's parts as they are (no copy, no
    base64; never on the wire)."""

    chunks: int
    frame: list[bytes]


class CellPartEvent(TypedDict):
    """Driver → session rank: the next piece (base64) of cell ``id``'s payload."""

    t: Literal["cell_part"]
    id: int
    data: str


class CancelEvent(TypedDict):
    """Driver → rank: stop (the job was cancelled, failed elsewhere or timed out)."""

    t: Literal["cancel"]
    reason: str


class InterruptEvent(TypedDict):
    """Driver → session rank: KeyboardInterrupt in cell ``id``."""

    t: Literal["interrupt"]
    id: int


class PingEvent(TypedDict):
    """Driver → rank: the keepalive (``quit``: a session's end, the same shape)."""

    t: Literal["ping", "quit"]


class StacksRequest(TypedDict):
    """Driver → rank: send the stacks of the rank's threads, as request ``id``."""

    t: Literal["stacks"]
    id: int


class PaceEvent(TypedDict):
    """Event server → rank: write at most every ``every`` seconds."""

    t: Literal["pace"]
    every: float


#: Everything the driver sends a rank on the event channel.
DriverEvent = (WorldEvent | CellEvent | CellPartEvent | CancelEvent | InterruptEvent | PingEvent
               | PaceEvent | StacksRequest | DebugEvent)

"""The typed contract between the notebook (driver) and its ranks.

Everything that crosses a process boundary is defined here once, and both sides import it: the
driver side (``job``, ``session``, ``events``' server, ``state``, ``views``) and the rank side
(``rank``, ``runtime``, ``events``' client). This module imports neither side; it uses the
standard library only, so a rank pays nothing to import it.

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
- Spark task → driver, through ``collect()``: how the rank ended, as ``OutcomeFields``.

Two sockets stay inside one module each, both of their ends in it, and are typed there: the
local zygote's (``launch/zygote.py``: ``WarmMsg``, ``ForkMsg``, ``ReadyMsg``, ``ForkedMsg``,
``ExitMsg``) and the Spark executor zygote's (``launch/executor_zygote.py``: ``ChallengeMsg``,
``HelloMsg``, ``ExecutorReadyMsg``, ``ExecutorForkMsg`` and the ``ExecutorConfig`` on its stdin).
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, BinaryIO, Literal, TypedDict


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


def write_frame(f: BinaryIO, kind: int, body: bytes | memoryview) -> None:
    """Write one frame (length, kind, body) and flush it."""
    f.write(_HEADER.pack(len(body), kind))
    f.write(body)
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

    def send(self, kind: int, body: bytes | memoryview) -> None:
        with self.lock:
            write_frame(self._f, kind, body)

    def event(self, event: RankEvent) -> None:
        """Send a JSON event (``Frame.EVENT``)."""
        self.send(Frame.EVENT, json.dumps(event, default=str).encode())


class EnvFrame(TypedDict, total=False):
    """The rank's environment and working directory (``Frame.ENV``)."""

    env: dict[str, str]
    cwd: str


class ErrorRecord(TypedDict):
    """How a rank's exception travels: its type name, message and the user's traceback
    (without nbdist's frames); ``Frame.ERROR``, a ``cell_error`` event, a Spark task's fields."""

    type: str
    message: str
    traceback: str


class OutcomeFields(TypedDict, total=False):
    """How a rank ended, as its Spark barrier task returns it to the driver (pickled, through
    ``collect()``): the fields of ``rank.RankOutcome`` (``dataclasses.asdict``), or only
    ``status`` and ``error`` when the task could not run its rank. The driver drops the fields
    it does not know (an executor with another nbdist; ``launch/spark.py``'s ``_outcome``)."""

    rank: int
    status: str  # a RankStatus; its word where the executors cannot import nbdist
    result: bytes | None
    error: ErrorRecord | None
    exit_code: int | None
    pid: int | None
    tail: list[str]
    dropped_events: int
    result_type: str | None
    lost_lines: int
    channel_error: str | None
    lost_host: str | None


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


class PullPayload(SessionKeys):
    """``%dist_pull NAME --rank R``: a session variable's value from one rank (``rank`` -1:
    from every rank, ``%dist_gather NAME``)."""

    kind: Literal["pull"]
    name: str
    rank: int


class PushPayload(SessionKeys):
    """``%dist_push NAME``: set a session variable on every rank to the notebook's value
    (``%dist_scatter NAME``: each rank's ``data`` is its own slice)."""

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
    cpu: float  # percent of one core since the last sample
    gpus: list[GpuSample]


class CellValueEvent(TypedDict):
    """A session cell's value follows in pieces of these ``sizes`` (``nbdist.values``)."""

    t: Literal["cell_value"]
    cell: int | None
    sizes: list[int]
    type: str | None


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


class NamesEvent(TypedDict):
    """``modules``: what the payload imported (the next warm interpreter imports them);
    ``names``: the session namespace's names after a cell."""

    t: Literal["modules", "names"]
    names: list[str]


class ResultEvent(TypedDict, total=False):
    """Interpreter → supervisor: a payload's value follows (its type; a session's: the sizes
    of its pieces)."""

    t: Literal["result"]
    type: str
    sizes: list[int]


#: Everything a rank sends: its interpreter to its supervisor (``Frame.EVENT``), and its
#: supervisor to the driver (the event channel).
RankEvent = (OutEvent | ProgressEvent | MetricsEvent | StateEvent | MarksEvent | HeartbeatEvent
             | ResourcesEvent | CellValueEvent | CellDataEvent | CellErrorEvent
             | CellResultEvent | WarmEvent | NamesEvent | ResultEvent | HelloEvent)


class WorldEvent(TypedDict):
    """Driver → rank, after every hello: the rank's environment (``nbdist.world``)."""

    t: Literal["world"]
    env: dict[str, str]


class CellEvent(TypedDict):
    """Driver → session rank: run a payload (pickled, base64 text) as cell ``id``."""

    t: Literal["cell"]
    id: int
    payload: str


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


class PaceEvent(TypedDict):
    """Event server → rank: write at most every ``every`` seconds."""

    t: Literal["pace"]
    every: float


#: Everything the driver sends a rank on the event channel.
DriverEvent = WorldEvent | CellEvent | CancelEvent | InterruptEvent | PingEvent | PaceEvent

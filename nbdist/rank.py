"""The rank supervisor: runs on a rank's host, whichever backend started it.

It says hello to the driver's event server, learns the rank's environment from the driver
(the rendezvous), starts the rank's interpreter (``runtime.py``) in a new process group, pumps
its stdout/stderr at the file-descriptor level and its structured events to the driver, and
returns how the rank ended. It kills the rank's whole process group when cancelled, when the
driver asks, and after the rank exits (so nothing the rank started lingers).

Imports only the standard library and psutil: it runs inside Spark's Python workers too.
"""

from __future__ import annotations

import codecs
import collections
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nbdist import events, runtime

#: Output lines longer than this are cut (the rest is counted, not sent).
MAX_LINE_CHARS = 16 * 1024
#: A partial line is sent after this long without a newline, so prompts and dots show up live.
PARTIAL_AFTER_S = 0.2
#: Time between SIGTERM and SIGKILL when a rank is torn down.
TERM_GRACE_S = 2.0
#: Lines of output kept to explain a rank that died without a traceback.
TAIL_LINES = 20


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


@dataclass
class RankOutcome:
    """How one rank ended. ``status`` is ``done``, ``failed`` or ``cancelled``."""

    rank: int
    status: str
    result: bytes | None = None
    error: dict[str, str] | None = None
    exit_code: int | None = None
    pid: int | None = None
    tail: list[str] = field(default_factory=list)
    dropped_events: int = 0

    def describe(self) -> str:
        """The failure as text: the remote traceback, or the exit status and last output."""
        if self.error is not None:
            text = self.error.get("traceback") or ""
            if not text.strip():
                text = f"{self.error.get('type')}: {self.error.get('message')}\n"
            return text
        code = self.exit_code
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"rank {self.rank} was killed by {name}"
        elif self.status == "cancelled":
            how = f"rank {self.rank} was stopped by nbdist"
        else:
            how = f"rank {self.rank} exited with code {code} before returning a result"
        lines = "".join(f"    {line}\n" for line in self.tail)
        return f"{how}\n" + (f"its last output:\n{lines}" if lines else "it printed nothing\n")


class Supervisor:
    """Supervises one rank: ``run()`` blocks until the rank is over; ``cancel()`` works anywhere."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self._client: events.EventClient | None = None
        self._world = threading.Event()
        self._world_env: dict[str, str] = {}
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._result: bytes | None = None
        self._error: dict[str, str] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    # -- driver messages -----------------------------------------------------------------------
    def _on_message(self, msg: events.Event) -> None:
        if msg.get("t") == "world":
            self._world_env = {str(k): str(v) for k, v in msg.get("env", {}).items()}
            self._world.set()
        elif msg.get("t") == "cancel":
            self.cancel()

    def _send(self, **event: Any) -> None:
        if self._client is not None:
            self._client.send(event)

    # -- life -----------------------------------------------------------------------------------
    def run(self) -> RankOutcome:
        spec = self.spec
        try:
            self._connect()
        except OSError as exc:
            return RankOutcome(spec.rank, "failed", error={
                "type": "ConnectionError", "traceback": "",
                "message": f"rank {spec.rank} on {spec.host} cannot reach the driver's event "
                f"server at {spec.driver[0]}:{spec.driver[1]}: {exc}",
            })
        try:
            return self._run_rank()
        finally:
            self._kill_group(signal.SIGKILL)
            if self._client is not None:
                self._client.close()

    def _connect(self) -> None:
        spec = self.spec
        hello: dict[str, Any] = {
            "host": spec.host, "pid": os.getpid(), "cpus": os.cpu_count() or 1,
            "gpus": list(spec.gpus),
        }
        if spec.rank == 0:
            hello["port"] = events.free_port()
        self._client = events.EventClient(
            spec.driver, spec.job_id, spec.rank, spec.secret, hello, self._on_message
        )

    def _wait_world(self) -> bool:
        deadline = time.monotonic() + self.spec.rendezvous_timeout
        while not self._world.wait(0.1):
            client = self._client
            if self._cancelled.is_set() or client is None or not client.alive:
                return False
            if time.monotonic() > deadline:
                return False
        return not self._cancelled.is_set()

    def _run_rank(self) -> RankOutcome:
        spec = self.spec
        if not self._wait_world():
            status = "cancelled" if self._cancelled.is_set() else "failed"
            return RankOutcome(spec.rank, status, error=None if status == "cancelled" else {
                "type": "TimeoutError", "traceback": "",
                "message": f"rank {spec.rank} got no rendezvous from the driver",
            })
        proc = self._spawn()
        if proc is None:
            return RankOutcome(spec.rank, "cancelled")
        self._send(t="state", state="starting", pid=proc.pid, host=spec.host)
        pumps = [
            threading.Thread(target=self._pump, args=(proc.stdout, "o"), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, "e"), daemon=True),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        # Whatever the rank left in its group (servers, data loader workers) goes with it; this
        # also closes the pipes those processes inherited, so the pumps reach end of file.
        self._kill_group(signal.SIGKILL)
        for t in pumps:
            t.join(timeout=5)
        self._ctl_thread.join(timeout=5)
        outcome = RankOutcome(
            spec.rank, "failed", result=self._result, error=self._error, exit_code=code,
            pid=proc.pid, tail=list(self._tail),
        )
        if self._result is not None:
            # The value was delivered and output flushed: a crash after that (torch's teardown
            # abort) does not make the rank a failure.
            outcome.status = "done"
        elif self._cancelled.is_set() and self._error is None:
            outcome.status = "cancelled"
        client = self._client
        outcome.dropped_events = client.dropped if client is not None else 0
        self._send(t="state", state=outcome.status, exit=code)
        return outcome

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        spec = self.spec
        ctl_in_r, ctl_in_w = os.pipe()
        ctl_out_r, ctl_out_w = os.pipe()
        env = dict(os.environ)
        env.update(spec.env)
        world = dict(self._world_env)
        if "OMP_NUM_THREADS" in env:
            world.pop("OMP_NUM_THREADS", None)  # the user's setting wins
        env.update(world)
        env["NBDIST_CTL_IN"], env["NBDIST_CTL_OUT"] = str(ctl_in_r), str(ctl_out_w)
        env.setdefault("PYTHONIOENCODING", "utf-8")
        with self._lock:
            if self._cancelled.is_set():
                for fd in (ctl_in_r, ctl_in_w, ctl_out_r, ctl_out_w):
                    os.close(fd)
                return None
            try:
                proc = subprocess.Popen(
                    [spec.python, "-c", "from nbdist.runtime import main; main()"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    pass_fds=(ctl_in_r, ctl_out_w), start_new_session=True,
                    env=env, cwd=spec.cwd,
                )
            finally:
                os.close(ctl_in_r)
                os.close(ctl_out_w)
            self._proc = proc
        self._ctl_in = os.fdopen(ctl_in_w, "wb")
        runtime.write_frame(self._ctl_in, runtime.PAYLOAD, spec.payload)
        runtime.write_frame(self._ctl_in, runtime.QUIT, b"")
        # control-in stays open: its end of file tells the rank that we are gone.
        self._ctl_thread = threading.Thread(
            target=self._read_control, args=(os.fdopen(ctl_out_r, "rb"),), daemon=True
        )
        self._ctl_thread.start()
        return proc

    def _read_control(self, f: Any) -> None:
        with f:
            while (frame := runtime.read_frame(f)) is not None:
                kind, body = frame
                if kind == runtime.EVENT:
                    try:
                        self._send(**json.loads(body))
                    except ValueError:
                        pass
                elif kind == runtime.RESULT:
                    self._result = body
                elif kind == runtime.ERROR:
                    self._error = json.loads(body)

    def _pump(self, pipe: Any, stream: str) -> None:
        """Forward one output pipe line by line; ``\\r`` ends a segment as ``\\n`` does."""
        fd = pipe.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        partial = ""
        with pipe:
            while True:
                ready, _, _ = select.select([fd], [], [], PARTIAL_AFTER_S if partial else None)
                if not ready:  # a partial line has waited long enough: send it as it is
                    self._emit(stream, [[partial, ""]])
                    partial = ""
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                segs, partial = _split(partial + decoder.decode(data))
                if len(partial) >= MAX_LINE_CHARS:
                    segs.append([partial, ""])
                    partial = ""
                if segs:
                    self._emit(stream, segs)
            rest = partial + decoder.decode(b"", final=True)
            if rest:
                self._emit(stream, [[rest, ""]])

    def _emit(self, stream: str, segs: list[list[str]]) -> None:
        for text, end in segs:
            if end == "\n":
                self._tail.append(text)
        self._send(t="out", s=stream, seg=segs)

    # -- teardown -------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the rank: SIGTERM to its process group, SIGKILL after a grace period."""
        with self._lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._kill_group(signal.SIGTERM)
        killer = threading.Timer(TERM_GRACE_S, self._kill_group, args=(signal.SIGKILL,))
        killer.daemon = True
        killer.start()

    def _kill_group(self, sig: int) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL:
            _kill_escapees(proc.pid)


def _kill_escapees(pid: int) -> None:
    """Kill descendants of the rank that left its process group (``setsid``, daemons)."""
    try:
        import psutil
    except ImportError:
        return
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


_NEWLINE = re.compile(r"(\r\n|\r|\n)")


def _split(text: str) -> tuple[list[list[str]], str]:
    """Split into ``[text, end]`` segments at ``\\n`` and ``\\r``; return the unfinished rest."""
    parts = _NEWLINE.split(text)
    segs = [
        [_cut(line), "\r" if sep == "\r" else "\n"]
        for line, sep in zip(parts[0:-1:2], parts[1::2], strict=True)
    ]
    return segs, parts[-1]


def _cut(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    return line[:MAX_LINE_CHARS] + f" [... {len(line) - MAX_LINE_CHARS} characters cut]"


def supervise(spec: RankSpec) -> RankOutcome:
    """Run one rank to its end (what a Spark barrier task calls)."""
    return Supervisor(spec).run()

"""The rank runtime: the fresh interpreter in which a rank's code runs.

The supervisor (``rank.py``) starts ``python -c "from nbdist.runtime import main; main()"`` in a
new process group with two pipes besides stdout and stderr:

- *control in* (supervisor → rank): payload frames, one after another (a warm rank can take
  several); end of file means the supervisor is gone, and the rank kills its own process group
  (the parent-death detection horovod uses; it works even when the parent was SIGKILLed);
- *control out* (rank → supervisor): events (progress, metrics, state) and the result or error
  of each payload.

A frame is a 4-byte big-endian length, one byte of kind, and the body. After its last payload
the runtime flushes stdout/stderr (Python's and C's) and leaves with ``os._exit``: the
interpreter teardown is skipped because torch 2.13 CPU aborts in it 10-20% of the time after
the work is done. This module imports only the standard library and cloudpickle.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import importlib
import json
import linecache
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar

_HEADER = struct.Struct(">IB")
# frame kinds
PAYLOAD = ord("P")  # supervisor → rank: a pickled payload dict
QUIT = ord("Q")  # supervisor → rank: no more payloads
EVENT = ord("E")  # rank → supervisor: a JSON event
RESULT = ord("R")  # rank → supervisor: the pickled value of a payload
ERROR = ord("X")  # rank → supervisor: JSON {type, message, traceback}

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
T = TypeVar("T")


def write_frame(f: BinaryIO, kind: int, body: bytes) -> None:
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


class _Channel:
    """The rank's end of *control out*; thread-safe."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._lock = threading.Lock()

    def send(self, kind: int, body: bytes) -> None:
        with self._lock:
            write_frame(self._f, kind, body)

    def event(self, **event: Any) -> None:
        self.send(EVENT, json.dumps(event, default=str).encode())


_channel: _Channel | None = None


# -- the API user code calls on a rank --------------------------------------------------------
class _Bar:
    """Rate-limited progress reporting for one loop; also the shape the tqdm bridge uses."""

    _ids = 0

    def __init__(self, total: int | None, desc: str | None) -> None:
        _Bar._ids += 1
        self.id = _Bar._ids
        self.total, self.desc = total, desc
        self.n = 0
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, n: int, *, force: bool = False) -> None:
        self.n = n
        now = time.monotonic()
        if _channel is None or (not force and now - self._last < 0.1):
            return
        self._last = now
        elapsed = now - self.start
        rate = n / elapsed if elapsed > 0 else None
        _channel.event(
            t="progress", id=self.id, n=n, total=self.total, desc=self.desc,
            rate=rate, elapsed=elapsed,
        )


def progress(
    iterable: Iterable[T], total: int | None = None, desc: str | None = None
) -> Iterator[T]:
    """Iterate over ``iterable`` and show a progress bar for this rank in the panel.

    Outside a rank it simply iterates. ``tqdm`` on a rank is bridged the same way on its own.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    bar = _Bar(total, desc)
    n = 0
    for item in iterable:
        yield item
        n += 1
        bar.update(n)
    bar.update(n, force=True)


def report(**metrics: Any) -> None:
    """Show the latest values of ``metrics`` (e.g. ``loss=0.3``) for this rank in the panel.

    Values are sent as JSON (numbers, strings); other objects are shown by their ``str``.
    Outside a rank this does nothing.
    """
    if _channel is not None:
        clean = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                 for k, v in metrics.items()}
        _channel.event(t="metrics", values=clean)


def _bridge_tqdm() -> None:
    """Make every tqdm bar on this rank report to the panel instead of drawing escape codes."""
    try:
        import tqdm.std as tstd
    except ImportError:
        return
    if getattr(tstd.tqdm, "_nbdist_bridged", False):
        return

    def display(self: Any, msg: str | None = None, pos: int | None = None) -> bool:
        bar = self.__dict__.get("_nbdist_bar")
        if bar is None:
            fmt = self.format_dict
            bar = self._nbdist_bar = _Bar(fmt.get("total"), fmt.get("prefix") or None)
        fmt = self.format_dict
        bar.total = fmt.get("total")
        bar.update(int(fmt.get("n") or 0), force=bool(self.disable or getattr(self, "_closing", 0)))
        return True

    original_close = tstd.tqdm.close

    def close(self: Any) -> None:
        self._closing = 1
        original_close(self)
        bar = self.__dict__.get("_nbdist_bar")
        if bar is not None:
            bar.update(int(self.n), force=True)

    tstd.tqdm.display = display
    tstd.tqdm.close = close
    tstd.tqdm._nbdist_bridged = True


# -- running a payload ---------------------------------------------------------------------------
class _RankShell:
    """Stands in for ``get_ipython()`` so ``!cmd`` lines of a cell run on the rank."""

    def system(self, cmd: str) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        return subprocess.call(cmd, shell=True)

    def getoutput(self, cmd: str, split: bool = True) -> Any:
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
        return out.splitlines() if split else out

    def _refuse(self, name: str, *_: object, **__: object) -> None:
        raise RuntimeError(
            f"%{name} is an IPython magic and cannot run on a rank; run it in a normal cell"
        )

    def run_line_magic(self, name: str, *args: object, **kw: object) -> None:
        self._refuse(name)

    def run_cell_magic(self, name: str, *args: object, **kw: object) -> None:
        self._refuse(name)


def _run_cell(payload: dict[str, Any]) -> Any:
    filename: str = payload["filename"]
    source: str = payload["source"]
    offset: int = payload.get("line_offset", 0)
    # Line numbers count from the top of the user's cell, magic line included.
    lines = ["\n"] * offset + source.splitlines(True)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    ns["get_ipython"] = lambda: _RankShell()
    for name, module, attr in payload.get("imports", ()):
        try:
            mod = importlib.import_module(module)
            ns[name] = getattr(mod, attr) if attr else mod
        except Exception as exc:
            what = f"from {module} import {attr}" if attr else f"import {module}"
            raise ImportError(
                f"the notebook's name {name!r} needs `{what}`, which failed on this rank: "
                f"{type(exc).__name__}: {exc}. Install it where the ranks run."
            ) from None
    ns.update(payload.get("values", {}))
    tree = ast.parse(source, filename)
    ast.increment_lineno(tree, offset)
    last = None
    if payload.get("returns_last") and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    exec(compile(tree, filename, "exec"), ns)
    if last is None:
        return None
    return eval(compile(last, filename, "eval"), ns)


def _run_script(payload: dict[str, Any]) -> Any:
    import runpy

    argv = [payload["path"], *payload.get("argv", ())]
    old = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(payload["path"], run_name="__main__")
    finally:
        sys.argv = old
    return None


def _run_call(payload: dict[str, Any]) -> Any:
    fn: Callable[..., Any] = payload["fn"]
    return fn(*payload.get("args", ()), **payload.get("kwargs", {}))


_RUNNERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "cell": _run_cell, "script": _run_script, "call": _run_call,
}


def _format_error(exc: BaseException) -> dict[str, str]:
    """The user's traceback, without the runtime's own frames."""
    te = traceback.TracebackException.from_exception(exc)
    for cur in _chain(te):
        cur.stack = traceback.StackSummary.from_list(
            [f for f in cur.stack if not f.filename.startswith(_PKG_DIR)]
        )
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(te.format()),
    }


def _chain(te: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    seen: set[int] = set()
    stack = [te]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        stack.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C stdio buffers of extensions
    except Exception:
        pass


def _serve(inbox: queue.Queue[tuple[int, bytes] | None], chan: _Channel) -> None:
    import cloudpickle

    while True:
        frame = inbox.get()
        if frame is None or frame[0] == QUIT:
            return
        payload = cloudpickle.loads(frame[1])
        os.environ.update(payload.get("env", {}))
        if payload.get("cwd"):
            os.chdir(payload["cwd"])
        _bridge_tqdm()
        chan.event(t="state", state="running")
        try:
            value = _RUNNERS[payload["kind"]](payload)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                _flush_all()
                chan.send(ERROR, json.dumps({
                    "type": "SystemExit", "message": f"exit code {exc.code}",
                    "traceback": f"the rank's code called sys.exit({exc.code!r})\n",
                }).encode())
                return
            value = None
        except BaseException as exc:
            _flush_all()
            chan.send(ERROR, json.dumps(_format_error(exc)).encode())
            if not payload.get("keep"):
                return
            continue
        _flush_all()
        try:
            body = cloudpickle.dumps(value)
        except Exception as exc:
            chan.send(ERROR, json.dumps({
                "type": "PicklingError",
                "message": f"the cell's value of type {type(value).__qualname__} cannot be "
                f"pickled to return it to the notebook: {exc}",
                "traceback": "",
            }).encode())
        else:
            chan.send(RESULT, body)
        if not payload.get("keep"):
            return


def main() -> None:
    global _channel
    fd_in = int(os.environ.pop("NBDIST_CTL_IN"))
    fd_out = int(os.environ.pop("NBDIST_CTL_OUT"))
    ctl_in = os.fdopen(fd_in, "rb")
    chan = _channel = _Channel(os.fdopen(fd_out, "wb"))
    inbox: queue.Queue[tuple[int, bytes] | None] = queue.Queue()

    def watch() -> None:
        # End of file on control-in: the supervisor is gone. Take the whole group with us.
        while True:
            frame = read_frame(ctl_in)
            if frame is None:
                break
            inbox.put(frame)
        inbox.put(None)
        if not done.is_set():
            os.killpg(os.getpgid(0), signal.SIGKILL)

    done = threading.Event()
    threading.Thread(target=watch, name="nbdist-watch", daemon=True).start()
    # Line buffering flushes on \n and on \r, so progress redraws are not held back.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    chan.event(t="state", state="ready", pid=os.getpid())
    try:
        _serve(inbox, chan)
    finally:
        done.set()
        _flush_all()
        os._exit(0)

"""A debugger on a rank, typed into from the notebook: ``breakpoint()`` and ``pdb.set_trace()``.

The rank has no terminal (its stdin is ``/dev/null``). Its ``sys.breakpointhook`` and
``pdb.set_trace`` start a :class:`pdb.Pdb` whose input and output are the rank's control
channel: what pdb writes is kept until it asks for a line, then sent with the question as a
``debug`` event (interpreter → supervisor → driver); the driver asks the notebook's own input
box (``input()`` in the cell's waiting thread: the frontend's stdin in Jupyter, the terminal in
IPython) labelled with the rank, and the answer comes back as a ``Frame.DEBUG`` frame. The
other ranks run on (or wait at their next collective, as they would). A cancel or a timeout
kills the rank as ever; the notebook's input box then answers nothing.

Standard library only.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Lines typed in the notebook for this rank's debugger (``None``: the driver is gone).
inbox: queue.Queue[str | None] = queue.Queue()
#: The traceback of the session cell that failed last on this rank (``%dist_debug``).
last_traceback: Any = None
_send: Callable[[str], None] | None = None


class RemoteIO:
    """pdb's stdin and stdout: output is kept until pdb reads, then sent with the question."""

    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._out: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._out.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        with self._lock:
            text, self._out = "".join(self._out), []
        self._send(text)
        line = inbox.get()
        # No answer (the notebook cannot be asked): go on with the program, not end it.
        return "c\n" if line is None else line + "\n"


def make_debugger(send: Callable[[str], None]) -> Any:
    """A ``pdb.Pdb`` talking to the notebook through ``send`` and :data:`inbox`."""
    import pdb

    io = RemoteIO(send)
    debugger = pdb.Pdb(stdin=io, stdout=io)  # type: ignore[arg-type]  # file-like enough
    debugger.use_rawinput = False
    return debugger


def install(send: Callable[[str], None]) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` open the notebook's debugger.

    ``pdb`` costs about 0.1 s to import, which a rank that never debugs should not pay: its
    ``set_trace`` is replaced when the rank's code imports it (:class:`_PatchPdb`).
    """

    global _send
    _send = send

    def hook(*args: Any, **kwargs: Any) -> None:
        make_debugger(send).set_trace(sys._getframe(1))

    sys.breakpointhook = hook
    if "pdb" in sys.modules:
        _patch(sys.modules["pdb"], send)
    else:
        sys.meta_path.insert(0, _PatchPdb(send))


def post_mortem(rank: int) -> None:
    """``%dist_debug --rank R``: on rank ``rank``, a post-mortem debugger on the traceback of
    its session cell that failed last, with its frames' live state; the other ranks return."""
    import os

    if int(os.environ.get("RANK", "-1")) != rank:
        return
    if last_traceback is None or _send is None:
        raise RuntimeError(f"rank {rank} has no failed cell to debug")
    debugger = make_debugger(_send)
    debugger.reset()
    debugger.interaction(None, last_traceback)


def _patch(pdb: Any, send: Callable[[str], None]) -> None:
    def set_trace(*, header: str | None = None) -> None:
        debugger = make_debugger(send)
        if header is not None:
            debugger.message(header)
        debugger.set_trace(sys._getframe(1))

    pdb.set_trace = set_trace


class _PatchPdb:
    """An import hook that replaces ``pdb.set_trace`` once ``pdb`` is imported."""

    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "pdb":
            return None
        import importlib.machinery

        sys.meta_path.remove(self)  # once: the real finders find it
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, send = spec.loader, self._send

        class _Loader:
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                _patch(module, send)

        spec.loader = _Loader()  # type: ignore[assignment]
        return spec

"""How a rank's stdout and stderr are written: live while quiet, buffered while they flood.

``runtime.main`` installs a :class:`Pacer` in the rank; ``runtime``'s fork guard calls its fork
hooks. Standard library only: this runs in every rank.
"""

from __future__ import annotations

import ctypes
import io
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


def flush_c_stdio() -> None:
    """Flush the C stdio buffers of extensions (what ``printf`` in C code holds back)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None)  # a dlopen: once, not at every cell's end
        _libc.fflush(None)
    except Exception:
        pass


_libc: ctypes.CDLL | None = None


#: While a stream carries less than this, every line is written as it is printed: a line printed
#: just before a crash (a segfault, a SIGKILL) still reaches the log. Above it, the stream is
#: buffered and flushed every ``FLUSH_S``: a loop printing as fast as it can then pays one
#: ``write`` per ``OUTPUT_BUFFER`` bytes instead of one per line (about 4x cheaper per line).
FLOOD_BYTES_PER_S = 64 * 1024
#: How often a buffered (flooding) stream is flushed: the most it adds to a line's latency.
FLUSH_S = 0.01
#: Buffer of each stream while it is buffered.
OUTPUT_BUFFER = 64 * 1024
#: Window over which the rate is measured, and how much lower it must fall to go back to
#: writing every line (so that a rate near the limit does not flip the mode at every tick).
_RATE_WINDOW_S = 0.1
_BACK_TO_LINES = 4
_WINDOW_BYTES = int(FLOOD_BYTES_PER_S * _RATE_WINDOW_S)


class _CountingFile(io.FileIO):
    """The rank's fd 1 or 2: counts the bytes written, and notices when they flood.

    Only the check of a line-buffered stream runs on every ``write``, and it costs an
    addition and a comparison until ``FLOOD_BYTES_PER_S`` worth of a window has gone by.
    """

    def __init__(self, fd: int, pacer: Pacer) -> None:
        super().__init__(fd, "wb", closefd=False)
        self.written = 0
        self.flooding = False
        self._pacer = pacer
        self._since = time.monotonic()
        self._mark = 0

    def write(self, b: ReadableBuffer, /) -> int:
        n = super().write(b)
        if n:
            self.written += n
            if not self.flooding and self.written - self._mark > _WINDOW_BYTES:
                now = time.monotonic()
                if now - self._since < _RATE_WINDOW_S:
                    self.flooding = True
                    self._pacer.flooded()
                self._since, self._mark = now, self.written
        return n

    def calm(self) -> None:
        """Back to writing every line, with a fresh measure of the rate."""
        self.flooding = False
        self._since, self._mark = time.monotonic(), self.written

    def slowed_down(self) -> bool:
        """Whether the rate over the last window fell well below the flood rate."""
        now = time.monotonic()
        if now - self._since < _RATE_WINDOW_S:
            return False
        rate = (self.written - self._mark) / (now - self._since)
        self._since, self._mark = now, self.written
        return rate * _BACK_TO_LINES < FLOOD_BYTES_PER_S


class Pacer:
    """Gives the rank a stdout and stderr that stay live without costing a write per line.

    Line buffering alone (what a terminal gets) costs a ``write`` per line, which makes a rank
    that prints in a tight loop about 4x slower than one writing to a file; block buffering
    alone holds lines back for as long as the rank computes, and loses the last ones when it
    crashes. So each stream is line-buffered while it is quiet and block-buffered while it
    floods, with a thread (started at the first flood) flushing it every ``FLUSH_S``. The
    streams are built anew rather than reconfigured: with ``PYTHONUNBUFFERED`` (common in
    containers) Python's own have no buffer at all and cost a ``write`` per ``print`` argument.

    A fork (``os.fork``, multiprocessing and DataLoader workers with ``fork``) copies the
    streams with their buffers and the locks inside them, but not the flushing thread. Unless
    handled, the child writes the parent's unflushed lines a second time when it flushes, holds
    its own lines back with nobody to flush them, and hangs for good on its first write if the
    fork came while the thread was flushing (a buffer's lock, held by a thread the child does
    not have: how an earlier attempt at this hung). So ``before_fork`` takes ``_lock``, which
    the thread holds whenever it touches a stream, and flushes both streams; the child then
    starts from clean, line-buffered streams of its own and starts its own thread if it floods.
    A thread of the user's that is writing to a stream at the moment of a fork can still leave
    that stream's lock held in the child, as in any Python program that forks while threads
    print.
    """

    def __init__(self) -> None:
        self.streams: list[tuple[io.TextIOWrapper, _CountingFile]] = []
        self._wake = threading.Event()
        self._lock = threading.Lock()  # held by the thread over the streams, and over a fork
        # Never taken by ``flooded`` (which runs inside a stream's write, holding the stream's
        # lock, while the thread holds ``_lock`` and waits for the stream's: a deadlock).
        self._start = threading.Lock()
        self._pid = 0  # the process whose flushing thread runs

    def install(self) -> None:
        """Replace ``sys.stdout`` and ``sys.stderr`` (and their ``__stdout__``...) with ours."""
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            try:
                old.flush()
            except (AttributeError, OSError, ValueError):
                pass
            raw = _CountingFile(fd, self)
            text = io.TextIOWrapper(
                io.BufferedWriter(raw, OUTPUT_BUFFER), line_buffering=True,
                encoding=getattr(old, "encoding", None) or "utf-8",
                errors=getattr(old, "errors", None) or "backslashreplace",
            )
            setattr(sys, name, text)
            setattr(sys, f"__{name}__", text)  # what code restoring the "real" stream gets
            self.streams.append((text, raw))

    def flooded(self) -> None:
        """A stream started to flood: wake the flushing thread (start it in this process)."""
        with self._start:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, daemon=True, name="nbdist-output").start()
        self._wake.set()

    def _run(self) -> None:
        """Switch each stream between line and block buffering; flush the buffered ones."""
        while True:
            if not any(raw.flooding for _, raw in self.streams):
                self._wake.wait()  # every stream writes its lines itself: sleep until one floods
                self._wake.clear()
            else:
                time.sleep(FLUSH_S)  # a pace, not a wait for anything
            with self._lock:
                for text, raw in self.streams:
                    if not raw.flooding:
                        continue
                    try:
                        if text.line_buffering:  # it just started to flood
                            text.reconfigure(line_buffering=False)
                            continue
                        text.flush()
                        if raw.slowed_down():
                            raw.calm()
                            text.reconfigure(line_buffering=True)
                    except (OSError, ValueError):  # the pipe is gone, or the user closed it
                        pass

    def before_fork(self) -> None:
        self._lock.acquire()
        for text, _ in self.streams:
            try:
                text.flush()
            except (OSError, ValueError):
                pass
        flush_c_stdio()

    def after_fork_in_parent(self) -> None:
        self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock.release()
        # Locks the parent's other threads may have held at the fork: the child gets its own.
        self._wake = threading.Event()
        self._start = threading.Lock()
        for text, raw in self.streams:
            raw.calm()
            try:
                text.reconfigure(line_buffering=True)  # empty (flushed before the fork)
            except (OSError, ValueError):
                pass

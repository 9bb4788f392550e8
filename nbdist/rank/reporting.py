"""Progress bars and metrics on a rank: ``nbdist.progress``, ``nbdist.report`` and the tqdm
bridge. Each sends its events on the rank's control-out channel (``channel``, set by
``runtime.main``), rate-limited; outside a rank they do nothing but iterate.

Standard library only: this module is imported on every rank (``import nbdist``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from nbdist.protocol import FrameWriter, ProgressEvent

T = TypeVar("T")

#: The rank's control-out channel; None outside a rank (``runtime.main`` sets it).
channel: FrameWriter | None = None

#: A bar reports at most this often; what a faster loop skips is sent by a trailing update.
BAR_EVERY_S = 0.1


class Bar:
    """Rate-limited progress reporting for one loop; also the shape the tqdm bridge uses.

    A skipped update is not lost: a loop that stalls right after one (a rank waiting in a
    collective) would otherwise show a stale count for as long as it waits. One thread per
    rank, started on the first skip, sends the latest count of such bars ``BAR_EVERY_S`` later.
    """

    _ids = 0
    _lock = threading.Lock()  # one send at a time, so a bar's counts never arrive out of order
    _late: dict[int, Bar] = {}
    _trailer: threading.Thread | None = None

    def __init__(self, total: int | None, desc: str | None) -> None:
        Bar._ids += 1
        self.id = Bar._ids
        self.total, self.desc = total, desc
        self.n = 0
        # The numbers of tqdm's postfix (``set_postfix``), charted with ``n`` as their step.
        # Sent with every update, not only when they change: the client's coalescing replaces
        # a bar's queued update with its newest, which would drop a postfix sent only once.
        self.postfix: dict[str, float] | None = None
        self._steps_before = 0  # counts before the bar was last reset: the postfix's step
        self.start = time.monotonic()
        self._last = 0.0
        self._sent: int | None = None

    def update(self, n: int, *, force: bool = False) -> None:
        if n < self.n:  # reset (tqdm's reset, a new epoch's count): steps go on from here
            self._steps_before += self.n
        self.n = n
        if channel is None:
            return
        if force or time.monotonic() - self._last >= BAR_EVERY_S:
            self._send()
            return
        with Bar._lock:
            Bar._late[self.id] = self
            if Bar._trailer is None:
                Bar._trailer = threading.Thread(target=Bar._trail, daemon=True,
                                                 name="nbdist-progress")
                Bar._trailer.start()

    def _send(self) -> None:
        with Bar._lock:
            if channel is None:
                return
            now = time.monotonic()
            self._last, self._sent = now, self.n
            elapsed = now - self.start
            rate = self.n / elapsed if elapsed > 0 else None
            event: ProgressEvent = {"t": "progress", "id": self.id, "n": self.n,
                                    "total": self.total, "desc": self.desc, "rate": rate,
                                    "elapsed": elapsed}
            if self.postfix:
                event["postfix"] = self.postfix
                event["step"] = self._steps_before + self.n
            channel.event(event)

    @staticmethod
    def _trail() -> None:
        while True:
            time.sleep(BAR_EVERY_S)  # a pace, not a wait for anything
            Bar.send_late()

    @staticmethod
    def send_late() -> None:
        """Send the counts (and reports) held back by the rate limit now."""
        with Bar._lock:
            late = list(Bar._late.values())
            Bar._late.clear()
        for bar in late:
            if bar.n != bar._sent:
                bar._send()


class Reports(Bar):
    """``report``'s values, sent like a bar's counts: at most every ``BAR_EVERY_S``, what a
    faster loop reports in between merged (each metric's newest value, at the newest count)
    and sent by the trailer, or at the payload's end. One event per call cost a loop that
    reports every millisecond 10 % of its speed; this costs it nothing measurable."""

    def __init__(self) -> None:
        super().__init__(None, None)
        self.values: dict[str, Any] = {}

    def add(self, values: dict[str, Any]) -> None:
        with Bar._lock:
            self.values.update(values)
            n = self.n + 1
        self.update(n)

    def _send(self) -> None:
        with Bar._lock:
            if channel is None or not self.values:
                return
            self._last, self._sent = time.monotonic(), self.n
            values, self.values = self.values, {}
            channel.event({"t": "metrics", "values": values, "step": self.n})


def progress(
    iterable: Iterable[T], total: int | None = None, desc: str | None = None
) -> Iterator[T]:
    """Iterate over ``iterable`` and show a progress bar for this rank in the panel.

    Outside a rank it simply iterates. ``tqdm`` on a rank is bridged the same way on its own.
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    bar = Bar(total, desc)
    n = 0
    for item in iterable:
        yield item
        n += 1
        bar.update(n)
    bar.update(n, force=True)


_reports: Reports | None = None  # counts the calls: the step the values are charted at


def report(**metrics: Any) -> None:
    """Show the latest values of ``metrics`` (e.g. ``loss=0.3``) for this rank in the panel,
    and chart the numbers among them (the x axis counts this rank's calls of ``report``).

    Values are sent as JSON (numbers, strings); an object that converts to a number (a numpy
    scalar, a one-element tensor) is sent as that number, other objects by their ``str``.
    At most ten sends a second, like a bar: calls in between are merged (each metric's newest
    value) and sent 0.1 s later, or when the cell ends. Outside a rank this does nothing.
    """
    global _reports
    if channel is not None:
        if _reports is None:
            _reports = Reports()
        _reports.add({k: _json_value(v) for k, v in metrics.items()})


def _json_value(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if hasattr(v, "__float__"):
        try:
            return float(v)
        except (TypeError, ValueError, RuntimeError):  # a tensor of many elements, say
            pass
    return str(v)


def _postfix_numbers(postfix: Any) -> dict[str, float] | None:
    """The numbers in tqdm's postfix text (``"loss=0.693, acc=0.51"``, how ``set_postfix``
    writes it), or None. Lightning's ``v_num`` (the logger's version) is not a metric."""
    if not postfix or not isinstance(postfix, str):
        return None
    numbers = {}
    for part in postfix.split(", "):
        name, eq, text = part.partition("=")
        if eq and name.strip() and name.strip() != "v_num":
            try:
                numbers[name.strip()] = float(text.strip())
            except ValueError:
                continue  # a word, not a number: shown by nothing but the bar itself
    return numbers or None


def bridge_tqdm() -> None:
    """Make every tqdm bar on this rank report to the panel instead of drawing escape codes.

    tqdm calls ``display`` at most every ``mininterval``; ours sends a progress event (itself
    rate-limited) and draws nothing. ``close`` would still write a newline to the rank's
    stderr, leaving an empty line per bar in the log: without ``sp`` (tqdm's "GUI mode") it
    skips that.
    """
    try:
        import tqdm.std as tstd
    except ImportError:
        return
    if getattr(tstd.tqdm, "_nbdist_bridged", False):
        return

    def display(self: Any, msg: str | None = None, pos: int | None = None) -> bool:
        bar = self.__dict__.get("_nbdist_bar")
        if bar is None:
            bar = self._nbdist_bar = Bar(self.total, self.desc or None)
        bar.total, bar.desc = self.total, self.desc or None  # set_description may change it
        bar.postfix = _postfix_numbers(self.postfix)
        bar.update(int(self.n), force=bool(getattr(self, "_closing", 0)))
        return True

    original_close = tstd.tqdm.close

    def close(self: Any) -> None:
        if getattr(self, "disable", True):
            return
        self._closing = 1
        self.sp = None  # no final newline on the rank's stderr
        original_close(self)
        bar = self.__dict__.get("_nbdist_bar")
        if bar is not None:
            bar.update(int(self.n), force=True)

    tstd.tqdm.display = display
    tstd.tqdm.close = close
    tstd.tqdm._nbdist_bridged = True


def before_fork() -> None:
    """Hold the bars' and the channel's locks over a fork of the rank, in the order ``Bar``'s
    sends take them: the child never inherits one taken by a thread it does not have."""
    Bar._lock.acquire()
    if channel is not None:
        channel.lock.acquire()
        channel.flush_held()


def after_fork_in_parent() -> None:
    if channel is not None:
        channel.lock.release()
    Bar._lock.release()


def after_fork_in_child() -> None:
    if channel is not None:
        channel.forget_hold()
        channel.lock.release()
    Bar._trailer = None  # the parent's thread; the child starts its own if it needs one
    Bar._late.clear()
    Bar._lock.release()


def send_late() -> None:
    """Send the counts and reports held back by the rate limit now (a payload's end)."""
    Bar.send_late()

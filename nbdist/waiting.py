"""The one loop that waits on ranks, and the marker that says the kernel is in it.

A job's ``wait``, a session cell's and a session's start all wait here (``wait_loop``). While
the main thread is inside it, or inside a magic's run (``waiting``), the notebook's stop button
is nbdist's to handle: the Spark launcher's SIGINT guard (``launch/spark.py``) asks
``is_waiting`` and then raises KeyboardInterrupt alone, instead of letting pyspark's handler
cancel every Spark job of the session. The guard imports this module, not ``job.py``: the
launchers sit below the job layer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

#: How often the wait loop wakes to call ``on_tick`` (views render there, ~10 times a second).
TICK_S = 0.1

# Per thread: how many nbdist waits this thread is inside. The SIGINT handler runs in the main
# thread, so what it reads is the main thread's: whether the kernel is waiting on nbdist.
_waits = threading.local()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Mark this thread as waiting on an nbdist handle (re-entrant).

    While the main thread is marked, the notebook's stop button is nbdist's to handle: the
    Spark launcher's SIGINT guard (``launch/spark.py``) then raises KeyboardInterrupt alone,
    instead of pyspark's handler, which cancels every Spark job of the session.
    """
    _waits.depth = getattr(_waits, "depth", 0) + 1
    try:
        yield
    finally:
        _waits.depth -= 1


def is_waiting() -> bool:
    """True while this thread is inside :func:`waiting` (the main thread: in a cell's wait)."""
    return getattr(_waits, "depth", 0) > 0


def wait_loop(
    done: threading.Event,
    timeout: float | None,
    on_tick: Callable[[], None] | None,
    *,
    cancel: Callable[[str], None],
    teardown_s: float,
    force: Callable[[], None] | None = None,
) -> bool:
    """The one loop that waits on a job, a session cell or a session start.

    Returns True once ``done`` is set, False when ``timeout`` passed first. ``on_tick`` is
    called about ten times a second while waiting, and once at the end (views render there).
    A KeyboardInterrupt (the stop button) calls ``cancel``, keeps ticking until ``done`` or
    ``teardown_s`` passed, and re-raises; a second one during that wait calls ``force`` (when
    given: a teardown that does not wait for the ranks' cooperation) and waits again.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with waiting():
        try:
            while not done.wait(TICK_S):
                if on_tick is not None:
                    on_tick()
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        except KeyboardInterrupt:
            cancel("interrupted from the notebook")
            try:  # the view stays live: what the ranks print as they stop is shown
                _tick_until(done, teardown_s, on_tick)
            except KeyboardInterrupt:
                if force is None:
                    raise
                force()
                _tick_until(done, teardown_s, on_tick)
            raise
    if on_tick is not None:
        on_tick()
    return True


def _tick_until(done: threading.Event, timeout: float, on_tick: Callable[[], None] | None
                ) -> None:
    deadline = time.monotonic() + timeout
    while not done.wait(TICK_S) and time.monotonic() < deadline:
        if on_tick is not None:
            on_tick()



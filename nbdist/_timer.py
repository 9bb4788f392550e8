"""``after``: call a function once, some seconds from now, from a daemon thread, unless cancelled
first. The one way nbdist arms a deadline (a job's timeout, a session's idle stop, a cancel's
SIGKILL), so that none of them keeps the interpreter alive at exit.

Standard library only: the ranks' supervisors use it too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def after(seconds: float, fn: Callable[..., Any], *args: Any) -> threading.Timer:
    """``fn(*args)`` in ``seconds`` (0 when negative), from a daemon thread; the started timer,
    whose ``cancel()`` stops it if it has not fired yet."""
    timer = threading.Timer(max(seconds, 0.0), fn, args=args)
    timer.daemon = True
    timer.start()
    return timer

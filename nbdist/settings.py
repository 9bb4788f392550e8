"""Every kernel-wide knob of nbdist, in one checked object.

``%config DistMagics.<name> = value`` sets them (each is a trait of the magics, which copies
its value here), and so can Python: ``nbdist.settings.settings.<name> = value``. A bad value
is refused where it is set, with a message naming the knob, the value and what it takes; the
engine reads them at each launch, so a change applies to the next job.

The knobs (docs/magics.md lists them with their defaults):

- ``view``: how a running job is shown (``auto``, ``panel``, ``text``);
- ``large_value_mb``: warn when a value the cell takes from the notebook pickles to more;
- ``history``, ``history_mb``: the finished jobs kept for ``%dist_status``, and the pickled
  size of the values they keep in all (the last job's are always kept);
- ``driver_host``, ``driver_port``, ``heartbeat_timeout``: the network for remote ranks
  (None or "": the environment variable, then Spark's own setting);
- ``capacity_wait``, ``checkpoint_root``: the defaults of jobs that restart;
- ``stacks_when_quiet``: take the ranks' stacks once when a running rank printed nothing for
  so many seconds;
- ``warm_at_load``: start the first local job's zygote at ``%load_ext``;
- ``flight_recorder``: entries of torch's flight recorder in every rank
  (``TORCH_FR_BUFFER_SIZE``; 0: off; docs/collectives.md).

Standard library only; pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: How long a remote rank and the driver each wait to hear from the other before they take
#: it for gone (a network cut off, a host powered down: no connection reset ever comes).
HEARTBEAT_TIMEOUT_S = 60.0
#: Shorter timeouts would take a rank that missed one heartbeat on a busy host for gone.
MIN_HEARTBEAT_TIMEOUT_S = 10.0
#: How long a restart waits for the backend to have the slots again, by default (seconds).
CAPACITY_WAIT_S = 300.0
VIEWS = ("auto", "panel", "text")
#: The flight recorder's entries per rank by default: a few hundred collectives, about 140 KB
#: of JSON when dumped (docs/collectives.md).
FLIGHT_RECORDER_ENTRIES = 256


def check_heartbeat_timeout(value: str | float, source: str) -> float | None:
    """``value`` as a heartbeat timeout (None for 0: off), or a ValueError naming ``source``."""
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{source} must be a number of seconds, not {value!r}") from None
    if seconds == 0:
        return None
    if not seconds >= MIN_HEARTBEAT_TIMEOUT_S:
        raise ValueError(
            f"{source}={value}: the heartbeat timeout must be at least "
            f"{MIN_HEARTBEAT_TIMEOUT_S:g} s (ranks and driver each say something every 5 s), "
            f"or 0 to turn the keepalive off"
        )
    return seconds


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value)


def _view(v: Any) -> str | None:
    return None if v in VIEWS else f"one of {', '.join(VIEWS)}"


def _positive(v: Any) -> str | None:
    return None if _number(v) and v > 0 else "a positive number"


def _at_least_zero(v: Any) -> str | None:
    return None if _number(v) and v >= 0 else "0 or more seconds"


def _optional_positive(v: Any) -> str | None:
    return None if v is None or (_number(v) and v > 0) else \
        "a positive number of seconds, or None"


def _count(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else \
        "a whole number of 1 or more"


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) else "a string"


def _port(v: Any) -> str | None:
    ok = v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535)
    return None if ok else "a port number (1-65535, or 0 for any free port), or None"


def _heartbeat(v: Any) -> str | None:
    if v is None:
        return None
    if not _number(v):
        return "a number of seconds, or None"
    try:
        check_heartbeat_timeout(v, "heartbeat_timeout")
    except ValueError:
        return f"at least {MIN_HEARTBEAT_TIMEOUT_S:g} seconds, or 0 to turn it off"
    return None


def _entries(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else \
        "a whole number of entries, 0 or more (0: off)"


def _flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else "True or False"


#: Each knob's check: None when the value is good, else what the knob takes, in words.
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "view": _view,
    "large_value_mb": _positive,
    "history": _count,
    "history_mb": _positive,
    "driver_host": _text,
    "driver_port": _port,
    "heartbeat_timeout": _heartbeat,
    "capacity_wait": _at_least_zero,
    "checkpoint_root": _text,
    "stacks_when_quiet": _optional_positive,
    "warm_at_load": _flag,
    "flight_recorder": _entries,
}


@dataclass
class Settings:
    """The kernel's knobs (``%config DistMagics.<name>``); every assignment is checked."""

    #: How a running job is shown: 'panel' (widgets), 'text', or 'auto'.
    view: str = "auto"
    #: Warn when a value the cell takes from the notebook pickles to more megabytes than this.
    large_value_mb: float = 100.0
    #: Finished jobs kept for %dist_status; older ones are forgotten.
    history: int = 50
    #: What finished jobs keep of their values, in MiB of pickled size, in all: the values of
    #: the job that ended last are always kept; an older job's are let go once the jobs after
    #: it hold more (its ``.result()`` then raises ``ValuesDroppedError``).
    history_mb: float = 256.0
    #: The address Spark ranks connect to for the event channel (NBDIST_DRIVER_HOST).
    driver_host: str = ""
    #: A fixed port for the event channel (NBDIST_DRIVER_PORT); 0: any free port.
    driver_port: int | None = None
    #: Seconds without a word from the other side before a remote rank, or the driver, takes
    #: it for gone (NBDIST_HEARTBEAT_TIMEOUT); 0 turns the keepalive off.
    heartbeat_timeout: float | None = None
    #: Seconds a restart waits for the backend's slots (``--capacity-wait`` wins).
    capacity_wait: float = CAPACITY_WAIT_S
    #: Where jobs keep their checkpoint directories ("": under the working directory).
    checkpoint_root: str = ""
    #: Take the ranks' stacks once when a running rank printed nothing for so many seconds.
    stacks_when_quiet: float | None = None
    #: Start the first local job's zygote at %load_ext (read when nbdist loads).
    warm_at_load: bool = True
    #: Entries of torch's flight recorder in every rank (TORCH_FR_BUFFER_SIZE; 0: off; a
    #: job's ``--env TORCH_FR_BUFFER_SIZE=N`` wins): the collectives a hung job's error and
    #: ``%dist_stacks`` line up by rank (``nbdist.collectives``).
    flight_recorder: int = FLIGHT_RECORDER_ENTRIES

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None:
            known = ", ".join(f.name for f in dataclasses.fields(self))
            raise AttributeError(f"nbdist has no setting {name!r}; the settings are: {known}")
        wrong = check(value)
        if wrong is not None:
            raise ValueError(f"DistMagics.{name} takes {wrong}, not {value!r}")
        object.__setattr__(self, name, value)

    @property
    def large_value_bytes(self) -> int:
        return int(self.large_value_mb * 1e6)

    @property
    def history_bytes(self) -> int:
        return int(self.history_mb * 2**20)


#: This kernel's settings: the magics' traits write here, the engine reads here.
settings = Settings()


def names() -> list[str]:
    """The knobs' names, in the order above."""
    return [f.name for f in dataclasses.fields(Settings)]

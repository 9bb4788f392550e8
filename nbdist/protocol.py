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
"""

from __future__ import annotations

from enum import Enum


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

#: A running rank's supervisor says it is alive this often (``rank.py`` sends at this pace), even
#: when the rank itself is quiet; the driver pings session ranks at the same pace.
HEARTBEAT_S = 5.0
#: A starting or running rank not heard of for this long (three missed heartbeats) is *silent*:
#: its supervisor, its host or the network to the driver is stuck or gone.
SILENT_AFTER_S = 3 * HEARTBEAT_S

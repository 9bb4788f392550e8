"""Backends: start a job's ranks, report how each ended, cancel them, tell their capacity.

Every backend implements :class:`Launcher` and hands each rank to the same supervisor
(``nbdist.rank``); only where that supervisor runs differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nbdist.rank import RankOutcome


@dataclass(frozen=True)
class Capacity:
    """What a backend can run at the same time."""

    slots: int  # ranks that fit at once
    gpus: int  # GPUs usable by ranks (0: none)
    detail: str  # one line for %dist_status: where the numbers come from


@dataclass(frozen=True)
class LaunchRequest:
    """One job's ranks as the job asks for them; the backend fills in the per-rank parts."""

    job_id: str
    np: int
    secret: str
    driver: tuple[str, int]
    payload: bytes
    gpu: bool
    env: dict[str, str] = field(default_factory=dict)
    run_id: str = ""  # TORCHELASTIC_RUN_ID, for ranks that plan their world without the driver


class Launcher(Protocol):
    """The interface of a backend."""

    name: str

    def driver_host(self) -> str:
        """The address at which ranks reach the driver's event server."""
        ...

    def capacity(self) -> Capacity: ...

    def check(self, np: int, gpu: bool) -> None:
        """Raise :class:`~nbdist.errors.CapacityError` if ``np`` ranks cannot run at once."""
        ...

    def start(self, request: LaunchRequest, on_outcome: Callable[[RankOutcome], None]) -> None:
        """Start every rank; call ``on_outcome`` once per rank, from any thread."""
        ...

    def cancel(self) -> None:
        """Tear every rank down; outcomes still arrive through ``on_outcome``."""
        ...

"""Backends: start a job's ranks, report how each ended, cancel them, tell their capacity.

Every backend implements :class:`Launcher`, takes the job's :class:`LaunchRequest` (the launch
contract, in ``protocol.py``), maps it to each rank's spec the one way
(``RankSpec.for_rank``) and hands each rank to the same supervisor
(``nbdist.rank.supervisor``); only where that supervisor runs differs. Which backend a job gets,
what the backends can run and what they leave behind is ``launch/backends.py``'s; what a
payload needs before it runs is ``launch/payload.py``'s.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from nbdist import settings as _settings
from nbdist.events import DriverAddress
from nbdist.protocol import DriverEvent, LaunchRequest, RankOutcome

__all__ = ["Capacity", "LaunchRequest", "Launcher", "RankOutcome", "Settings", "settings",
           "setting", "heartbeat_timeout", "check_heartbeat_timeout", "HEARTBEAT_TIMEOUT_S",
           "MIN_HEARTBEAT_TIMEOUT_S"]

#: The network settings live with every other knob (``nbdist.settings``); the old names stay.
settings = _settings.settings
Settings = _settings.Settings
HEARTBEAT_TIMEOUT_S = _settings.HEARTBEAT_TIMEOUT_S
MIN_HEARTBEAT_TIMEOUT_S = _settings.MIN_HEARTBEAT_TIMEOUT_S
check_heartbeat_timeout = _settings.check_heartbeat_timeout


def gpus_text(n: int) -> str:
    """``1 GPU``, ``4 GPUs``, ``no GPU``: a count of GPUs in a message."""
    return "no GPU" if n == 0 else f"{n} GPU" if n == 1 else f"{n} GPUs"


def no_gpu_hint(np: int) -> str:
    """What a user with fewer GPUs than ranks can do instead (CPU ranks, gloo)."""
    return (f"--no-gpu for {np} CPU rank{'' if np == 1 else 's'} (gpu=False in nbdist.run; "
            f"torch.distributed with 'gloo')")

_ENV = {"driver_host": "NBDIST_DRIVER_HOST", "driver_port": "NBDIST_DRIVER_PORT",
        "heartbeat_timeout": "NBDIST_HEARTBEAT_TIMEOUT"}


def setting(name: str) -> tuple[str, str]:
    """A network setting's value and where it came from, in words; ("", "") when unset.

    ``%config DistMagics.<name>`` wins over the environment variable.
    """
    value = getattr(settings, name)
    if value is not None and value != "":
        return str(value), f"%config DistMagics.{name}"
    env = _ENV[name]
    if os.environ.get(env, "").strip():
        return os.environ[env].strip(), env
    return "", ""


def heartbeat_timeout() -> float | None:
    """The keepalive timeout for a remote job (None: no keepalive)."""
    value, source = setting("heartbeat_timeout")
    if not value:
        return HEARTBEAT_TIMEOUT_S
    return check_heartbeat_timeout(value, source)


@dataclass(frozen=True)
class Capacity:
    """What a backend can run at the same time."""

    slots: int  # ranks that fit at once
    gpus: int  # GPUs usable by ranks (0: none)
    detail: str  # one line for %dist_status: where the numbers come from


class Launcher(Protocol):
    """The interface of a backend."""

    name: str
    #: Whether the ranks run on other hosts: then the driver and the ranks keep each other
    #: alive (pings and heartbeats), since a host cut off never closes its connections.
    remote: bool

    def driver_address(self) -> DriverAddress:
        """Where the driver's event server listens, and the address the ranks reach it at."""
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

    def deliver(self, rank: int, event: DriverEvent) -> bool:
        """Hand ``event`` to rank ``rank``'s supervisor in this process, in the calling thread,
        where the backend runs it here (True); False: it goes on the event channel."""
        ...


#: Each application's secret for its hosts' zygotes (a Spark application, a Ray job), made
#: here on the driver once per application and shipped with its ranks' launch.
APP_SECRETS: dict[str, str] = {}
_SECRETS_LOCK = threading.Lock()


def warmth(app: str) -> tuple[str, str, float] | None:
    """What a backend's ranks need to use their hosts' zygotes (``rank/executor_zygote.py``):
    the application's id, its secret and the idle time (``NBDIST_WARM_IDLE_S``, 600 s); None
    when zygotes are off (``NBDIST_ZYGOTE=0``, ``NBDIST_WARM_POOL=0``) or ``app`` is empty."""
    if not app or os.environ.get("NBDIST_ZYGOTE", "1") == "0" or os.environ.get(
            "NBDIST_WARM_POOL", "1") == "0":
        return None
    with _SECRETS_LOCK:
        secret = APP_SECRETS.setdefault(app, secrets.token_hex(32))
    return app, secret, float(os.environ.get("NBDIST_WARM_IDLE_S", "600"))

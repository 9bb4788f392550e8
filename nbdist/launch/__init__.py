"""Backends: start a job's ranks, report how each ended, cancel them, tell their capacity.

Every backend implements :class:`Launcher` and hands each rank to the same supervisor
(``nbdist.rank.supervisor``); only where that supervisor runs differs.
"""

from __future__ import annotations

import ast
import dis
import os
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nbdist.events import DriverAddress
from nbdist.rank.supervisor import RankOutcome

#: How long a remote rank and the driver each wait to hear from the other before they take
#: it for gone (a network cut off, a host powered down: no connection reset ever comes).
HEARTBEAT_TIMEOUT_S = 60.0
#: Shorter timeouts would take a rank that missed one heartbeat on a busy host for gone.
MIN_HEARTBEAT_TIMEOUT_S = 10.0


@dataclass
class Settings:
    """The kernel's network settings for remote ranks (``%config DistMagics.<name>``).

    None or "" means "not set here": the environment variable, then Spark's own setting,
    apply (:func:`setting`).
    """

    #: The address Spark ranks connect to for the event channel (NBDIST_DRIVER_HOST).
    driver_host: str = ""
    #: A fixed port for the event channel, e.g. one forwarded into a container
    #: (NBDIST_DRIVER_PORT); 0: any free port.
    driver_port: int | None = None
    #: Seconds without a word from the other side before a remote rank, or the driver, takes
    #: it for gone (NBDIST_HEARTBEAT_TIMEOUT); 0 turns the keepalive off.
    heartbeat_timeout: float | None = None


#: Set by the magics' traits; read at every launch.
settings = Settings()


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
    #: What the rendezvous adds to every rank's environment (a restart's count, its
    #: checkpoint directory), for ranks that plan their world without the driver. Not part
    #: of ``env``, which keys the local backend's warm ranks (a remote backend's ``env`` has
    #: them too).
    world_env: dict[str, str] = field(default_factory=dict)
    modules: tuple[str, ...] = ()  # what the payload imports, known before it runs (warm-up)
    session: bool = False  # ranks of a persistent session: cells arrive over the channel
    #: Seconds without a word from the driver after which a rank stops (None: never).
    heartbeat_timeout: float | None = None


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


def payload_modules(payload: Mapping[str, Any]) -> tuple[str, ...]:
    """The modules a payload imports, as far as they can be told without running it.

    A backend may import them ahead, while the ranks are still being set up (the local
    backend's zygote does). Read from the function's bytecode, the cell's or script's source
    and the names the cell imports from the notebook; what is imported dynamically is missed,
    which only costs that head start. Relative imports are left out.
    """
    found: list[str] = []
    kind = payload.get("kind")
    if kind == "call":
        fn: Any = payload.get("fn")
        while not hasattr(fn, "__code__") and hasattr(fn, "func"):  # functools.partial
            fn = fn.func
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            found.extend(_code_imports(code))
    elif kind == "cell":
        found.extend(module for _, module, _ in payload.get("imports", ()))
        found.extend(payload.get("submodules", ()))
        found.extend(_source_imports(str(payload.get("source", ""))))
    elif kind == "script":
        try:
            with open(str(payload.get("path")), encoding="utf-8") as f:
                found.extend(_source_imports(f.read()))
        except (OSError, UnicodeDecodeError):
            pass
    return tuple(dict.fromkeys(m for m in found if m and not m.startswith(".")))


def payload_env(payload: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables a cell sets first thing, before it runs or imports anything else.

    ``os.environ["KERAS_BACKEND"] = "jax"`` just before ``import keras`` is how Keras, and
    TensorFlow (``TF_USE_LEGACY_KERAS``, ``TF_CPP_MIN_LOG_LEVEL``) and JAX (``JAX_PLATFORMS``),
    are configured: they read it when they are imported. A rank forked from a zygote or taken
    warm has imported them already, under the kernel's environment (``import tensorflow`` even
    imports keras), so the cell's choice would be silently ignored. Given to the ranks from the
    start (a backend keys its zygotes and warm interpreters on their environment), those
    imports see it. Only string literals assigned to ``os.environ[...]`` in the cell's leading
    statements count, with nothing before them but imports of ``os``: setting those earlier
    changes nothing else the cell could see.
    """
    if payload.get("kind") != "cell":
        return {}
    try:
        tree = ast.parse(str(payload.get("source", "")))
    except (SyntaxError, ValueError):
        return {}
    env: dict[str, str] = {}
    environ = {"os.environ"}  # how the cell names os.environ so far
    for node in tree.body:
        if isinstance(node, ast.Import) and all(a.name == "os" for a in node.names):
            environ.update(f"{a.asname or 'os'}.environ" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and node.level == 0:
            environ.update(a.asname or a.name for a in node.names if a.name == "environ")
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(target := node.targets[0], ast.Subscript)
              and ast.unparse(target.value) in environ
              and isinstance(key := target.slice, ast.Constant) and isinstance(key.value, str)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            env[key.value] = node.value.value
        else:
            break
    return env


def _code_imports(code: types.CodeType) -> Iterator[str]:
    consts: list[Any] = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_CONST", "LOAD_SMALL_INT"):  # the latter: Python 3.14
            consts.append(ins.argval)
        elif ins.opname == "IMPORT_NAME":
            # Compiled as LOAD_CONST level, LOAD_CONST fromlist, IMPORT_NAME name.
            if len(consts) >= 2 and consts[-2] == 0:
                yield str(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, classes, comprehensions
            yield from _code_imports(const)


def _source_imports(source: str) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module

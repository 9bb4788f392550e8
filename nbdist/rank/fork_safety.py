"""Whether a zygote may fork now, judged by what makes a fork unsafe; and if not, why, in words.

Two things make a forked child unlike a fresh interpreter:

- **An initialised CUDA driver.** After ``cuInit`` (a context, the runtime's first call, NVML's
  ``nvmlInit``) the driver holds open ``/dev/nvidia*`` handles (``/dev/dxg`` under WSL) and
  state that a child cannot use: CUDA fails in it. A *mapped* ``libcuda.so`` is not that: a
  CUDA build of torch may map the driver library, or load its runtime, at ``import torch``
  without starting the driver, and a fork then is as safe as without it. GPU users need the
  zygote most (a fresh rank on an H100 took 9-10 s: interpreter, torch, CUDA), so only what
  starts the driver counts: open or mapped device handles, and torch's own
  ``torch.cuda.is_initialized()``.
- **Another Python thread.** Its locks may be held at the fork, and it does not exist in the
  child. The message names the thread, what it runs, and the module whose import started it
  (``recording_thread_starts`` notes where each thread started while the zygote imports).

Threads of C libraries (OpenBLAS's pool, started when numpy loads it) are not counted: those
libraries restart their pools in a child themselves (``pthread_atfork``), as torch does.

Standard library only: it runs in the zygotes before they fork.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import Any

#: Device files whose handles mean the CUDA driver was started in this process (``/dev/dxg``:
#: WSL2's GPU device, which CUDA uses there).
DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dxg")

#: Where each thread started during the imports came from (``recording_thread_starts``).
_starts: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
#: The first module after whose import the CUDA driver was found started (``note_import``).
_cuda_by: list[str] = []


def device_handles(fd_targets: Iterable[str], maps: Iterable[str]) -> list[str]:
    """The CUDA device files among a process's open descriptors (their link targets) and
    memory mappings (lines of ``/proc/PID/maps``), each once, in order."""
    found: dict[str, None] = {}
    for target in fd_targets:
        if target.startswith(DEVICE_PREFIXES):
            found[target] = None
    for line in maps:
        path = line.rstrip("\n").split(maxsplit=5)[5:]
        if path and path[0].startswith(DEVICE_PREFIXES):
            found[path[0]] = None
    return list(found)


def _own_handles() -> list[str]:
    targets = []
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to tell by
        return []
    for fd in fds:
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    try:
        with open("/proc/self/maps") as maps:
            return device_handles(targets, maps)
    except OSError:
        return device_handles(targets, ())


def cuda_started() -> str:
    """Why the CUDA driver counts as started in this process, or "" when it does not."""
    handles = _own_handles()
    if handles:
        return f"holds {', '.join(handles)} open"
    torch_cuda = sys.modules.get("torch.cuda")
    if torch_cuda is not None:
        try:
            if torch_cuda.is_initialized():
                return "torch.cuda.is_initialized() is True"
        except Exception:  # a broken or partial torch: the handles said enough
            pass
    return ""


def note_import(module: str) -> None:
    """After the zygote imported ``module``: remember it if it was the one that started CUDA."""
    if not _cuda_by and cuda_started():
        _cuda_by.append(module)


def _where(frame: FrameType | None) -> str:
    """``module M at import (file:line)``, for the innermost module-level code on the stack
    (the import that started it, however deep the call), else the caller's ``file:line``."""
    caller = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename != threading.__file__ and caller is None:
            caller = f"{code.co_filename}:{frame.f_lineno}"
        if code.co_name == "<module>" and caller is not None:
            module = frame.f_globals.get("__name__", "?")
            return f"module {module} started it at import ({caller})"
        frame = frame.f_back
    return f"started at {caller}" if caller else ""


@contextlib.contextmanager
def recording_thread_starts() -> Iterator[None]:
    """While the zygote imports: note where each ``threading.Thread`` is started from.

    ``Thread.start`` is wrapped for the duration only (the ranks forked later run the plain
    one); threads started with ``_thread`` directly are not counted by ``threading`` either.
    """
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        _starts[self] = _where(sys._getframe(1))
        original(self)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


def _runs(thread: threading.Thread) -> str:
    """What the thread runs: its target, or its class's ``run``."""
    target: Any = getattr(thread, "_target", None)
    if target is None and type(thread).run is not threading.Thread.run:
        target = type(thread).run
    if target is None:
        return ""
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module else str(name)


def describe_thread(thread: threading.Thread) -> str:
    """``thread 'NAME' (runs TARGET; module M started it at import (file:line))``."""
    details = [d for d in (f"runs {_runs(thread)}" if _runs(thread) else "",
                           _starts.get(thread, "")) if d]
    return f"thread {thread.name!r}" + (f" ({'; '.join(details)})" if details else "")


def fork_safety() -> tuple[bool, str]:
    """Whether a fork now gives a child that works as a fresh interpreter would; why not."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        return False, "; ".join(describe_thread(t) for t in others)
    cuda = cuda_started()
    if cuda:
        by = f"module {_cuda_by[0]} started" if _cuda_by else "an imported module started"
        return False, f"{by} the CUDA driver at import (the process {cuda})"
    return True, ""

"""What a signal would do to a process, read before sending it (HARDENING.md rule 8).

``%dist_stacks`` asks a rank's interpreter for its stacks with ``SIGUSR2``, on which the rank's
runtime registered ``faulthandler`` (``runtime.register_stack_dumps``). But a library may have
reset it to its default action (which terminates the process), ignored or blocked it; and even
a handled signal cuts short what some system calls are doing: ``sleep()`` called from C (a
ctypes ``libc.sleep``, a C extension's wait) returns early, whatever ``SA_RESTART`` says
(signal(7): "never restarted"). Python's own waits retry (PEP 475), C code often does not.

:func:`hazard` reads the process's dispositions (``/proc/PID/status``: ``SigBlk``, ``SigIgn``,
``SigCgt``, per thread for the blocked mask) and what each thread is blocked in
(``/proc/PID/task/TID/syscall``), and says why the signal must not be sent, or "" when it is
safe. Linux only; elsewhere (no ``/proc``) it cannot know and says so. Standard library only:
the rank's supervisor imports it on the rank's host.
"""

from __future__ import annotations

import os
import platform
import signal

#: System calls that a caught signal interrupts whatever ``SA_RESTART`` says (signal(7)), by
#: machine: number → name. Python's calls retry them (PEP 475); C code that waits in them may
#: end early (a ``sleep()`` returns with time left).
_NOT_RESTARTED: dict[str, dict[int, str]] = {
    "x86_64": {7: "poll", 23: "select", 34: "pause", 35: "nanosleep", 128: "rt_sigtimedwait",
               130: "rt_sigsuspend", 208: "io_getevents", 220: "semtimedop",
               230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6", 271: "ppoll",
               281: "epoll_pwait", 441: "epoll_pwait2"},
    "aarch64": {4: "io_getevents", 22: "epoll_pwait", 72: "pselect6", 73: "ppoll",
                101: "nanosleep", 115: "clock_nanosleep", 133: "rt_sigsuspend",
                137: "rt_sigtimedwait", 192: "semtimedop", 441: "epoll_pwait2"},
}


def _masks(path: str) -> dict[str, int]:
    """The ``Sig*`` masks of a ``/proc/.../status`` file (hexadecimal, bit n-1 = signal n)."""
    out: dict[str, int] = {}
    with open(path, encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigBlk", "SigIgn", "SigCgt"):
                out[key] = int(value.strip(), 16)
    return out


def _threads(pid: int) -> list[str]:
    try:
        return sorted(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def hazard(pid: int, signum: int = signal.SIGUSR2) -> str:
    """Why sending ``signum`` to ``pid`` could hurt it or be lost; "" when it is safe.

    Unsafe: the signal's default action (it would end the process), ignored (lost), blocked
    in every thread (never delivered), or a thread waiting in a system call that the signal
    would cut short (``_NOT_RESTARTED``). Unknown (no ``/proc``, a thread's system call
    unreadable) counts as unsafe: the caller has other ways that send nothing.
    """
    name = signal.Signals(signum).name
    bit = 1 << (signum - 1)
    try:
        masks = _masks(f"/proc/{pid}/status")
    except (OSError, ValueError):
        return f"its signal dispositions cannot be read (no /proc/{pid}/status here)"
    if masks.get("SigIgn", 0) & bit:
        return f"it ignores {name}"
    if not masks.get("SigCgt", 0) & bit:
        return (f"its {name} is at the default action, which would end it (a library reset "
                f"the handler nbdist set)")
    tids = _threads(pid)
    blocked = 0
    for tid in tids:
        try:
            if _masks(f"/proc/{pid}/task/{tid}/status").get("SigBlk", 0) & bit:
                blocked += 1
        except (OSError, ValueError):
            pass  # the thread ended meanwhile
    if tids and blocked == len(tids):
        return f"every thread of it blocks {name}"
    calls = _NOT_RESTARTED.get(platform.machine(), {})
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", encoding="ascii") as f:
                first = f.read().split(" ", 1)[0].strip()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            return f"what its threads wait in cannot be read ({exc.strerror})"
        if not first.isdigit():  # "running", or "-1": not in a system call
            continue
        call = calls.get(int(first))
        if call is None and not calls:
            return f"what its threads wait in is not known on {platform.machine()}"
        if call is not None:
            return (f"its thread {tid} waits in {call}(), which {name} would cut short (a "
                    f"sleep() called from C would return early)")
    return ""

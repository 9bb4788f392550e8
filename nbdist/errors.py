"""nbdist's exceptions.

The tree::

    Exception
     ├── NbdistError            nbdist itself could not do what was asked
     │    ├── CaptureError      a name the cell uses cannot be shipped to the ranks
     │    ├── CapacityError     more ranks than the backend can run at once
     │    ├── LaunchError       a backend could not start the ranks
     │    ├── SessionError      the session cannot run the cell: broken, stopped or busy
     │    └── ValuesDroppedError  a finished job's values were let go to bound memory
     ├── RuntimeError
     │    └── DistributedError  one or more ranks failed, timed out or were cancelled
     └── SyntaxError
          └── CellSyntaxError   the cell is not valid Python (shown without nbdist's frames)

    UserWarning
     ├── CaptureWarning         a value the cell uses is large (every rank gets a copy)
     ├── OutputLostWarning      ranks ran, but their live output did not reach the notebook
     └── PullWarning            a pulled value may mix moments: threads of the rank ran

Bad user input to a magic is IPython's own ``UsageError``, raised by ``magics.py``.
This module is imported on ranks: standard library only.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from enum import Enum

from nbdist.hints import with_hint

#: How many lines of a remote traceback IPython shows per failed rank before eliding the middle.
_MAX_TB_LINES = 60


class NbdistError(Exception):
    """nbdist could not do what was asked (not a failure of the user's code on a rank)."""


class _MessageOnly:
    """An error IPython shows as its message alone: nbdist's frames say nothing about the
    cell, and the message names the fix."""

    def _render_traceback_(self) -> list[str]:
        return f"{type(self).__name__}: {self}".splitlines()


class CaptureError(_MessageOnly, NbdistError):
    """A name the cell uses cannot be shipped to the ranks, or the cell cannot run on one."""


class CellSyntaxError(SyntaxError):
    """A ``SyntaxError`` in a distributed cell, shown as IPython shows one in a normal cell."""

    def _render_traceback_(self) -> list[str]:
        import traceback

        plain = SyntaxError(*self.args)  # formatted under its usual name
        return "".join(traceback.format_exception_only(plain)).splitlines()


class ValuesDroppedError(_MessageOnly, NbdistError):
    """A finished job's values were let go to bound the kernel's memory (``settings.history_mb``).
    """


class CaptureWarning(UserWarning):
    """A value the cell uses is large: every rank receives a copy when it starts."""


class PullWarning(UserWarning):
    """``%dist_pull`` read a value while threads that the session's cells started were running
    on that rank: if they change it, what came back may mix moments (torn)."""


class OutputLostWarning(UserWarning):
    """Ranks could not reach (or lost) the driver's event channel: they ran and their results
    came back through the backend, but their live output, progress and metrics were lost."""


class CapacityError(NbdistError):
    """More ranks were asked for than the backend can run at the same time."""


class SessionError(_MessageOnly, NbdistError):
    """The session cannot run the cell: it is broken, stopped, or busy with another cell."""


class LaunchError(NbdistError):
    """A backend could not start the ranks."""


#: What to do about the operating system's usual refusals to start processes.
_LAUNCH_FIXES = {
    errno.EAGAIN: "the machine refused more processes: check the process limit (ulimit -u) "
                  "and free memory, or run fewer ranks",
    errno.ENOMEM: "the machine is out of memory: free some (a kernel's large values, another "
                  "notebook) or run fewer ranks",
    errno.EMFILE: "this kernel has too many files open: raise the limit (ulimit -n) or close "
                  "what the notebook keeps open, then restart the kernel",
    errno.ENFILE: "the machine has too many files open: close some, then run the cell again",
    errno.ENOSPC: "a disk is full (the temporary folder, or --log-dir): free some space",
    errno.EACCES: "permission denied: check who owns the path and its mode",
    errno.EPERM: "not permitted: check who owns the path and its mode",
}


def launch_failed(np: int, where: str, exc: OSError) -> LaunchError:
    """The :class:`LaunchError` for an ``OSError`` met while starting ``np`` ranks on the
    backend ``where``: what failed, on which path, and what to do about it."""
    code = errno.errorcode.get(exc.errno or 0, "")
    what = f"{exc.strerror or exc}" + (f" ({code})" if code else "")
    if exc.filename is not None:
        what += f": {exc.filename!r}"
    fix = _LAUNCH_FIXES.get(exc.errno or 0, "an error of the operating system; fix it and "
                            "run the cell again (%dist_status lists what is still running)")
    backend = "its backend" if where == "auto" else f"the {where} backend"
    return LaunchError(f"could not start the {abs(np)} ranks on {backend}: {what}. {fix}")


class Reason(str, Enum):
    """Why a :class:`DistributedError` ended its job; a ``str``, so ``error.reason ==
    "timeout"`` holds as it did when the reason was a word."""

    FAILED = "failed"  # a rank failed (an exception, a signal, a lost host)
    TIMEOUT = "timeout"  # the job ran past --timeout
    CANCELLED = "cancelled"  # stopped: by the user, the stop button, a session's interrupt

    def __str__(self) -> str:
        return self.value


class DistributedError(RuntimeError):
    """One or more ranks of a distributed job failed, timed out or were cancelled.

    Attributes
    ----------
    job_id : str
        The job that failed.
    reason : Reason
        ``Reason.FAILED``, ``Reason.TIMEOUT`` or ``Reason.CANCELLED`` (a ``str`` enum: equal
        to ``"failed"``, ``"timeout"``, ``"cancelled"``).
    failures : dict[int, str]
        Rank → remote traceback (or the exit status and last output lines) of every rank that
        failed on its own; ranks that nbdist tore down afterwards are not in it. A failure
        nbdist knows the fix for ends with a line starting ``nbdist hint:`` (``hints.py``).
    stacks : str
        Where every rank was when nbdist stopped the job (a timeout, a cancel): the ranks'
        stacks, grouped (``nbdist.stacks``); "" when none were taken.
    """

    def __init__(
        self,
        message: str,
        *,
        job_id: str = "",
        reason: Reason | str = Reason.FAILED,
        failures: Mapping[int, str] | None = None,
        stacks: str = "",
    ) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.reason = Reason(reason)
        self.failures = {rank: with_hint(text) for rank, text in (failures or {}).items()}
        self.stacks = stacks

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (str(self), self.job_id, self.reason.value, self.failures,
                           self.stacks))

    def _render_traceback_(self) -> list[str]:
        """Let IPython show the ranks' tracebacks instead of nbdist's own frames."""
        lines = [f"DistributedError: {self}"]
        for rank, text in sorted(self.failures.items()):
            body = text.rstrip("\n").splitlines()
            if len(body) > _MAX_TB_LINES:
                half = _MAX_TB_LINES // 2
                cut = len(body) - 2 * half
                body = [*body[:half], f"    ... {cut} lines elided ...", *body[-half:]]
            lines.append("")
            lines.append(f"--- rank {rank} " + "-" * 60)
            lines.extend(body)
        if self.stacks:
            lines.append("")
            lines.append("--- where the ranks were when nbdist stopped them " + "-" * 26)
            lines.extend(self.stacks.splitlines())
        return lines


def _rebuild(message: str, job_id: str, reason: str, failures: dict[int, str],
             stacks: str = "") -> DistributedError:
    return DistributedError(message, job_id=job_id, reason=reason, failures=failures,
                            stacks=stacks)

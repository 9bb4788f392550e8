"""Why a rank died: the kernel's out-of-memory killer, told apart from any other SIGKILL.

A SIGKILL says nothing of who sent it. The kernel's OOM killer leaves two kinds of evidence,
read here on the rank's host by its supervisor once the rank died of SIGKILL:

- the ``oom_kill`` count of the memory cgroups the rank was seen in (cgroup v2
  ``memory.events``, v1 ``memory.oom_control``) went up since they were first seen
  (:class:`OomWatch`, fed by the resources sampler), and
- the kernel's log (``/dev/kmsg``, where it can be read) has ``Killed process PID``: then also
  the memory the process held when it was killed.

Standard library only: it runs beside the rank, in Spark's Python workers too.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
KMSG = "/dev/kmsg"
#: How far the kernel log's clock and ``CLOCK_MONOTONIC_RAW`` may disagree.
LOG_CLOCK_SLACK_S = 1.0
#: ``Killed process 1234 (python) total-vm:...kB, anon-rss:...kB, file-rss:...kB, shmem-rss:...kB``
_KILLED = re.compile(r"Killed process (\d+) \(([^)]*)\)(.*)")
_RSS = re.compile(r"(anon|file|shmem)-rss:\s*(\d+)kB")


@dataclass(frozen=True)
class OomKill:
    """Evidence that the OOM killer killed a rank: where it was seen, and the memory it held
    when it was killed (bytes, from the kernel's log) where known."""

    evidence: str
    rss: int | None = None


def memory_cgroup(pid: int) -> str | None:
    """The folder of the memory cgroup ``pid`` is in (v1's memory controller, else v2's)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return os.path.join(CGROUP_ROOT, "memory", path.lstrip("/"))
        if controllers == "":
            unified = os.path.join(CGROUP_ROOT, path.lstrip("/"))
    return unified


def oom_kills(folder: str) -> int | None:
    """The cgroup's count of processes the OOM killer killed in it, or None if unreadable."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


class OomWatch:
    """The memory cgroups a rank's processes were seen in, with their ``oom_kill`` counts then.

    ``see`` is called with the rank's pid at every resources sample (a rank may move itself,
    or be moved, into another cgroup); ``killed`` asks, once the rank died of SIGKILL.
    """

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        #: When the watch began (the kernel log's clock): an older record is not this rank's,
        #: whatever pid it names (pids are reused: 32768 of them on many hosts).
        self.since = log_clock()

    def see(self, pid: int) -> None:
        folder = memory_cgroup(pid)
        if folder is None:
            return
        with self._lock:
            if folder in self._counts:
                return
        count = oom_kills(folder)
        if count is not None:
            with self._lock:
                self._counts.setdefault(folder, count)

    def killed(self, pid: int | None) -> OomKill | None:
        """Evidence that the OOM killer killed ``pid`` (the rank's process), or None."""
        logged = kernel_log_kill(pid, since=self.since) if pid is not None else None
        if logged is not None:
            return logged
        with self._lock:
            counts = dict(self._counts)
        for folder, before in counts.items():
            now = oom_kills(folder)
            if now is not None and now > before:
                return OomKill(f"the oom_kill count of its memory cgroup {folder} went from "
                               f"{before} to {now}")
        return None


def log_clock() -> float:
    """Now on the kernel log's clock (seconds since boot, not slewed by NTP)."""
    return time.clock_gettime(time.CLOCK_MONOTONIC_RAW)


def kernel_log_kill(pid: int, path: str = KMSG, since: float = 0.0) -> OomKill | None:
    """The kernel log's ``Killed process PID`` record, where the log can be read; only records
    logged after ``since`` (``log_clock``; less a second of slack between the two clocks)
    count: an older one is of another process that had the same pid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found: OomKill | None = None
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # read to the end
            except OSError:  # EPIPE: records overwritten while reading; go on
                continue
            if not record:
                break
            for line in record.decode("utf-8", "replace").splitlines():
                # "priority,sequence,microseconds since boot,flags;message"; continuation
                # lines (" KEY=value") have no ";" before their text.
                head, semi, message = line.partition(";")
                fields = head.split(",")
                if not semi or len(fields) < 3 or not fields[2].isdigit():
                    continue
                if int(fields[2]) / 1e6 < since - LOG_CLOCK_SLACK_S:
                    continue
                hit = _KILLED.search(message)
                if hit and int(hit.group(1)) == pid:
                    kb = [int(v) for _, v in _RSS.findall(hit.group(3))]
                    found = OomKill(f"the kernel's log: {message.strip()}",
                                    sum(kb) * 1024 if kb else None)
    finally:
        os.close(fd)
    return found

"""Every line of every rank in a file per rank: complete where the panel keeps the last lines.

A job writes what each rank prints (stdout and stderr, as they arrive on the event channel, in
the order they arrive) to ``DIR/rank-R.log``; ``DIR`` is ``--log-dir DIR`` or, by default, a
folder of the job under the system's temporary folder (:func:`default_dir`), which
``%dist_status JOB`` names. Each batch of lines is one ``write`` on a descriptor opened for
appending, unbuffered: what the driver received is in the file, also while the job runs and if
the kernel dies. A job that restarts (``--max-restarts``) appends each attempt to the same files.
``%dist_status JOB --rank R --lines N`` reads the end of one (:func:`tail`).
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nbdist.state import JobState

#: This kernel's folder of default log folders: one kernel's job ids (``j1``, ``j2``) are not
#: those of the next, so each kernel has its own.
_KERNEL = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def default_dir(job_id: str) -> str:
    """Where a job's logs go without ``--log-dir``: ``$TMPDIR/nbdist-logs/KERNEL/JOB``."""
    return os.path.join(tempfile.gettempdir(), "nbdist-logs", _KERNEL, job_id)


def rank_file(folder: str, rank: int) -> str:
    """The file of one rank's output in ``folder``."""
    return os.path.join(folder, f"rank-{rank}.log")


class RankLogs:
    """The log files of one job's ranks, opened as each rank first prints; safe from any thread.

    A folder that cannot be written is reported once (``error``) and the job runs on.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.error: str | None = None
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False

    def write(self, rank: int, text: str) -> None:
        """Append ``text`` (lines as the rank printed them) to ``rank``'s file."""
        data = text.encode("utf-8", "backslashreplace")
        with self._lock:
            fd = self._fds.get(rank)
            if fd is None:
                if self._closed or self.error is not None:
                    return
                try:
                    os.makedirs(self.folder, exist_ok=True)
                    fd = os.open(rank_file(self.folder, rank),
                                 os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                except OSError as exc:
                    self.error = f"cannot write the ranks' logs to {self.folder}: {exc}"
                    return
                self._fds[rank] = fd
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:  # a full disk: the job goes on, its logs stop
                self.error = f"writing rank {rank}'s log in {self.folder} failed: {exc}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


#: The folder of a job's log folder that holds its ranks' flight recorder dumps.
FLIGHT_RECORDS = "flight-recorder"


def write_flight_records(folder: str, dumps: Mapping[int, str]) -> str:
    """Write each rank's flight recorder dump (torch's JSON) as ``FOLDER/flight-recorder/
    rank_R``, in the pickle format torch's analyser reads
    (``python -m torch.distributed.flight_recorder.fr_trace FOLDER/flight-recorder``); say
    where, or why not. Files are opened without following links, never blocking."""
    import json
    import pickle

    where = os.path.join(folder, FLIGHT_RECORDS)
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        st = os.lstat(where)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return (f"the flight recorder dumps were not written: {where} is not a folder "
                    f"of ours that only we can write")
        for rank, text in sorted(dumps.items()):
            try:
                data = pickle.dumps(json.loads(text), protocol=4)
            except (ValueError, RecursionError):
                continue
            path = os.path.join(where, f"rank_{rank}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                         | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return f"the flight recorder dumps were not written: {path} is not a file"
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
    except OSError as exc:
        return f"the flight recorder dumps were not written to {where}: {exc}"
    return f"flight recorder dumps: {where}"


def tail(path: str, lines: int, block: int = 1 << 16) -> list[str]:
    """The last ``lines`` lines of a file, read from its end (a log may be gigabytes)."""
    if lines <= 0:
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    text = data.decode("utf-8", "replace")
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    if pos > 0:
        parts = parts[1:]  # the first may be the end of a line cut by the block
    return [p.rstrip("\r").rsplit("\r", 1)[-1] for p in parts[-lines:]]


def tail_text(job: JobState, rank: int, lines: int) -> str:
    """``%dist_status JOB --rank R --lines N``: the end of rank R's log, headed by its path.

    Raises ValueError (a usage error) for a rank the job does not have or a job without logs.
    """
    if not 0 <= rank < job.np:
        raise ValueError(f"job {job.id} has ranks 0 to {job.np - 1}, not {rank}")
    if job.log_dir is None:
        raise ValueError(f"job {job.id} keeps no log files")
    path = rank_file(job.log_dir, rank)
    try:
        got = tail(path, lines)
    except FileNotFoundError:
        return f"rank {rank} of job {job.id} printed nothing (no {path})"
    head = f"{path}: its last {len(got)} lines" if got else f"{path}: empty"
    return "\n".join([head, *got])

"""Every line of every rank in a file per rank: complete where the panel keeps the last lines.

A job writes what each rank prints (stdout and stderr, as they arrive on the event channel, in
the order they arrive) to ``DIR/rank-R.log``; ``DIR`` is ``--log-dir DIR`` or, by default, a
folder of the job in this user's private folder under the system's temporary folder
(:func:`default_dir`: ``$TMPDIR/nbdist-logs-<uid>``, made 0700 and checked before each use by
``nbdist.tmpdirs``), which ``%dist_status JOB`` names. Each batch of lines is one ``write`` on a
descriptor opened for appending, unbuffered: what the driver received is in the file, also
while the job runs and if the kernel dies. A job that restarts (``--max-restarts``) appends
each attempt to the same files. ``%dist_status JOB --rank R --lines N`` reads the end of one
(:func:`tail`).

The files are opened and written by a thread of the job's own (:class:`RankLogs`), never on
the kernel's event server, which serves every job: a slow or hung file system stalls this
job's log files only. A file is opened without following a link and without blocking
(``O_NOFOLLOW | O_NONBLOCK``) and must be a regular file: a link, a FIFO or a device put at
``rank-R.log`` is refused, named in the error. A log that cannot be written is said
(``JobState.log_error``: the panel's header, the text view, ``%dist_status``); the job runs on.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from nbdist import tmpdirs

if TYPE_CHECKING:
    from nbdist.state import JobState

#: This kernel's folder of default log folders: one kernel's job ids (``j1``, ``j2``) are not
#: those of the next, so each kernel has its own.
_KERNEL = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
#: Bytes of lines waiting for a job's log writer at most; beyond, lines are dropped (and said).
MAX_PENDING_BYTES = 64 << 20
#: How long the end of a job waits for its log writer to write what it was given.
CLOSE_WAIT_S = 5.0


def root_name() -> str:
    """The name of this user's private folder of default log folders in the temporary folder."""
    return f"nbdist-logs-{os.getuid()}"


def default_dir(job_id: str) -> str:
    """Where a job's logs go without ``--log-dir``: ``$TMPDIR/nbdist-logs-<uid>/KERNEL/JOB``
    (a path: nothing is made until a rank prints)."""
    return os.path.join(tempfile.gettempdir(), root_name(), _KERNEL, job_id)


def for_job(job_id: str, log_dir: str | None,
            on_error: Callable[[str], None] | None = None) -> RankLogs:
    """The log files of job ``job_id``: in ``log_dir`` (``--log-dir``), else in
    :func:`default_dir` under this user's private folder, checked before each file is opened."""
    if log_dir:
        return RankLogs(log_dir, None, on_error)
    return RankLogs(default_dir(job_id), os.path.join(tempfile.gettempdir(), root_name()),
                    on_error)


def rank_file(folder: str, rank: int) -> str:
    """The file of one rank's output in ``folder``."""
    return os.path.join(folder, f"rank-{rank}.log")


class LogFileError(OSError):
    """A log file that nbdist will not write: not a regular file, or a link."""


def open_log(path: str) -> int:
    """A descriptor appending to ``path`` (made 0600 if new): never through a link, never
    blocking on a FIFO; :class:`LogFileError` naming the path for anything but a regular file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                     | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LogFileError(exc.errno, f"{path} is a symbolic link (nbdist does not write "
                                          f"through links)") from exc
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise LogFileError(exc.errno, f"{path} is a named pipe (FIFO), not a regular "
                                          f"file") from exc
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise LogFileError(0, f"{path} is {what}, not a regular file")
    os.set_blocking(fd, True)
    return fd


class RankLogs:
    """The log files of one job's ranks, opened as each rank first prints.

    :meth:`write` only queues (any thread, never blocks); a thread of its own, started with
    the first line, makes the folder, opens the files and writes. A folder or file that
    cannot be written is reported once (``error``, and ``on_error``) and the job runs on.

    Parameters
    ----------
    folder : str
        Where the files go.
    private_root : str or None
        A private folder (``tmpdirs``) of the temporary folder that ``folder`` lies in,
        checked before each file is opened; None for a folder the user chose.
    on_error : callable or None
        Told the error, once.
    """

    def __init__(self, folder: str, private_root: str | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.folder = folder
        self.private_root = private_root
        self.error: str | None = None
        self._on_error = on_error
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._pending = 0
        self._dropped = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def write(self, rank: int, text: str) -> None:
        """Queue ``text`` (lines as the rank printed them) for ``rank``'s file."""
        data = text.encode("utf-8", "backslashreplace")
        with self._lock:
            if self._closed or self.error is not None:
                return
            if self._pending + len(data) > MAX_PENDING_BYTES:
                self._dropped += len(data)
                return
            self._pending += len(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"nbdist-logs-{os.path.basename(self.folder)}")
                self._thread.start()
        self._queue.put((rank, data))

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """No more lines; wait up to ``timeout`` for those queued to be written (not at all on
        the event server's thread), then the files close as the writer finishes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        self._queue.put(None)
        if threading.current_thread().name != "nbdist-events":
            thread.join(timeout)

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = message
        if self._on_error is not None:
            self._on_error(message)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                rank, data = item
                with self._lock:
                    self._pending -= len(data)
                    dropped, self._dropped = self._dropped, 0
                if self.error is not None:
                    continue
                if dropped:
                    self._fail(f"the ranks' log files in {self.folder} fell behind their output: "
                               f"{dropped} bytes were not written, and no more are")
                    continue
                self._write(rank, data)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _write(self, rank: int, data: bytes) -> None:
        fd = self._fds.get(rank)
        if fd is None:
            path = rank_file(self.folder, rank)
            try:
                if self.private_root is not None:
                    tmpdirs.private_dir(os.path.basename(self.private_root),
                                        os.path.dirname(self.private_root))
                os.makedirs(self.folder, mode=0o700, exist_ok=True)
                fd = open_log(path)
            except OSError as exc:
                self._fail(f"cannot write the ranks' log files in {self.folder}: "
                           f"{exc.strerror or exc}" if not isinstance(exc, LogFileError) else
                           f"cannot write rank {rank}'s log file: {exc.strerror}")
                return
            self._fds[rank] = fd
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:  # a full disk: the job goes on, its logs stop
            self._fail(f"writing rank {rank}'s log in {self.folder} failed: "
                       f"{exc.strerror or exc}")


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
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LogFileError(0, f"{path} is not a regular file")
    with os.fdopen(fd, "rb") as f:
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
        if job.log_error:
            return f"rank {rank} of job {job.id} has no log file: {job.log_error}"
        return f"rank {rank} of job {job.id} printed nothing (no {path})"
    except OSError as exc:  # a link (ELOOP), a FIFO or a device put there
        why = exc.strerror if isinstance(exc, LogFileError) else f"{path}: {exc.strerror or exc}"
        raise ValueError(f"cannot read rank {rank}'s log: {why}") from exc
    head = f"{path}: its last {len(got)} lines" if got else f"{path}: empty"
    return "\n".join([head, *got])

"""Files and folders another local user, or an unlucky notebook, can reach (HARDENING.md rules
1-4): nbdist's folders under the shared temporary folder are private and checked, a reused
shipped-code folder is verified, and log files are never written through a link, never block
and never on the event server's thread."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbdist
from nbdist import job as jobs
from nbdist import logfiles, tmpdirs
from nbdist.options import JobOptions
from nbdist.protocol import CallPayload, ShippedCode, code_digest
from nbdist.rank import executor_zygote, localcode
from nbdist.views import status, widget
from nbdist.views.text import TextView

from .helpers import Gate, running_job, wait_for
from .hostile import fifo, strangers_folder


@pytest.fixture
def tmp_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The temporary folder of this process is a new folder (``tempfile.gettempdir``), with a
    short path (the zygotes' socket folder moves to /tmp from one of over 60 characters)."""
    root = tempfile.mkdtemp(prefix="nbdist-t-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield Path(root)
    shutil.rmtree(root, ignore_errors=True)


def _logs_in_default_folder() -> str:
    """Write a line to a job's default log folder; the error said, or ""."""
    logs = logfiles.for_job("j1", None)
    logs.write(0, "secret\n")
    logs.close()
    return logs.error or ""


MAKERS: dict[str, tuple[str, Callable[[], object]]] = {
    "shipped code": (f"nbdist-code-{os.getuid()}", localcode.code_root),
    "executor zygote sockets": (f"nbdist-{os.getuid()}", executor_zygote.socket_dir),
}


@pytest.mark.parametrize("what", sorted(MAKERS))
def test_a_folder_another_user_made_first_is_refused(tmp_root: Path, what: str) -> None:
    """Each of nbdist's folders under the temporary folder, made first by another user
    (theirs, 0777), is refused with an error naming it; so are a link and our own 0777 one."""
    name, make = MAKERS[what]
    path = strangers_folder(str(tmp_root / name))
    with pytest.raises(tmpdirs.NotPrivateError, match=f"{path} belongs to uid 65534"):
        make()
    os.rmdir(path)
    os.mkdir(path, 0o700)
    os.chmod(path, 0o777)
    with pytest.raises(tmpdirs.NotPrivateError, match="has mode 0777, not 0700"):
        make()
    os.rmdir(path)
    (tmp_root / "mine").mkdir(mode=0o700)
    os.symlink(tmp_root / "mine", path)
    with pytest.raises(tmpdirs.NotPrivateError, match="is a symbolic link"):
        make()


def test_a_folder_made_fresh_is_private(tmp_root: Path) -> None:
    """A folder nbdist makes is ours and 0700 even under a permissive umask, and reused."""
    old = os.umask(0)
    try:
        path = tmpdirs.private_dir("nbdist-test-1")
    finally:
        os.umask(old)
    st = os.lstat(path)
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert tmpdirs.private_dir("nbdist-test-1") == path


def test_a_log_folder_another_user_made_first_is_not_written(tmp_root: Path) -> None:
    """The default log root made first by another user is not written to, and the job's log
    error names it (it was ``$TMPDIR/nbdist-logs``, shared by every user)."""
    root = Path(logfiles.default_dir("j1")).parents[1]
    strangers_folder(str(root))
    error = _logs_in_default_folder()
    assert not any(p.is_file() for p in root.rglob("*")), list(root.rglob("*"))
    assert f"{root} belongs to uid 65534" in error, error


def test_default_logs_go_to_a_private_folder(tmp_root: Path) -> None:
    """Without ``--log-dir`` the logs are in this user's 0700 folder of the temporary folder."""
    assert _logs_in_default_folder() == ""
    root = Path(logfiles.default_dir("j1")).parents[1]
    assert root.name == f"nbdist-logs-{os.getuid()}"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert Path(logfiles.default_dir("j1"), "rank-0.log").read_text() == "secret\n"


def _code(files: dict[str, bytes]) -> ShippedCode:
    items = tuple(sorted(files.items()))
    return ShippedCode(code_digest(items), items, ())


def test_a_tampered_digest_folder_is_written_anew(tmp_root: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A digest folder reused by a later install is verified: a changed file, a file that was
    not shipped (it would shadow a module) and a link are replaced by the shipped files."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    code = _code({"helpers.py": b"X = 1\n", "pkg/__init__.py": b""})
    target = Path(localcode.install(code))
    (target / "helpers.py").write_text("X = 'attacker'\n")
    (target / "json.py").write_text("raise SystemExit\n")
    assert Path(localcode.install(code)) == target
    assert (target / "helpers.py").read_text() == "X = 1\n"
    assert not (target / "json.py").exists()
    (target / "pkg" / "__init__.py").unlink()
    os.symlink("/etc/hostname", target / "pkg" / "__init__.py")
    localcode.install(code)
    assert not (target / "pkg" / "__init__.py").is_symlink()
    with pytest.raises(ValueError, match="do not match its digest"):
        localcode.install(ShippedCode(code.digest, (("helpers.py", b"X = 2\n"),), ()))


# -- log files ------------------------------------------------------------------------------------
def test_a_link_or_fifo_at_a_rank_log_is_refused(tmp_path: Path) -> None:
    """``rank-R.log`` that is a link is never followed, and a FIFO (read or not) never blocks:
    each is a clear error naming the path."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for name, make in [("link", lambda p: os.symlink(victim, p)), ("fifo", fifo)]:
        folder = tmp_path / name
        folder.mkdir()
        make(str(folder / "rank-0.log"))
        logs = logfiles.RankLogs(str(folder))
        logs.write(0, "rank output\n")
        logs.close()
        assert logs.error is not None and str(folder / "rank-0.log") in logs.error, logs.error
    assert victim.read_text() == "precious\n"
    folder = tmp_path / "fifo"
    reader = os.open(folder / "rank-0.log", os.O_RDONLY | os.O_NONBLOCK)  # a reader: opens
    try:
        logs = logfiles.RankLogs(str(folder))
        logs.write(0, "rank output\n")
        logs.close()
        assert logs.error is not None and "is a named pipe (FIFO)" in logs.error, logs.error
    finally:
        os.close(reader)


def test_an_unwritable_log_folder_is_said_everywhere() -> None:
    """A log error is in the panel's header, the text view, ``%dist_status`` and the panes,
    which no longer name the files that were never written."""
    import io

    job = running_job(2)
    job.log_dir = "/nowhere/j77"
    job.set_log_error("cannot write the ranks' log files in /nowhere/j77: Not a directory")
    for r in range(2):
        job.apply(r, {"t": "out", "s": "o", "text": "".join(f"{i}\n" for i in range(1500))})
    assert "cannot write the ranks&#x27; log files" in status.header_html(job)
    assert "logs: cannot write the ranks' log files" in status.ranks_table(job)
    assert "rank-R.log" not in status.ranks_table(job)
    out = io.StringIO()
    TextView(job, out).update()
    assert "[nbdist] cannot write the ranks' log files in /nowhere/j77" in out.getvalue()
    panel = widget.Panel(job)
    try:
        pane = panel._pane_html(0)
        assert "earlier lines not shown" in pane and "/nowhere" not in pane, pane[:300]
    finally:
        panel.close()


def _print_then_wait(gate: Gate, word: str) -> str:
    print(word, flush=True)
    gate.wait()
    return word


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fifo_log_stalls_neither_its_job_nor_another_jobs_output(tmp_path: Path) -> None:
    """A job whose ``rank-0.log`` is a FIFO nobody reads runs on (the log error said), and
    another job's live output still arrives meanwhile: the file is opened off the event
    server's thread and without blocking."""
    folder = tmp_path / "logs"
    folder.mkdir()
    pipe = fifo(str(folder / "rank-0.log"))
    gate = Gate(tmp_path / "gate")
    payload: CallPayload = {"kind": "call", "code": None, "fn": _print_then_wait,
                            "args": (gate, "first"), "kwargs": {}}
    first = jobs.start(payload, 1, JobOptions(backend="local", log_dir=str(folder)))
    try:
        wait_for(lambda: first.state.ranks[0].lines >= 1, 60, "the first job's line")
        second = nbdist.run(_print_then_wait, gate, "second", np=1, backend="local")
        wait_for(lambda: second.state.ranks[0].lines >= 1, 60,
                 "the second job's live output while the first job's log is a FIFO")
        gate.open()
        assert first.result(timeout=60) == "first" and second.result(timeout=60) == "second"
        assert first.state.log_error is not None and pipe in first.state.log_error
    finally:
        gate.open()
        # Unblocks an event server stuck opening the FIFO (before the fix), so later tests run:
        # a writer waiting in open() goes on once a reader opened, even one gone at once.
        os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))


def test_reading_a_rank_log_that_is_a_fifo_or_a_link_is_refused(tmp_path: Path) -> None:
    """``%dist_status JOB --rank R`` reads neither a FIFO (it blocked the notebook) nor through
    a link: a usage error naming the file."""
    job = running_job(2)
    job.log_dir = str(tmp_path)
    fifo(str(tmp_path / "rank-0.log"))
    os.symlink("/etc/hostname", tmp_path / "rank-1.log")
    with pytest.raises(ValueError, match=f"{tmp_path}/rank-0.log is not a regular file"):
        logfiles.tail_text(job, 0, 5)
    with pytest.raises(ValueError, match=f"{tmp_path}/rank-1.log: Too many levels"):
        logfiles.tail_text(job, 1, 5)

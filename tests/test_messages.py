"""The messages issue 43 found weak say what happened, with the values, and what to do next."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist import job as jobs
from nbdist import session as sessions
from nbdist.errors import LaunchError, SessionError, launch_failed
from nbdist.launch import backends
from nbdist.options import JobOptions

from .helpers import Gate, run


def test_cancel_of_an_unknown_job_says_none_runs_and_where_the_jobs_are(ip: Any) -> None:
    """%dist_cancel j999 with nothing running names the newest job and %dist_status."""
    run(ip, "%%distributed -np 1 --quiet\n1\n")
    newest = jobs.jobs()[-1].id
    with pytest.raises(UsageError, match=rf"no job 'j999' in this kernel, and none is running "
                                         rf"\(the newest, {newest}, ended\); %dist_status lists "
                                         rf"every job"):
        run(ip, "%dist_cancel j999")


def test_cancel_of_an_unknown_job_names_the_running_one(ip: Any, gate: Gate) -> None:
    """%dist_cancel j999 while a job runs names that job and the command that cancels it."""
    job = nbdist.run(gate.wait, np=1)
    try:
        with pytest.raises(UsageError, match=rf"running now: .*{job.id}.* \(e\.g\. "
                                             rf"%dist_cancel {job.id}\)"):
            run(ip, "%dist_cancel j999   # a comment is not an argument")
    finally:
        gate.open()
    assert job.result(timeout=120) is None


@pytest.mark.parametrize(("line", "message"), [
    ("%dist_cancel j1 j2", r"%dist_cancel takes one job, not 2 arguments \('j1' 'j2'\); cancel "
                           r"them one at a time"),
    ("%dist_cancel --all", r"%dist_cancel takes no options, not '--all'"),
])
def test_cancel_refuses_what_it_would_have_ignored(ip: Any, line: str, message: str) -> None:
    """Extra arguments and options of %dist_cancel are usage errors, not silently ignored."""
    with pytest.raises(UsageError, match=message):
        run(ip, line)


def test_a_timeout_that_is_not_positive_shows_the_value_given() -> None:
    """nbdist.run(timeout=-1) and JobOptions(timeout=0) name the value they refuse."""
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, not -1"):
        nbdist.run(print, np=1, timeout=-1)
    with pytest.raises(ValueError, match=r"not 0\b"):
        JobOptions(timeout=0).check()


@pytest.mark.parametrize(("code", "fix"), [
    (errno.EMFILE, "too many files open: raise the limit (ulimit -n)"),
    (errno.EAGAIN, "check the process limit (ulimit -u)"),
    (errno.ENOSPC, "a disk is full"),
    (errno.EIO, "an error of the operating system; fix it and run the cell again"),
])
def test_a_launch_that_fails_says_what_failed_and_what_to_do(code: int, fix: str) -> None:
    """An OSError while starting ranks becomes a LaunchError with the count, the backend, the
    error's name and path, and a next step."""
    error = launch_failed(4, "local", OSError(code, "it failed", "/tmp/x"))
    assert isinstance(error, LaunchError)
    text = str(error)
    assert text.startswith(f"could not start the 4 ranks on the local backend: it failed "
                           f"({errno.errorcode[code]}): '/tmp/x'. ")
    assert fix in text


@pytest.mark.slow
@pytest.mark.usefixtures("no_session")
def test_a_session_start_that_times_out_names_the_ranks_not_ready(tmp_path: Path,
                                                                  gate: Gate) -> None:
    """A session whose ranks are not all ready in time names each one not ready, and stops."""
    # Every interpreter of the ranks' environment (a zygote, a fresh rank) waits at the gate
    # as it starts (site imports sitecustomize), so no rank is ready until the test opens it.
    (tmp_path / "sitecustomize.py").write_text(gate.code())
    launcher, n = backends.choose(2, "local")
    live = sessions.Session(n, launcher, JobOptions(env={"PYTHONPATH": str(tmp_path)}))
    try:
        with pytest.raises(SessionError, match=rf"only 0 of 2 ranks were ready after 0.5 s; not "
                                               rf"ready: ranks 0 \(.*\), 1 \(.*\)\. It was "
                                               rf"stopped; %dist_status {live.id} shows"):
            live.wait_ready(0.5)
    finally:
        gate.open()
    assert live.wait(60)


@pytest.mark.fresh_pool
def test_warm_at_load_set_in_the_notebook_says_what_it_does(ip: Any, capsys: Any) -> None:
    """%config DistMagics.warm_at_load after the load is not silent: False says it was read at
    load and how to set it, True starts the zygote or says why there is none to start."""
    try:
        run(ip, "%config DistMagics.warm_at_load = False")
        said = capsys.readouterr().out
        assert "read at %load_ext nbdist" in said and "NBDIST_WARM_AT_LOAD=0" in said
        run(ip, "%config DistMagics.warm_at_load = True")  # the tests set NBDIST_WARM_AT_LOAD=0
        assert "nbdist: no zygote to start" in capsys.readouterr().out
    finally:
        ip.run_line_magic("config", "DistMagics.warm_at_load = True")

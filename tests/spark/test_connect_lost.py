"""A Spark Connect server killed while a job runs on it (issue 36, HARDENING.md rule 12): the job
ends within a bounded time naming the cause, and later cells work."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbdist
from nbdist.errors import CapacityError, DistributedError
from nbdist.launch import spark as spark_backend

from ..helpers import Gate, wait_for
from ..sparks import ConnectServer, Sparks

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.usefixtures("no_leftover_spark_ranks"),
              pytest.mark.xdist_group("spark-cluster")]  # its server runs on the cluster


@pytest.fixture
def doomed(sparks: Sparks, tmp_path: Path) -> Iterator[ConnectServer]:
    """A Connect server of this test's own (the test kills it), and a client session on it."""
    sparks.stop_session()
    sparks.launch_cluster()
    assert sparks.cluster is not None
    sparks.cluster.wait()
    saved = {k: os.environ.get(k) for k in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED",
                                            "SPARK_LOCAL_REMOTE")}
    server = ConnectServer(tmp_path, sparks.cluster)
    try:
        server.connect()
        yield server
    finally:
        session, server.session = server.session, None
        if session is not None:
            # Not session.stop(): on a dead server it retries for minutes, holding the lock
            # that the next session's getOrCreate() takes. Its channel is closed locally.
            with contextlib.suppress(Exception):
                session.client._channel.close()
            _forget(session)
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget(session: Any) -> None:
    """No later test finds the dead session as the active one."""
    cls = type(session)
    for attr in ("_active_session", "_default_session"):
        holder = getattr(cls, attr, None)
        if isinstance(holder, threading.local):
            holder.__dict__.clear()
        elif holder is session:
            setattr(cls, attr, None)


def _wait_at(gate: Gate) -> int:
    print("waiting", flush=True)
    gate.wait()
    return 1


def test_a_killed_connect_server_ends_its_jobs_and_names_it(
        doomed: ConnectServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killing the Connect server under two jobs: the watched one (2 ranks) fails within
    seconds, well before its timeout, naming the server; the unwatched one (1 rank: a server
    behind a proxy looks alive) ends at its timeout plus the stated grace; a later Spark cell
    is refused at once with the fix, and local ranks still run."""
    watch = spark_backend.SparkLauncher._watch_server
    monkeypatch.setattr(spark_backend.SparkLauncher, "_watch_server",
                        lambda self, req: None if req.np == 1 else watch(self, req))
    gate = Gate(tmp_path / "gate")
    watched = nbdist.run(_wait_at, gate, np=2, backend="spark", gpu=False, timeout=300)
    unwatched = nbdist.run(_wait_at, gate, np=1, backend="spark", gpu=False, timeout=60)
    try:
        wait_for(lambda: all(r.lines >= 1 for job in (watched, unwatched)
                             for r in job.state.ranks), 240, "every rank running")
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(30)
        assert watched.wait(60), "the job did not end after its Connect server was killed"
        with pytest.raises(DistributedError, match=f"Spark Connect server at 127.0.0.1:"
                                                   f"{doomed.port} is gone"):
            watched.result(0)
        grace = spark_backend.CANCEL_GRACE_S + spark_backend.GIVE_UP_S
        assert unwatched.wait(60 + grace + 60), "the job outlived its timeout and grace"
        with pytest.raises(DistributedError, match="timed out after 60 s"):
            unwatched.result(0)
    finally:
        gate.open()
    # Refused when the cell starts: no job is made, so no rank ran.
    with pytest.raises(CapacityError, match="is gone .*-np -N"):
        nbdist.run(_wait_at, gate, np=2, backend="spark", gpu=False, timeout=60)
    assert nbdist.run(_wait_at, gate, np=1, backend="local", gpu=False).result(60) == 1

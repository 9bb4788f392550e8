"""Warm ranks on Spark executors: a zygote per executor, owned by the application."""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist import timeline
from nbdist.rank import executor_zygote

from .. import hostile
from ..helpers import wait_for
from ..sparks import MARK, Sparks, marked_rank_processes

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not executor_zygote.supported(), reason="Linux only")]


_fresh: set[str] = set()


def fresh_application(sparks: Sparks, mark: str, kind: str) -> SparkSession:
    """A session of ``kind`` in a new application, once the last one's zygotes are gone: the
    earlier tests' jobs (other environments) left zygotes on its executors, up to
    ``MAX_PER_EXECUTOR`` each, and these tests count them."""
    sparks.stop_session()
    _none_within(lambda: zygotes(mark), "the last application's zygotes to go with it")
    return sparks.local() if kind == "local" else sparks.standalone()


def _fresh_once(sparks: Sparks, mark: str, kind: str) -> SparkSession:
    if kind in _fresh:
        return sparks.local() if kind == "local" else sparks.standalone()
    _fresh.add(kind)
    return fresh_application(sparks, mark, kind)


@pytest.fixture
def spark_local(sparks: Sparks, spark_mark: str) -> SparkSession:
    """``local[2]``, as the shared fixture, in an application of this module's own."""
    return _fresh_once(sparks, spark_mark, "local")


@pytest.fixture
def spark_cluster(sparks: Sparks, spark_mark: str) -> SparkSession:
    """The standalone cluster's session, as the shared fixture, in an application of this
    module's own."""
    return _fresh_once(sparks, spark_mark, "standalone")


def _rank() -> dict[str, Any]:
    import os
    import random
    import sys

    import torch

    pipes = set()  # the pipes this rank holds: its own four, nothing of another rank's
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("pipe:"):
            pipes.add(link)
    return {"pid": os.getpid(), "ppid": os.getppid(), "rand": torch.rand(1).item(),
            "py": random.random(), "rank": os.environ["RANK"], "extra": os.environ.get("EXTRA"),
            "torch_at_start": "torch" in sys.modules, "pipes": sorted(pipes)}


def zygotes(mark: str) -> list[psutil.Process]:
    """The executor zygotes of this test session, anywhere on the machine."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == mark
                    and executor_zygote.COMMAND in " ".join(proc.cmdline())):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _forked(job: Any) -> list[bool]:
    return [timeline.FORKED in r.marks for r in job.state.ranks]


def _until_forked(np: int, tries: int = 6, fn: Any = _rank, **kwargs: Any) -> Any:
    """Run ``fn`` until a job has every rank forked from an executor zygote (the first run
    starts them; a zygote still importing makes a task wait, never fail)."""
    for _ in range(tries):
        job = nbdist.run(fn, np=np, backend="spark", **kwargs)
        results = job.results
        assert len(results) == np
        if all("pipes" in r for r in results):  # no rank holds another's pipes
            held = [p for r in results for p in r["pipes"]]
            assert len(held) == len(set(held)), f"ranks share pipes: {results}"
        if all(_forked(job)):
            return job
    raise AssertionError(f"no run of {tries} had all its ranks forked from executor zygotes")


def test_later_runs_fork_their_ranks_from_the_executors_zygote(
    spark_local: SparkSession, spark_mark: str,
) -> None:
    """After the first run, ranks are forked from the executor's zygote: fresh random state on
    every rank and run, the job's environment, and the timeline shows the fork."""
    first = nbdist.run(_rank, np=2, backend="spark")
    before = first.results
    job = _until_forked(2, env={"EXTRA": "x"})
    results = job.results
    (zygote,) = [z for z in zygotes(spark_mark) if z.pid == results[0]["ppid"]]
    assert {r["ppid"] for r in results} == {zygote.pid}
    assert [r["rank"] for r in results] == ["0", "1"]
    assert [r["extra"] for r in results] == ["x", "x"]
    assert all(r["torch_at_start"] for r in results), "torch was not preloaded"
    draws = [r["rand"] for r in [*before, *results]] + [r["py"] for r in [*before, *results]]
    assert len(set(draws)) == len(draws), "two ranks drew the same random numbers"
    again = _until_forked(2, env={"EXTRA": "x"})
    assert {r["ppid"] for r in again.results} == {zygote.pid}, "the zygote was not reused"
    assert {r["rand"] for r in again.results}.isdisjoint(r["rand"] for r in results)
    # Another environment: its own zygote, never the one holding EXTRA=x.
    plain = _until_forked(2).results
    assert [r["extra"] for r in plain] == [None, None]
    assert zygote.pid not in {r["ppid"] for r in plain}, "forked from another env's zygote"
    for rank in job.state.ranks:
        names = [p.name for p in timeline.phases(rank.rank, rank.marks)]
        assert "fork from executor zygote" in names


def installed_here(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A ``site-packages`` folder of the test's own and the job environment that puts it on
    the ranks' PYTHONPATH (what it holds counts as installed there). Never the environment's
    own site-packages: a file written there changes the installation's stamp for every test
    running beside this one (another xdist worker's zygotes would all be stale at once)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    return site, {"PYTHONPATH": str(site)}


def test_an_installed_module_edited_between_runs_is_never_stale_on_an_executor(
    spark_local: SparkSession, spark_mark: str, tmp_path: Path,
) -> None:
    """A module in site-packages that the executor's zygote preloaded, edited in place (what a
    pip install on the executors does): the next run has the edit, and later runs are forked
    from a new zygote that has it."""
    from ..test_warm_pool import _edit

    def value() -> dict[str, object]:
        import os

        import nbdist_sitemod_spark  # type: ignore[import-not-found]
        import torch  # noqa: F401  (so that the zygote has something worth keeping)

        return {"value": nbdist_sitemod_spark.VALUE, "parent": os.getppid()}

    # Zygotes of earlier tests (other environments) hold the executor's two places: start
    # from none.
    _stop_zygotes(spark_mark)
    site, env = installed_here(tmp_path)
    module = site / "nbdist_sitemod_spark.py"
    module.write_text("VALUE = 1\n")
    try:
        first = _until_forked(2, fn=value, env=env).results
        assert [r["value"] for r in first] == [1, 1]
        _edit(module, "VALUE = 22\n")
        second = nbdist.run(value, np=2, backend="spark", env=env).results
        assert [r["value"] for r in second] == [22, 22]
        third = _until_forked(2, fn=value, env=env).results
        assert [r["value"] for r in third] == [22, 22]
        assert {r["parent"] for r in third}.isdisjoint(r["parent"] for r in first), \
            "a rank was forked from the stale zygote"
    finally:
        _stop_zygotes(spark_mark)  # stale now that the module is gone: no test after gets one


def _maps_libcuda() -> dict[str, object]:
    import os

    import nbdist_maps_libcuda_spark  # type: ignore[import-not-found]  # noqa: F401

    return {"parent": os.getppid()}


def _threaded() -> int:
    import nbdist_threaded_spark  # type: ignore[import-not-found]  # noqa: F401

    return 1


def test_the_executors_zygote_judges_fork_safety_by_the_cuda_driver_and_says_why(
    spark_local: SparkSession, spark_mark: str, tmp_path: Path,
) -> None:
    """An installed module that maps a ``libcuda.so.1`` at import and starts no driver: the
    executor's zygote still forks; one that starts a thread: the ranks start fresh, and the
    job's ranks say why (no zygote yet; the zygote's thread, named)."""
    from ..test_fork_safety import _fake_libcuda

    lib = _fake_libcuda(tmp_path)
    _stop_zygotes(spark_mark)
    site, env = installed_here(tmp_path)
    modules = {site / "nbdist_maps_libcuda_spark.py": f"import ctypes\nctypes.CDLL({str(lib)!r})\n",
               site / "nbdist_threaded_spark.py": "import threading\nthreading.Thread(target="
               "threading.Event().wait, daemon=True, name='poller').start()\n"}
    for path, source in modules.items():
        path.write_text(source)
    try:
        first = nbdist.run(_maps_libcuda, np=2, backend="spark", env=env)
        assert len(first.results) == 2
        assert [(r.start, r.start_why) for r in first.state.ranks] == [
            ("fresh", "no zygote on this executor yet (this task leaves one behind for the "
                      "next runs)")] * 2
        job = _until_forked(2, fn=_maps_libcuda, env=env)
        (parent,) = {r["parent"] for r in job.results}
        with open(f"/proc/{parent}/maps") as maps:
            assert str(lib) in maps.read()  # the zygote that forked them maps it
        assert [r.start for r in job.state.ranks] == ["forked", "forked"]
        refused = "the executor's zygote cannot fork: thread 'poller' (runs threading.Event.wait"
        for _ in range(6):  # the first runs leave a zygote behind, which imports the module
            threaded = nbdist.run(_threaded, np=2, backend="spark", env=env)
            assert threaded.results == [1, 1]
            whys = [r.start_why for r in threaded.state.ranks]
            if all(why.startswith(refused) for why in whys):
                break
        else:
            raise AssertionError(f"no run's ranks said the zygote cannot fork: {whys}")
        assert "module nbdist_threaded_spark started it at import" in whys[0]
        assert [r.start for r in threaded.state.ranks] == ["fresh", "fresh"]
    finally:
        _stop_zygotes(spark_mark)


def _stop_zygotes(mark: str) -> None:
    for old in zygotes(mark):
        old.terminate()
    _none_within(lambda: zygotes(mark), "the zygotes to go")


def test_a_stranger_without_the_applications_secret_is_refused(
    spark_local: SparkSession, spark_mark: str,
) -> None:
    """A connection that cannot answer the challenge with the application's secret is closed
    and gets no rank."""
    _until_forked(2)
    directory = executor_zygote.socket_dir()
    assert os.stat(directory).st_mode & 0o777 == 0o700
    paths = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".sock")]
    tried = 0
    for path in paths:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(60)
            try:
                sock.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):  # one that went meanwhile
                continue
            tried += 1
            challenge = json.loads(sock.recv(1 << 16))
            wrong = executor_zygote.mac("not the secret", challenge["nonce"])
            sock.send(json.dumps({"t": "hello", "mac": wrong, "modules": []}).encode())
            assert sock.recv(1 << 16) == b"", "the zygote answered a wrong MAC"
    assert tried, f"no live zygote socket among {paths}"


def _listening(zygote: psutil.Process) -> list[str]:
    """The Unix socket a zygote listens on (bound as ``<path>.<pid>``, then renamed)."""
    staged = f".sock.{zygote.pid}"
    return [c.laddr[:-len(staged)] + ".sock" for c in zygote.net_connections(kind="unix")
            if isinstance(c.laddr, str) and c.laddr.endswith(staged)]


def _hostile_packets_leave_the_zygotes_serving(session: SparkSession, mark: str, np: int) -> None:
    from nbdist.launch import APP_SECRETS

    first = _until_forked(np)
    secret = APP_SECRETS[session.sparkContext.applicationId]
    mine = {z.pid for z in zygotes(mark)} & {r["ppid"] for r in first.results}
    assert mine, "no zygote forked this application's ranks"
    cases = hostile.zygote_malformed(secret)
    for pid in mine:
        (path,) = _listening(psutil.Process(pid))
        assert hostile.zygote_send_each(path, cases) == []
        assert hostile.zygote_rejected(path, secret) >= len(cases)
    job = _until_forked(np, tries=1)
    assert {r["ppid"] for r in job.results} <= mine, "a zygote was lost to the attack"
    assert {z.pid for z in zygotes(mark)} >= mine


def test_hostile_packets_leave_the_zygote_serving_on_local_spark(
    spark_local: SparkSession, spark_mark: str,
) -> None:
    """Garbage, deep nesting, huge, cut-short and non-UTF-8 packets, some with pipes, on the
    executor zygote's socket (no secret needed to send them): each connection is closed and
    counted, and the next job's ranks are forked from the same zygote (before: one packet
    of 5000 `[` killed it and the ranks it had forked)."""
    _hostile_packets_leave_the_zygotes_serving(spark_local, spark_mark, 2)


def test_an_idle_zygote_goes(
    spark_local: SparkSession, spark_mark: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An executor zygote nobody asked for a rank for NBDIST_WARM_IDLE_S seconds goes."""
    _stop_zygotes(spark_mark)  # started with the default idle time by earlier tests
    monkeypatch.setenv("NBDIST_WARM_IDLE_S", "5")  # read on the driver at each launch
    _until_forked(2)
    (zygote,) = zygotes(spark_mark)
    (path,) = _listening(zygote)  # its own: other checkouts' zygotes of this uid share the folder
    wait_for(lambda: not zygote.is_running(), 60, "the idle zygote to go")
    assert not os.path.exists(path), "the zygote left its socket behind"
    assert not os.path.exists(path[:-5] + ".lock"), "the zygote left its lock file behind"


def _executor_jvms(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get(MARK) == mark
                    and "CoarseGrainedExecutorBackend" in " ".join(proc.cmdline())):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _none_within(find: Any, what: str, within: float = 120.0) -> None:
    wait_for(lambda: not find(), within, what)


def test_hostile_packets_leave_every_zygote_serving_on_the_standalone_cluster(
    spark_cluster: SparkSession, spark_mark: str,
) -> None:
    """The same attack on the zygote of each executor of the standalone cluster: each serves
    on, and the next job's four ranks are forked from them."""
    _hostile_packets_leave_the_zygotes_serving(spark_cluster, spark_mark, 4)


def test_stopping_the_session_leaves_no_zygote_on_any_worker(
    spark_cluster: SparkSession, sparks: Sparks, spark_mark: str,
) -> None:
    """Stop the SparkSession: no nbdist process (zygote, rank) remains on any worker."""
    _until_forked(4)
    assert len(zygotes(spark_mark)) == 2, "not one zygote per executor"
    sparks.stop_session()
    _none_within(lambda: zygotes(spark_mark) + marked_rank_processes(spark_mark),
                 "nbdist processes left after the session stopped")


def _imports_slowly() -> int:
    import nbdist_slow_import_spark  # type: ignore[import-not-found]  # noqa: F401

    return 1


def test_the_applications_end_takes_a_zygote_in_the_middle_of_an_import(
    sparks: Sparks, spark_mark: str, tmp_path: Path,
) -> None:
    """Stop the session while the executor's zygote imports, at nice 19, what the first rank
    reported (an import that takes minutes on a loaded host; CI saw a zygote outlive its
    application by more than 30 s): the zygote goes at once, not when the import ends."""
    site, env = installed_here(tmp_path)
    importing = tmp_path / "importing"
    (site / "nbdist_slow_import_spark.py").write_text(textwrap.dedent(f"""
        import sys, time
        if any("executor_zygote" in arg for arg in sys.orig_argv):  # the zygote's, not a rank's
            open({str(importing)!r}, "w").close()
            time.sleep(600)
    """))
    fresh_application(sparks, spark_mark, "local")
    _fresh.discard("local")  # the next test's gets an application of its own
    try:
        assert nbdist.run(_imports_slowly, np=1, backend="spark", env=env).results == [1]
        wait_for(importing.exists, 120, "the executor's zygote to import the module")
        (zygote,) = zygotes(spark_mark)
        sparks.stop_session()
        wait_for(lambda: not zygote.is_running() or zygote.status() == psutil.STATUS_ZOMBIE,
                 60, "the zygote to go with its application, in the middle of its import")
    finally:
        sparks.stop_session()
        for left in zygotes(spark_mark):
            left.kill()


def _sleeper(ready: str) -> Any:
    def f() -> None:
        import os
        import time

        with open(f"{ready}.{os.environ['RANK']}", "w"):
            pass
        time.sleep(600)

    return f


def test_killing_the_executors_jvm_takes_its_zygote_along(
    spark_cluster: SparkSession, sparks: Sparks, spark_mark: str, tmp_path: Path,
) -> None:
    """SIGKILL the executors' JVMs while ranks forked from their zygotes run: the zygotes
    and the ranks go too, and the job fails naming the lost executors."""
    _until_forked(4)
    before = {z.pid for z in zygotes(spark_mark)}
    assert len(before) == 2
    try:
        job = nbdist.run(_sleeper(str(tmp_path / "ready")), np=4)
        wait_for(lambda: len(list(tmp_path.glob("ready.*"))) == 4, 120, "the ranks to run")
        ranks = marked_rank_processes(spark_mark)
        assert len(ranks) >= 4, ranks
        assert any(p.ppid() in before for p in ranks), "no rank was forked from a zygote"
        for jvm in _executor_jvms(spark_mark):
            jvm.send_signal(signal.SIGKILL)

        def left() -> list[psutil.Process]:
            return [z for z in zygotes(spark_mark) if z.pid in before] + [
                p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

        _none_within(left, "zygotes or ranks left after their executor's JVM was killed")
        with pytest.raises(nbdist.DistributedError, match="executor"):
            job.result(timeout=300)
    finally:
        sparks.stop_session()  # the next test gets a session with live executors

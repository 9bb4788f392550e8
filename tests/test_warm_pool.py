"""Warm ranks: a job's ranks are forked from a zygote that imported their modules once, and the
next job, even right after, starts where they are loaded; warm interpreters where forking is
not safe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import nbdist
from nbdist.launch import local
from nbdist.rank import host

from .helpers import GONE_WITHIN_S

pytestmark = [pytest.mark.timeout(180), pytest.mark.fresh_pool]


def first_job() -> dict[str, int]:
    import os

    import torch  # noqa: F401  (what the next job should find imported)

    return {"pid": os.getpid(), "parent": os.getppid()}


def second_job() -> dict[str, object]:
    import os
    import sys

    preloaded = "torch" in sys.modules
    import torch

    return {"pid": os.getpid(), "parent": os.getppid(), "preloaded": preloaded,
            "rank": os.environ["RANK"], "threads": torch.get_num_threads(),
            "omp": os.environ["OMP_NUM_THREADS"], "usermod": "nbdist_usermod" in sys.modules,
            "session": os.getsid(0)}


@pytest.mark.slow
def test_ranks_are_forked_from_a_zygote_with_their_modules_and_own_environment() -> None:
    """Each rank is a zygote's fork, in its own session, with torch loaded and its own env."""
    pytest.importorskip("torch")
    first = nbdist.run(first_job, np=2).results
    (zygote,) = local.pool.pids()
    assert {r["parent"] for r in first} == {zygote}
    assert "torch" in local.pool.modules
    results = nbdist.run(second_job, np=2).results
    assert {r["parent"] for r in results} == {zygote}
    assert not {r["pid"] for r in results} & {r["pid"] for r in first}
    assert all(r["preloaded"] for r in results)
    assert [r["session"] for r in results] == [r["pid"] for r in results]
    assert [r["rank"] for r in results] == ["0", "1"]
    assert all(r["threads"] == int(str(r["omp"])) for r in results)


@pytest.mark.slow
def test_a_run_right_after_the_last_finds_its_modules_loaded() -> None:
    """The next run, started the moment the last ended, is forked from the same warm zygote."""
    pytest.importorskip("torch")
    first = nbdist.run(first_job, np=2).results

    def no_imports() -> dict[str, object]:  # nothing for the zygote to import at launch
        import os
        import sys

        return {"parent": os.getppid(), "preloaded": "torch" in sys.modules}

    again = nbdist.run(no_imports, np=2).results
    assert {r["parent"] for r in again} == {first[0]["parent"]}
    assert all(r["preloaded"] for r in again)


@pytest.mark.slow
def test_user_modules_are_not_preloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of the user's (which may be edited before the next run) is never preloaded."""
    pytest.importorskip("torch")
    (tmp_path / "nbdist_usermod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def uses_it() -> int:
        import nbdist_usermod
        import torch  # noqa: F401

        return int(nbdist_usermod.VALUE)

    assert nbdist.run(uses_it, np=1).result() == 1
    assert local.pool.wait_ready(timeout=60)
    assert "nbdist_usermod" not in local.pool.modules and "torch" in local.pool.modules
    assert nbdist.run(second_job, np=1).result()["usermod"] is False


@pytest.mark.slow
def test_a_different_environment_gets_its_own_zygote() -> None:
    """A job with other --env values is not forked from a zygote started for another."""
    parent = nbdist.run(first_job, np=1).result()["parent"]
    other = nbdist.run(first_job, np=1, env={"SOMETHING": "else"}).result()["parent"]
    assert other != parent and set(local.pool.pids()) == {parent, other}


def test_a_zygote_that_cannot_fork_safely_gives_way_to_fresh_interpreters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed module that starts a thread at import: the ranks start fresh, and work."""
    site = tmp_path / "site-packages"  # what counts as installed, not the user's own code
    site.mkdir()
    (site / "nbdist_threaded.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True,"
        " name='poller').start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")])))

    def uses_it() -> int:
        import os

        import nbdist_threaded  # noqa: F401
        import psutil

        return psutil.Process(os.getppid()).ppid()  # its guardian's parent

    assert nbdist.run(uses_it, np=2).results == [os.getpid()] * 2  # started by their supervisors
    (zygote,) = local.pool._zygotes.values()
    assert not zygote.safe and zygote.why.startswith(
        "thread 'poller' (runs threading.Event.wait; module nbdist_threaded started it at import")


@pytest.mark.slow
def test_without_zygotes_the_next_job_runs_in_warm_interpreters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NBDIST_ZYGOTE=0: interpreters warmed after a job, with its modules, run the next one."""
    pytest.importorskip("torch")
    monkeypatch.setattr(local, "ZYGOTE", False)
    first = nbdist.run(first_job, np=2).results
    assert local.pool.wait_ready(timeout=60)
    warm = set(local.pool.pids())
    assert len(warm) == 2 and not warm & {r["pid"] for r in first}
    results = nbdist.run(second_job, np=2).results
    assert {r["parent"] for r in results} == warm  # the warm interpreters' guardians
    assert all(r["preloaded"] for r in results)
    assert [r["rank"] for r in results] == ["0", "1"]
    assert all(r["threads"] == int(str(r["omp"])) for r in results)


@pytest.mark.slow
def test_idle_zygotes_and_interpreters_are_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zygotes and warm interpreters idle longer than the limit are killed; none when disabled."""
    monkeypatch.setattr(local, "WARM_IDLE_S", 3.0)
    # What each idle countdown lets go, recorded as it fires: on a busy machine the 3 s may
    # run out before this thread looks at the pool, so the test never races it for a count.
    let_go: dict[int, psutil.Process] = {}
    clearing = [0]  # countdowns letting go right now
    calls = threading.Condition()
    clear = local.pool.clear

    def recording_clear() -> None:
        with calls:
            clearing[0] += 1
        procs = []
        for pid in local.pool.pids():
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        clear()
        with calls:
            let_go.update((p.pid, p) for p in procs)
            clearing[0] -= 1
            calls.notify_all()

    monkeypatch.setattr(local.pool, "clear", recording_clear)
    for zygote in (True, False):
        monkeypatch.setattr(local, "ZYGOTE", zygote)
        let_go.clear()
        ranks = nbdist.run(first_job, np=2).results
        assert local.pool.wait_ready(timeout=60)  # every warm process started (or let go)
        with calls:
            assert calls.wait_for(lambda: not (local.pool.pids() or clearing[0]), 30)
            gone = dict(let_go)
        if zygote:  # the zygote that forked the ranks
            assert {r["parent"] for r in ranks} <= set(gone)
        else:  # one warm interpreter per rank, none of them a rank that ran
            assert len(gone) == 2 and not set(gone) & {r["pid"] for r in ranks}
        _, alive = psutil.wait_procs(list(gone.values()), timeout=10)
        assert not alive
    monkeypatch.setattr(local, "WARM_POOL", False)
    nbdist.run(first_job, np=1).result()
    assert local.pool.wait_ready(timeout=5) and not local.pool.pids()


@pytest.mark.slow
@pytest.mark.parametrize("zygote", [True, False], ids=["forked", "fresh"])
def test_zygote_and_ranks_die_with_the_driver(tmp_path: Path, zygote: bool) -> None:
    """A driver killed with SIGKILL takes its zygote and its running ranks with it, and what
    they started: also a rank stuck in C code that holds the GIL (its watch of the control
    pipe cannot run: its zygote, or the guardian of a fresh rank, kills it), with a child in
    its process group and one in a session of its own."""
    code = textwrap.dedent(f"""
        import os, time
        import nbdist
        from nbdist.launch import local
        local.ZYGOTE = {zygote!r}

        def hang():
            import ctypes, os, subprocess, time
            pids = [os.getpid()]
            if os.environ["RANK"] == "1":
                pids += [subprocess.Popen(["sleep", "600"]).pid,
                         subprocess.Popen(["sleep", "600"], start_new_session=True).pid]
            # Written under another name, then renamed: the driver counts only whole files.
            path = {str(tmp_path)!r} + "/up" + os.environ["RANK"]
            with open(path + ".tmp", "w") as f:
                f.write(" ".join(map(str, pids)))
            os.rename(path + ".tmp", path)
            if os.environ["RANK"] == "1":
                ctypes.PyDLL(None).sleep(600)  # C code that keeps the GIL
            time.sleep(600)

        job = nbdist.run(hang, np=2)
        while len([n for n in os.listdir({str(tmp_path)!r}) if not n.endswith(".tmp")]) < 2:
            time.sleep(0.01)
        print(" ".join(map(str, local.pool.pids())), flush=True)
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == int(zygote)
        ranks = [int(f.read_text().split()[0]) for f in sorted(tmp_path.glob("up*"))]
        pids += [int(p) for f in tmp_path.glob("up*") for p in f.read_text().split()]
        if not zygote:  # each rank's parent: its guardian
            pids += [psutil.Process(p).ppid() for p in ranks]
        # The zygote or the guardians, two ranks, rank 1's two children.
        assert len(set(pids)) == (5 if zygote else 6)
        procs = [psutil.Process(p) for p in pids]
    finally:
        driver.kill()
        driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
    gone, alive = psutil.wait_procs(procs, timeout=GONE_WITHIN_S + host.ORPHANS_GRACE_S)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.slow
def test_a_zygote_in_the_middle_of_a_low_priority_import_dies_with_the_driver(
    tmp_path: Path,
) -> None:
    """A driver killed while its zygote imports ahead at low priority (``%load_ext``'s
    warm-up; one import can take minutes on a loaded host) takes the zygote along at once,
    not when the import ends."""
    site = tmp_path / "site-packages"
    site.mkdir()
    importing = tmp_path / "importing"
    (site / "nbdist_slow_import_local.py").write_text(textwrap.dedent(f"""
        import sys, time
        if any("nbdist.rank.zygote" in arg for arg in sys.orig_argv):  # the zygote only
            open({str(importing)!r}, "w").close()
            time.sleep(600)
    """))
    code = textwrap.dedent(f"""
        import os, threading, time
        from nbdist.launch import local
        threading.Thread(target=local.pool.preload, args=(("nbdist_slow_import_local",),),
                         daemon=True).start()
        while not os.path.exists({str(importing)!r}):
            time.sleep(0.01)
        print(" ".join(map(str, local.pool.pids())), flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert driver.stdout is not None
        (zygote,) = [psutil.Process(int(p)) for p in driver.stdout.readline().split()]
    finally:
        driver.kill()
        driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
    try:
        gone, alive = psutil.wait_procs([zygote], timeout=60)
        assert not alive, "the zygote waited for its import to end"
    finally:
        if zygote.is_running():
            zygote.kill()


@pytest.mark.slow
def test_an_install_between_runs_gets_a_new_zygote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package installed after a run (site-packages changed) is not hidden by the zygote."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    parent = nbdist.run(first_job, np=1).result()["parent"]
    assert nbdist.run(first_job, np=1).result()["parent"] == parent
    (site / "nbdist_fresh_install.py").write_text("")  # what %pip install does to the directory
    stat = site.stat()
    os.utime(site, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert nbdist.run(first_job, np=1).result()["parent"] != parent


def draws() -> dict[str, object]:
    import os
    import random

    import numpy.random
    import torch

    out: dict[str, object] = {
        "parent": os.getppid(), "random": random.random(), "numpy": float(numpy.random.rand()),
        "torch": torch.randperm(8).tolist(),
    }
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    out["seeded"] = [random.random(), float(numpy.random.rand()), torch.randperm(8).tolist()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "NBDIST_ZYGOTE=0"])
def test_forked_ranks_draw_different_random_numbers_unless_seeded(
    zygote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """random, numpy and torch differ per rank and per run, as in fresh interpreters; a seed
    set in the cell still gives every rank the same stream."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    monkeypatch.setattr(local, "ZYGOTE", zygote)
    runs = [nbdist.run(draws, np=2).results for _ in range(2)]
    samples = [r for run in runs for r in run]
    if zygote:  # the zygote imported numpy.random and torch before forking every one of them
        # One zygote forked all four; the pool may hold others (another test's environment in
        # the same worker) and idle interpreters besides it.
        (parent,) = {r["parent"] for r in samples}
        assert parent in local.pool.pids()
        assert {"numpy", "torch"} <= set(local.pool.modules)
    for gen in ("random", "numpy", "torch"):
        assert len({str(r[gen]) for r in samples}) == 4, (gen, [r[gen] for r in samples])
    assert all(r["seeded"] == samples[0]["seeded"] for r in samples)


KERNEL_CHANGES_ITS_ATTRIBUTES = """
import json, os, resource
import nbdist
from nbdist.launch import local

def attributes():
    import os, resource
    with open("/proc/self/status") as status:
        umask = next(line.split()[1] for line in status if line.startswith("Umask:"))
    return {"umask": umask, "affinity": sorted(os.sched_getaffinity(0)),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
            "parent": os.getppid()}

before = nbdist.run(attributes, np=1).result()
local.pool.wait_ready(60)
os.umask(0o027)
os.nice(2)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
if len(os.sched_getaffinity(0)) > 1:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
after = nbdist.run(attributes, np=1).result()
print(json.dumps({"before": before, "after": after, "kernel": attributes(),
                  "zygotes": local.pool.pids()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("zygote", ["1", "0"], ids=["zygote", "NBDIST_ZYGOTE=0"])
def test_ranks_get_the_kernels_umask_affinity_nice_and_limits_at_launch(zygote: str) -> None:
    """After the kernel changed its umask, affinity, nice and a limit, a rank has the new ones."""
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-c", KERNEL_CHANGES_ITS_ATTRIBUTES], capture_output=True, text=True,
        env={**os.environ, "NBDIST_ZYGOTE": zygote}, timeout=150, check=True,
    ).stdout
    seen = json.loads(out.splitlines()[-1])
    kernel = {k: v for k, v in seen["kernel"].items() if k != "parent"}
    assert {k: seen["after"][k] for k in kernel} == kernel
    assert seen["before"]["umask"] != kernel["umask"]  # the change is what was checked
    assert seen["before"]["nice"] != kernel["nice"]
    if zygote == "1":  # forked, from a zygote of the new attributes
        assert seen["after"]["parent"] in seen["zygotes"]


def blas_threads() -> dict[str, object]:
    import os

    import numpy  # noqa: F401  (loads OpenBLAS)
    from threadpoolctl import threadpool_info

    return {"omp": os.environ["OMP_NUM_THREADS"],
            "blas": [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]}


@pytest.mark.slow
@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "NBDIST_ZYGOTE=0"])
def test_blas_thread_pools_follow_omp_num_threads(
    zygote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numpy's BLAS runs OMP_NUM_THREADS threads per rank, also when loaded before the fork."""
    pytest.importorskip("numpy")
    pytest.importorskip("threadpoolctl")
    monkeypatch.setattr(local, "ZYGOTE", zygote)
    for _ in range(2):  # the second run finds numpy loaded (in the zygote, or warm)
        results = nbdist.run(blas_threads, np=2).results
        for r in results:
            assert r["blas"] and all(n == int(str(r["omp"])) for n in r["blas"]), r
    if zygote:
        assert "numpy" in local.pool.modules


def _edit(path: Path, text: str) -> None:
    """Rewrite a module in place (its directory untouched), with a new size and an mtime
    that differs even on a file system of coarse timestamps (set back: not in the future)."""
    before = path.stat().st_mtime_ns
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, before - 10_000_000_000))


def _value_of(module: str) -> Callable[[], dict[str, object]]:
    def value() -> dict[str, object]:
        import importlib
        import os

        import torch  # noqa: F401  (so that the zygote has something worth keeping)

        return {"value": importlib.import_module(module).VALUE, "parent": os.getppid()}

    return value


@pytest.mark.slow
def test_a_notebook_folder_named_like_the_environment_is_not_preloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Code in ``<venv>-notebooks`` is the user's: imported fresh by every run, never kept."""
    pytest.importorskip("torch")
    folder = Path(sys.prefix + f"-notebooks-{os.getpid()}")
    folder.mkdir()
    try:
        (folder / "nbdist_nbmod.py").write_text("VALUE = 1\n")
        monkeypatch.syspath_prepend(str(folder))
        assert nbdist.run(_value_of("nbdist_nbmod"), np=1).result()["value"] == 1
        assert local.pool.wait_ready(timeout=60)
        assert "torch" in local.pool.modules and "nbdist_nbmod" not in local.pool.modules
        _edit(folder / "nbdist_nbmod.py", "VALUE = 22\n")
        assert nbdist.run(_value_of("nbdist_nbmod"), np=1).result()["value"] == 22
    finally:
        shutil.rmtree(folder)


def installed_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``site-packages`` folder of the test's own on the ranks' PYTHONPATH: what it holds
    counts as installed. Never the environment's own site-packages: a file written there
    changes the installation's stamp for every other test running beside this one (another
    xdist worker's zygotes would all be stale at once)."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(site), os.environ.get("PYTHONPATH")])))
    return site


@pytest.mark.slow
def test_a_development_checkout_symlinked_into_site_packages_is_not_preloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A package whose real path is a checkout (symlinked in) is edited code, never kept."""
    pytest.importorskip("torch")
    checkout = tmp_path / "src" / "nbdist_devpkg"
    checkout.mkdir(parents=True)
    (checkout / "__init__.py").write_text("VALUE = 1\n")
    link = installed_here(tmp_path, monkeypatch) / "nbdist_devpkg"
    link.symlink_to(checkout, target_is_directory=True)
    assert nbdist.run(_value_of("nbdist_devpkg"), np=1).result()["value"] == 1
    assert local.pool.wait_ready(timeout=60)
    assert "torch" in local.pool.modules and "nbdist_devpkg" not in local.pool.modules
    _edit(checkout / "__init__.py", "VALUE = 22\n")
    assert nbdist.run(_value_of("nbdist_devpkg"), np=1).result()["value"] == 22


@pytest.mark.slow
def test_a_file_edited_inside_site_packages_gets_a_new_zygote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An installed module the zygote preloaded, edited in place: the next run has the edit."""
    pytest.importorskip("torch")
    module = installed_here(tmp_path, monkeypatch) / "nbdist_sitemod.py"
    module.write_text("VALUE = 1\n")
    first = nbdist.run(_value_of("nbdist_sitemod"), np=1).result()
    assert first["value"] == 1
    assert local.pool.wait_ready(timeout=60)
    assert "nbdist_sitemod" in local.pool.modules  # installed: the zygote holds it
    _edit(module, "VALUE = 22\n")
    second = nbdist.run(_value_of("nbdist_sitemod"), np=1).result()
    assert second["value"] == 22
    # The stale zygote is replaced: the run after is forked from a new one, with the edit.
    third = nbdist.run(_value_of("nbdist_sitemod"), np=1).result()
    assert third["value"] == 22 and third["parent"] in local.pool.pids()
    assert third["parent"] != first["parent"]


def test_a_zygote_imports_what_every_rank_needs_with_the_first_job() -> None:
    """The rank runtime's own modules (cloudpickle, threadpoolctl) come with the first job's
    imports, before its ranks are forked, not after the job, when the next one may be waiting."""
    assert nbdist.run(abs, -1, np=1, gpu=False).result() == 1
    (zygote,) = local.pool._zygotes.values()
    assert set(local.RANK_MODULES) <= zygote.modules


def test_the_packages_a_rank_imported_are_judged_once_per_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rank imported since a moment counts installed packages only, not the user's
    own modules, and each module file is judged once (a session asks after every cell)."""
    import importlib

    from nbdist.rank import host, runtime

    (tmp_path / "mine_nbdist_test.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    host.installation_dirs()  # what it imports (sysconfig) is not the rank's
    before = set(sys.modules) - {"mine_nbdist_test", "wave"}
    importlib.import_module("mine_nbdist_test")
    wave = importlib.import_module("wave")  # the standard library: installed
    monkeypatch.setattr(runtime, "_installed", {})
    judged: list[str] = []
    from nbdist.rank.host import is_installed as real

    def is_installed(path: str, dirs: list[str]) -> bool:
        judged.append(path)
        return real(path, dirs)

    monkeypatch.setattr(runtime, "is_installed", is_installed)
    assert runtime._imported_since(before) == ["wave"]
    assert runtime._imported_since(before) == ["wave"]
    assert sorted(judged) == sorted({str(tmp_path / "mine_nbdist_test.py"), str(wave.__file__)})
    monkeypatch.delitem(sys.modules, "mine_nbdist_test")


def test_a_rank_reports_the_subpackages_it_imported_lazily(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing a package does not import all it has (DDP imports ``torch._dynamo`` on its
    first call): a rank reports the top-level packages, their subpackages one level down,
    and, at any depth, what it imported after its payload's imports under a package loaded
    then; not what importing a package it reports brings anyway. In the order imported."""
    import importlib

    from nbdist.rank import runtime

    pkg = tmp_path / "nbdist_lazypkg"
    for folder in (pkg, pkg / "sub", pkg / "sub" / "deep", pkg / "other"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "sub" / "deep" / "deeper.py").write_text("")
    # Two packages a rank imports after a module that is not imported ahead: one that refers
    # to that module's package (as a library that imports torch), one that does not (sympy).
    for name, text in (("nbdist_lazytied", "from nbdist_lazypkg.sub import deep\n"),
                       ("nbdist_lazyfree", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
        (tmp_path / name / "part.py").write_text("import json\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runtime, "_installed", {})  # as if installed: judged by its file
    monkeypatch.setattr(runtime, "is_installed", lambda path, dirs: True)
    names = [n for n in sys.modules if n.startswith("nbdist_lazy")]
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    before = set(sys.modules)
    try:
        importlib.import_module("nbdist_lazypkg.sub")  # the payload's own import
        base = set(sys.modules)
        importlib.import_module("nbdist_lazypkg.sub.deep.deeper")  # lazily, later
        importlib.import_module("nbdist_lazypkg.other")
        mine = [n for n in runtime._imported_since(before, base) if n.startswith("nbdist_")]
        assert mine == ["nbdist_lazypkg", "nbdist_lazypkg.sub.deep", "nbdist_lazypkg.other"]
        # Without the payload's moment (a fresh rank of a function): one level down only.
        mine = [n for n in runtime._imported_since(before) if n.startswith("nbdist_")]
        assert mine == ["nbdist_lazypkg", "nbdist_lazypkg.sub", "nbdist_lazypkg.other"]
        # What is never imported ahead (torch._dynamo), and what the rank imported after it
        # of its package or of a package that refers to it; not what does not.
        monkeypatch.setattr(runtime, "NOT_AHEAD", ("nbdist_lazypkg.sub.deep",))
        for name in ("nbdist_lazytied.part", "nbdist_lazyfree.part"):
            importlib.import_module(name)
        mine = [n for n in runtime._imported_since(before, base) if n.startswith("nbdist_")]
        assert mine == ["nbdist_lazypkg", "nbdist_lazyfree", "nbdist_lazyfree.part"]
    finally:
        for name in [n for n in sys.modules if n.startswith("nbdist_lazy")]:
            del sys.modules[name]


def had_then_import(name: str) -> dict[str, object]:
    import importlib
    import os
    import sys

    had = name in sys.modules
    importlib.import_module(name)
    return {"had": had, "parent": os.getppid()}


def imports_in_turn(names: list[str]) -> dict[str, bool]:
    import importlib
    import sys

    had = {name: name in sys.modules for name in names}
    for name in names:
        importlib.import_module(name)
    return had


@pytest.mark.slow
def test_the_next_job_does_not_find_torch_dynamo_loaded_nor_what_came_after_it() -> None:
    """``torch._dynamo``, which DDP's constructor imports, is not loaded ahead in the zygote
    (loaded before ``init_process_group`` it made DDP's teardown hang in torch: see
    ``runtime.NOT_AHEAD``), nor what of torch the ranks imported after it; what they imported
    before it is, and after it what does not touch torch (sympy, which it imports itself)."""
    pytest.importorskip("torch")
    names = ["xmlrpc.client", "torch._dynamo", "json.tool", "torch.utils.benchmark", "sympy"]
    first = nbdist.run(imports_in_turn, names, np=2, gpu=False).results
    assert [r["torch._dynamo"] for r in first] == [False, False]
    again = nbdist.run(imports_in_turn, names, np=2, gpu=False)
    assert again.results == [{"xmlrpc.client": True, "torch._dynamo": False, "json.tool": True,
                              "torch.utils.benchmark": False, "sympy": True}] * 2
    assert [r.start for r in again.state.ranks] == ["forked", "forked"], [
        r.start_why for r in again.state.ranks]


def test_the_next_job_finds_loaded_what_a_rank_imported_lazily() -> None:
    """A subpackage the first job's ranks imported as they ran (not named in the code: the
    zygote could not know it) is loaded in the zygote after the job: the next job's ranks,
    forked from it, find it imported."""
    first = nbdist.run(had_then_import, "xmlrpc.client", np=2, gpu=False).results
    assert [r["had"] for r in first] == [False, False]
    (zygote,) = local.pool.pids()
    assert "xmlrpc" in local.pool.modules
    again = nbdist.run(had_then_import, "xmlrpc.client", np=2, gpu=False).results
    assert [r["had"] for r in again] == [True, True]
    assert {r["parent"] for r in again} == {zygote}

"""The notebook's own modules (found through its directory or a non-installed ``sys.path``
entry) travel by value with the payload and import under their own names on the ranks;
installed packages never travel."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbdist
from nbdist import job as jobs
from nbdist.capture import call_code, capture_cell
from nbdist.errors import CaptureWarning, DistributedError
from nbdist.options import JobOptions
from nbdist.protocol import ShippedCode
from nbdist.rank import localcode

from .helpers import run
from .hostile import strangers_folder

HELPERS = "import nbdist_lc_other\n\ndef triple(x):\n    return 3 * nbdist_lc_other.one() * x\n"
OTHER = "def one():\n    return 1\n"
PKG_INIT = "from nbdist_lc_pkg.model import Net\n"
PKG_MODEL = "class Net:\n    def __init__(self, k):\n        self.k = k\n"
NAMES = ("nbdist_lc_helpers", "nbdist_lc_other", "nbdist_lc_pkg", "nbdist_lc_pkg.model")


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on ``sys.path`` (not installed) with a module that imports another module of
    the folder, and a package; none of them imported yet."""
    folder = tmp_path / "src"
    (folder / "nbdist_lc_pkg" / "__pycache__").mkdir(parents=True)
    (folder / "nbdist_lc_helpers.py").write_text(HELPERS)
    (folder / "nbdist_lc_other.py").write_text(OTHER)
    (folder / "nbdist_lc_pkg" / "__init__.py").write_text(PKG_INIT)
    (folder / "nbdist_lc_pkg" / "model.py").write_text(PKG_MODEL)
    (folder / "nbdist_lc_pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"x")
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in NAMES:
        sys.modules.pop(name, None)


def _files(code: ShippedCode | None) -> list[str]:
    assert code is not None
    return [rel for rel, _ in code.files]


def test_the_cells_local_modules_travel_with_what_they_import(src: Path) -> None:
    """A module the cell imports, the local module it imports in turn and the package of a
    notebook value's class travel by value; installed packages and nbdist never do."""
    import nbdist_lc_pkg  # type: ignore[import-not-found]  # made by the fixture

    ns = {"net": nbdist_lc_pkg.Net(4)}
    captured = capture_cell("import json, pytest, nbdist\nimport nbdist_lc_helpers\n"
                            "nbdist_lc_helpers.triple(net.k)\n", ns)
    assert _files(captured.code) == ["nbdist_lc_helpers.py", "nbdist_lc_other.py",
                                     "nbdist_lc_pkg/__init__.py", "nbdist_lc_pkg/model.py"]
    assert captured.payload()["code"] == captured.code
    shown = captured.function_source()
    pkg = len(PKG_INIT) + len(PKG_MODEL)
    total = len(HELPERS) + len(OTHER) + pkg
    assert (f"# the notebook's own modules, shipped by value ({total} B): nbdist_lc_helpers "
            f"({len(HELPERS)} B), nbdist_lc_other ({len(OTHER)} B), nbdist_lc_pkg/ (2 files, "
            f"{pkg} B)") in shown, shown


def test_a_cell_without_local_modules_ships_no_code(src: Path) -> None:
    """A cell that uses only installed packages carries no code."""
    assert capture_cell("import json\njson.dumps([1])\n", {}).code is None


def test_an_edited_module_travels_as_it_is_on_disk(src: Path) -> None:
    """The files are read when the cell is captured: an edit shows in the next capture."""
    first = capture_cell("import nbdist_lc_other\n", {}).code
    (src / "nbdist_lc_other.py").write_text(OTHER + "\nTWO = 2\n")
    second = capture_cell("import nbdist_lc_other\n", {}).code
    assert first is not None and second is not None and first.digest != second.digest
    assert dict(second.files)["nbdist_lc_other.py"].endswith(b"TWO = 2\n")


def test_a_large_tree_warns_like_a_large_value(src: Path) -> None:
    """Local code over the threshold makes capture warn with its size and the fix."""
    with pytest.warns(CaptureWarning, match=r"own modules shipped by value \(nbdist_lc_other "
                                            r"\(24 B\)\) are 24 B, over the 10 B warning"):
        capture_cell("import nbdist_lc_other\n", {}, warn_bytes=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture_cell("import nbdist_lc_other\n", {}, warn_bytes=1000)


def test_a_local_module_that_shadows_an_installed_one_is_warned_about(
        src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``tqdm.py`` beside the notebook that the kernel imports instead of the installed tqdm
    (or a local ``colorsys.py``, a standard module's name) makes capture warn, naming the file:
    the ranks would import the installed one."""
    (src / "tqdm.py").write_text("LOCAL = True\n")
    (src / "colorsys.py").write_text("LOCAL = True\n")
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    import tqdm

    assert getattr(tqdm, "LOCAL", False)
    with pytest.warns(CaptureWarning) as got:
        capture_cell("import tqdm, colorsys\n", {})
    messages = sorted(str(w.message) for w in got)
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"the kernel imports colorsys from the notebook's own "
                                  f"{src / 'colorsys.py'}, which shadows a standard module")
    assert messages[1].startswith(f"the kernel imports tqdm from the notebook's own "
                                  f"{src / 'tqdm.py'}, which shadows an installed package")
    with pytest.warns(CaptureWarning, match="the ranks import the installed tqdm"):
        call_code(_uses_tqdm, (tqdm,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture_cell("import json\n", {})  # the installed json: nothing to say


def _uses_tqdm(module: Any) -> None:
    pass


def test_install_refuses_paths_that_leave_its_folder() -> None:
    """A shipped file whose path climbs out of the code's folder is refused on the rank."""
    with pytest.raises(ValueError, match="bad path '../x.py'"):
        localcode.install(ShippedCode("ab" * 16, (("../x.py", b""),), ()))


@pytest.mark.slow
def test_local_ranks_import_local_modules_they_cannot_find_by_path(ip: Any, src: Path) -> None:
    """With the folder off the ranks' path (PYTHONPATH emptied), a cell's local module, the
    module it imports and a value's local class work on the ranks and in a ``spawn`` child,
    from the shipped copy; ``nbdist.run`` of a local module's function works too."""
    run(ip, "import nbdist_lc_pkg\nnet = nbdist_lc_pkg.Net(4)\n")
    try:
        value = run(ip, """%%distributed -np 2 --env PYTHONPATH=
import multiprocessing as mp
import nbdist_lc_helpers
with mp.get_context("spawn").Pool(1) as pool:
    child = pool.apply(nbdist_lc_helpers.triple, (2,))
(nbdist_lc_helpers.triple(net.k), child, nbdist_lc_helpers.__file__, type(net).__module__)
""")
    finally:
        ip.user_ns.pop("net", None)
        ip.user_ns.pop("nbdist_lc_pkg", None)
    assert value[:2] == (12, 6) and value[3] == "nbdist_lc_pkg.model"
    assert value[2].startswith(localcode.code_root()), value[2]
    import nbdist_lc_helpers  # type: ignore[import-not-found]  # made by the fixture

    job = nbdist.run(nbdist_lc_helpers.triple, 5, np=2, backend="local",
                     env={"PYTHONPATH": ""})
    assert job.results == [15, 15]


@pytest.mark.slow
def test_without_shipped_code_the_rank_cannot_import_them(src: Path) -> None:
    """The same payload without its code fails on the ranks with ModuleNotFoundError (what
    the shipped code prevents)."""
    payload = capture_cell("import nbdist_lc_helpers\n", {}).payload()
    payload["code"] = None
    job = jobs.start(payload, 1, JobOptions(backend="local", env={"PYTHONPATH": ""}))
    with pytest.raises(DistributedError, match="No module named 'nbdist_lc_helpers'"):
        job.result()


@pytest.mark.slow
def test_ranks_never_import_a_tampered_file_of_a_reused_code_folder(src: Path,
                                                                    tmp_path: Path) -> None:
    """A ``helpers.py`` changed in the digest folder a first run wrote is not imported by the
    next run of the same code: the ranks verify the folder and run the shipped file."""
    env = {"PYTHONPATH": "", "TMPDIR": str(tmp_path)}
    payload = capture_cell("import nbdist_lc_helpers\nnbdist_lc_helpers.triple(2)\n",
                           {}).payload()
    assert jobs.start(payload, 1, JobOptions(backend="local", env=env)).result() == 6
    code = payload["code"]
    assert code is not None
    folder = tmp_path / f"nbdist-code-{os.getuid()}" / code.digest
    (folder / "nbdist_lc_helpers.py").write_text("def triple(x):\n    return 'attacker'\n")
    assert jobs.start(payload, 1, JobOptions(backend="local", env=env)).result() == 6
    assert (folder / "nbdist_lc_helpers.py").read_text() == HELPERS


@pytest.mark.slow
def test_ranks_refuse_a_code_folder_another_user_made_first(src: Path, tmp_path: Path) -> None:
    """The ranks do not write or import shipped code in a ``nbdist-code-<uid>`` that another
    user made first (0777): the job fails naming the folder."""
    folder = strangers_folder(str(tmp_path / f"nbdist-code-{os.getuid()}"))
    payload = capture_cell("import nbdist_lc_helpers\nnbdist_lc_helpers.triple(2)\n",
                           {}).payload()
    job = jobs.start(payload, 1, JobOptions(backend="local",
                                            env={"PYTHONPATH": "", "TMPDIR": str(tmp_path)}))
    with pytest.raises(DistributedError, match=f"{folder} belongs to uid 65534"):
        job.result()
    assert os.listdir(folder) == []


@pytest.mark.slow
def test_a_large_local_package_is_not_kept_after_its_job(src: Path) -> None:
    """A package's large data file travels, but neither capture's cache nor the finished job
    (its backend's rank specs and work) keeps its bytes or the payload's pickle
    (benchmarks/bench_big_code.py measures the kernel's memory)."""
    from nbdist.capture import _local

    big = src / "nbdist_lc_pkg" / "weights.bin"
    big.write_bytes(b"w" * (_local.CACHE_FILE_BYTES + 1))
    payload = capture_cell("import nbdist_lc_pkg\nlen(nbdist_lc_pkg.__name__)\n", {}).payload()
    code = payload["code"]
    assert code is not None and "nbdist_lc_pkg/weights.bin" in dict(code.files)
    assert _local._cache[str(big)][2] is None
    job = jobs.start(payload, 2, JobOptions(backend="local", env={"PYTHONPATH": ""}))
    assert job.result(timeout=120) == len("nbdist_lc_pkg")
    sups = job.launcher._supervisors  # type: ignore[attr-defined]  # the local backend's
    assert len(sups) == 2
    assert all(s.spec.payload == b"" and s._work._payload == b"" for s in sups)

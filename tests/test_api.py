"""The public surface: small, explicit, and importable without the optional extras."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import nbdist


def test_exported_members() -> None:
    """nbdist.__all__ is exactly the documented public API."""
    assert sorted(nbdist.__all__) == sorted([
        "CapacityError", "CaptureError", "DistributedError", "Handle", "LaunchError",
        "NbdistError", "SessionError", "ValuesDroppedError", "CaptureWarning",
        "OutputLostWarning", "PullWarning", "checkpoint_dir",
        "load_ipython_extension", "progress", "report", "run", "shard", "unload_ipython_extension",
    ])
    for name in nbdist.__all__:
        assert getattr(nbdist, name) is not None
    assert issubclass(nbdist.DistributedError, RuntimeError)


def test_every_exception_and_warning_of_nbdist_errors_is_exported_and_in_the_tree() -> None:
    """Each public exception or warning class of nbdist.errors is in nbdist.__all__ (but the
    SyntaxError subclass IPython shows as its own) and drawn in the module's tree."""
    import inspect

    from nbdist import errors

    classes = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, (Exception, Warning))
               and value.__module__ == errors.__name__ and not name.startswith("_")}
    assert classes - {"CellSyntaxError"} <= set(nbdist.__all__)
    tree = errors.__doc__ or ""
    assert [name for name in sorted(classes) if f" {name} " not in tree] == []


@pytest.mark.slow
def test_import_and_load_ext_work_without_torch_or_pyspark() -> None:
    """`import nbdist` and `%load_ext nbdist` need neither torch nor pyspark, nor import them."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['pyspark'] = None\n"
        "import nbdist\n"
        "from IPython.testing.globalipapp import start_ipython\n"
        "ip = start_ipython(); ip.run_line_magic('load_ext', 'nbdist')\n"
        "assert 'distributed' in ip.magics_manager.magics['cell']\n"
        "print(nbdist.run(lambda: 6 * 7, np=1).result())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("42")


def test_rank_side_modules_stay_light() -> None:
    """The rank's interpreter imports neither IPython nor ipywidgets."""
    code = (
        "import sys\nimport nbdist.rank.runtime, nbdist.rank.supervisor\n"
        "heavy = ('IPython', 'ipywidgets', 'pyspark', 'torch')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_the_version_is_stated_once_in_its_module_and_matches_the_package_metadata() -> None:
    """``nbdist.__version__`` is ``_version.__version__``, the number pyproject.toml gives."""
    import re

    from nbdist._version import __version__

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    stated = re.search(r'^version = "([^"]+)"', text, re.MULTILINE)
    assert stated is not None
    assert nbdist.__version__ == __version__ == stated.group(1)

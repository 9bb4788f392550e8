"""The notebook's own modules reach Spark executors that do not have the notebook's folder."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist.rank import localcode

from ..helpers import run

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def helpers_nb(ip: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A notebook with a folder of its own on ``sys.path``: a module and a package in it."""
    (tmp_path / "nbdist_lcs_pkg").mkdir()
    (tmp_path / "nbdist_lcs_helpers.py").write_text(
        "from nbdist_lcs_pkg import scale\n\ndef triple(x):\n    return 3 * scale * x\n")
    (tmp_path / "nbdist_lcs_pkg" / "__init__.py").write_text("scale = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]
    for name in ("nbdist_lcs_helpers", "nbdist_lcs_pkg"):
        sys.modules.pop(name, None)


def test_a_cells_local_module_and_package_reach_the_executors(
    helpers_nb: Any, spark_cluster: SparkSession,
) -> None:
    """On two workers, a cell imports the notebook's module, which imports its package: both
    come from the shipped copy, on every rank, in a job and in a session's later cell."""
    value = run(helpers_nb, """%%distributed -np 2 -o got
import nbdist_lcs_helpers
(nbdist_lcs_helpers.triple(1), nbdist_lcs_helpers.__file__)
""")
    got = helpers_nb.user_ns["got"]
    assert [g[0] for g in got] == [6, 6] and value == got[0]
    assert all(g[1].startswith(localcode.code_root()) for g in got), got
    run(helpers_nb, "%dist_session start -np 2")
    try:
        run(helpers_nb, "%%distributed\nimport nbdist_lcs_pkg\n")
        assert run(helpers_nb, "%%distributed\nnbdist_lcs_pkg.scale\n") == 2
    finally:
        run(helpers_nb, "%dist_session stop")

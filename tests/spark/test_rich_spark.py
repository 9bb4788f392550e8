"""Rich output and ``--targets`` on a session whose ranks are tasks of a ``local[2]`` Spark
barrier stage."""

from __future__ import annotations

from typing import Any

import pytest

from nbdist import session as sessions

from ..helpers import run
from .test_session_spark import spark_session_ranks  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("no_session")]


def test_targets_and_displays_on_a_spark_session(
    ip: Any, spark_session_ranks: sessions.Session  # noqa: F811
) -> None:
    """``--targets`` runs a cell on the named Spark ranks only; a rank's display reaches the
    cell's state."""
    run(ip, "%%distributed\nimport os\nx = int(os.environ['RANK'])")
    assert run(ip, "%%distributed --targets 1 -o one\nx = x + 10\nx") == 11
    assert ip.user_ns["one"] == [11]
    assert run(ip, "%%distributed -o both\nx") == 0
    assert ip.user_ns["both"] == [0, 11]
    host = spark_session_ranks.state.ranks[0].host
    run(ip, f"%%distributed --targets host={host} -o on_host\nx * 2")
    assert ip.user_ns["on_host"] == [0, 22]
    run(ip, "%%distributed --targets 0\nfrom IPython.display import HTML, display\n"
            "display(HTML('<b>from spark</b>'))")
    cell = spark_session_ranks.last_cell
    assert cell is not None and cell.targets == (0,)
    assert [(d.rank, d.data.get("text/html")) for d in cell.state.displays] == [
        (0, "<b>from spark</b>")]

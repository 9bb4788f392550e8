"""``%dist_pull`` of a large value from a Spark session's rank: the pieces cross the event
channel from a Spark task, as on the local backend, and arrive intact."""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist import session as sessions

from ..helpers import run

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("no_session")]


def test_pulling_40_mb_from_a_spark_rank_arrives_intact(
    ip: Any, spark_local: SparkSession
) -> None:
    """A 40 MB array and a dict holding one come back from rank 1 of a Spark session whole."""
    run(ip, "%dist_session start -np 2")
    live = sessions.current()
    assert live is not None and live.launcher.name == "spark"
    try:
        run(ip, "%%distributed\n"
                "import os, numpy as np\n"
                "rank = int(os.environ['RANK'])\n"
                "x = np.arange(10_000_000, dtype=np.int32) * (rank + 1)\n"
                "d = {'x': x, 'rank': rank}")
        run(ip, "%dist_pull x --rank 1")
        run(ip, "%dist_pull d --rank 1")
        import numpy as np

        expected = np.arange(10_000_000, dtype=np.int32) * 2
        assert np.array_equal(ip.user_ns.pop("x"), expected)
        d = ip.user_ns.pop("d")
        assert d["rank"] == 1 and np.array_equal(d["x"], expected)
        assert live.alive
    finally:
        live.stop()

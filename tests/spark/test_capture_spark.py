"""Capture refuses real Spark objects (session, context, DataFrame) before any launch.

They are recognised by the names of their types: capture never imports pyspark itself
(``tests/test_capture.py`` checks that in a fresh interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import SparkSession

from nbdist import job as jobs
from nbdist.errors import CaptureError

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def spark_names(ip: Any, spark_local: SparkSession) -> Iterator[Any]:
    """The notebook holds ``spark``, ``sc``, a DataFrame ``df`` and a function that uses it."""
    ip.user_ns.update(spark=spark_local, sc=spark_local.sparkContext, df=spark_local.range(3))
    ip.run_cell("def load():\n    return df.toPandas()\n")
    yield ip
    for name in ("spark", "sc", "df", "load"):
        ip.user_ns.pop(name, None)


@pytest.mark.parametrize(("cell", "says"), [
    ("rows = spark.range(3).count()",
     ["cannot send 'spark' to the ranks: it is a Spark handle "
      "(pyspark.sql.session.SparkSession)", "line 2: `rows = spark.range(3).count()`",
      "df.toPandas()"]),
    ("sc.parallelize([1]).count()",
     ["cannot send 'sc' to the ranks: it is a Spark handle (pyspark.core.context.SparkContext)",
      "line 2: `sc.parallelize([1]).count()`"]),
    ("n = df.count()",
     ["cannot send 'df' to the ranks: it is a Spark DataFrame (or RDD) "
      "(pyspark.sql.classic.dataframe.DataFrame)", "line 2: `n = df.count()`",
      "nbdist.shard(df)"]),
    ("data = load()",
     ["cannot send 'load' to the ranks: it is a function that holds a Spark DataFrame",
      "at load → global df", "line 2: `data = load()`"]),
])
def test_spark_objects_are_refused_before_launch(spark_names: Any, cell: str,
                                                 says: list[str]) -> None:
    """The refusal names the Spark variable, its type, the line and what to do; no job."""
    started = len(jobs.jobs())
    result = spark_names.run_cell(f"%%distributed -np 2\n{cell}\n")
    assert isinstance(result.error_in_exec, CaptureError)
    message = str(result.error_in_exec)
    for text in says:
        assert text in message, message
    assert len(jobs.jobs()) == started

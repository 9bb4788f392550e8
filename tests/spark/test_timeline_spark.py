"""The launch timeline and the resources of ranks that run as Spark barrier tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import nbdist
from nbdist.views import timeline as timeline_view

from ..helpers import wait_for
from ..test_timeline import LAUNCH, _busy, check_trace, in_order

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]


def test_spark_ranks_report_resources_and_a_timeline_from_their_task_start(
        tmp_path: Path, spark_local: SparkSession) -> None:
    """Spark ranks sample their resources like local ones, and their trace starts when the
    barrier task started, with every phase in order per rank."""
    release = tmp_path / "release"  # local mode: the executors share this file system
    job = nbdist.run(_busy, str(release), np=2, backend="spark")
    try:  # the ranks spin until both samples are seen (test_timeline's local test says why)
        wait_for(lambda: all(r.resources is not None and (r.resources.cpu or 0) > 5
                             and (r.resources.rss or 0) > 150e6 for r in job.state.ranks), 120,
                 "both Spark ranks' CPU and memory samples")
    finally:
        release.touch()
    assert job.result(timeout=200) == 0
    path = tmp_path / "spark.json"
    timeline_view.export_trace(job.state, str(path))
    names = check_trace(json.loads(path.read_text()), np=2)
    for rank in (0, 1):
        assert in_order(names[rank], LAUNCH), names[rank]
        assert "zygote imports" not in names[rank]  # Spark ranks start fresh
        marks = job.state.ranks[rank].marks
        assert job.state.created < marks["scheduled"] < marks["world"] < marks["delivered"]

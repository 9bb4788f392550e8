"""TensorFlow's MWMS over two hosts: a real standalone cluster (workers on 127.0.0.1 and
127.0.0.2), so TF_CONFIG lists ports reserved on two hosts and gRPC connects them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pyspark.sql import SparkSession

from ..sparks import WORKERS
from ..test_keras import needs_tf, run_cell

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]


@needs_tf
def test_mwms_all_reduces_across_two_hosts(ip: Any, spark_cluster: SparkSession) -> None:
    """Four workers on two hosts (3 slots each) agree on one cluster and all-reduce over it."""
    run_cell(ip, '''%%distributed -np 4 -o hosts_tf --quiet
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
one = strategy.run(lambda: tf.constant(float(os.environ["RANK"]) + 1))
(os.environ["TF_CONFIG"], strategy.num_replicas_in_sync,
 float(strategy.reduce("SUM", one, axis=None)))
''')
    ranks = ip.user_ns["hosts_tf"]
    configs = [json.loads(config) for config, _, _ in ranks]
    workers = configs[0]["cluster"]["worker"]
    assert all(c["cluster"]["worker"] == workers for c in configs)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": r} for r in range(4)]
    assert {w.rsplit(":", 1)[0] for w in workers} == {host for host, _, _ in WORKERS}
    assert len(set(workers)) == 4
    assert [(n, total) for _, n, total in ranks] == [(4, 10.0)] * 4  # 1 + 2 + 3 + 4

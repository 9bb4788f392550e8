"""TensorFlow and Keras on a real ``local[2]`` SparkSession: the ranks are barrier tasks.

The same cells as ``tests/test_keras.py``: TF_CONFIG and KERAS_DISTRIBUTION_* come from the
ports the tasks' supervisors reserved and reported in their hellos.
"""

from __future__ import annotations

from typing import Any

import pytest
from pyspark.sql import SparkSession

from ..test_keras import (
    JAX_CELL,
    TF_KERAS_CELL,
    check_jax_ranks,
    check_tf_keras_ranks,
    needs_jax,
    needs_tf,
    run_cell,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(480)]


@needs_tf
def test_tf_keras_mwms_trains_identically_on_spark(ip: Any, spark_local: SparkSession) -> None:
    """tf.keras under MWMS on two Spark tasks: two workers, equal weights on both."""
    run_cell(ip, f"%%distributed -np 2 -o tf_spark --quiet\n{TF_KERAS_CELL}")
    check_tf_keras_ranks(ip.user_ns["tf_spark"])


@needs_jax
def test_keras3_jax_data_parallel_trains_identically_on_spark(
    ip: Any, spark_local: SparkSession
) -> None:
    """Keras 3 on JAX, DataParallel over two Spark tasks: equal weights from different shards."""
    run_cell(ip, f"%%distributed -np 2 -o jax_spark --quiet\n{JAX_CELL}")
    check_jax_ranks(ip.user_ns["jax_spark"])

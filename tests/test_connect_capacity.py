"""What a Spark Connect session's capacity is worked out from: the server's configuration only
(``launch.spark.read_connect_cluster``, a pure function of the settings Connect lets a client
read; the real server is exercised in ``tests/spark/test_connect.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from nbdist.launch.spark import read_connect_cluster


class _Session:
    """The one thing read_connect_cluster asks a Connect session: ``conf.get(key, default)``."""

    def __init__(self, **settings: str) -> None:
        self.conf = self
        self._settings = {k.replace("_", "."): v for k, v in settings.items()}

    def get(self, key: str, default: Any = None) -> Any:
        if key == "spark.executor.instances" and "forbidden" in self._settings:
            raise RuntimeError("not readable by clients")
        return self._settings.get(key, default)


@pytest.mark.parametrize(("settings", "slots", "gpus", "counted"), [
    ({"spark_master": "local[3]"}, 3, 0, True),
    ({"spark_master": "spark://m:7077", "spark_executor_instances": "2",
      "spark_executor_cores": "8", "spark_task_cpus": "2"}, 8, 0, True),
    ({"spark_master": "spark://m:7077", "spark_cores_max": "6", "spark_executor_cores": "3",
      "spark_executor_resource_gpu_amount": "2", "spark_task_resource_gpu_amount": "1"},
     4, 4, True),
    ({"spark_master": "spark://m:7077", "spark_executor_instances": "2",
      "spark_executor_cores": "16", "spark_executor_resource_gpu_amount": "8",
      "spark_task_resource_gpu_amount": "8"}, 2, 16, True),
    ({"spark_master": "spark://m:7077", "forbidden": "1"}, 0, 0, False),
    ({"spark_master": "local[*]"}, 0, 0, False),
])
def test_slots_come_from_the_servers_configuration_or_are_said_unknown(
    settings: dict[str, str], slots: int, gpus: int, counted: bool,
) -> None:
    """local[N], executors × cores ÷ task cpus and GPUs ÷ task GPUs give the slots; without
    them the count is marked unknown and the description says so."""
    info = read_connect_cluster(_Session(**settings))
    assert (info.slots, info.gpus, info.counted) == (slots, gpus, counted)
    assert info.estimated
    if not counted:
        assert "barrier task slots unknown" in info.describe()

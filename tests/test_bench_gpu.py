"""``benchmarks/bench_gpu.py`` without a GPU: it says so and exits 0, and its report renders."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nbdist.launch.local import visible_gpus

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    """No GPU: "no GPU here", exit status 0, and a gpu.json with nothing measured."""
    if visible_gpus():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "no GPU here (nvidia-smi lists none): nothing measured\n"
    assert json.loads((tmp_path / "gpu.json").read_text())["results"] == []


def test_the_report_names_the_card_the_ratios_and_how_ranks_started() -> None:
    """The markdown report: the card and driver, each contender's ratio, the goal, the rank's
    own breakdown and how the ranks started."""
    bench = _bench()
    info = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "bus": "0"}],
            "driver": "580.1", "torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3",
            "cores": 16}
    result = {"scenario": "3. NCCL DDP job, 1 rank(s), 50 steps", "baseline": "torchrun",
              "rows": [("torchrun", 9.0, 1.0, 3), ("nbdist", 4.5, 0.5, 3)],
              "inside": {"nbdist": {"import torch": 0.0, "init_process_group": 0.1}},
              "timeline": {"spawn": 0.01}, "notes": [["rank 0 forked from a zygote"]],
              "goal": "nbdist ≤ 0.6× torchrun", "met": True}
    text = bench.markdown(info, [result])
    assert text.startswith("1 × NVIDIA H100 80GB HBM3 (81559 MiB), driver 580.1, torch "
                           "2.11.0+cu130 (CUDA 13.0), Python 3.12.3, 16 cores")
    assert "| nbdist | 4.50 s | 0.50× | 3 |" in text
    assert "Goal: nbdist ≤ 0.6× torchrun: met." in text
    assert "Inside the rank, nbdist: import torch 0.00 s, init_process_group 0.10 s." in text
    assert "How the ranks started: rank 0 forked from a zygote." in text

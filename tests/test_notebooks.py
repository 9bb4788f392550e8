"""The notebooks in notebooks/ run top to bottom in a real kernel, with the outputs they promise."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def run_notebook(name: str) -> Any:
    """Run a notebook in a real kernel; the notebook with its outputs. nbformat and nbclient
    are imported here, not with the module: their jsonschema builds an IRI grammar at import
    (3 CPU-seconds, jsonschema#1428), which every xdist worker paid to collect this file."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    return nb


def execute(name: str) -> list[str]:
    """Run a notebook; return each code cell's outputs as one text."""
    nb = run_notebook(name)
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for out in cell.outputs:
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out:
                parts.extend(str(v) for k, v in out.data.items() if k.startswith("text/"))
        texts.append("".join(parts))
    return texts


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quickstart_trains_on_two_ranks() -> None:
    """The quickstart shows both ranks' epochs and returns rank 0's accuracy as the result."""
    texts = execute("01-quickstart.ipynb")
    train = texts[2]
    for rank in (0, 1):
        assert f"[rank {rank}] epoch 0: loss" in train
        assert f"[rank {rank}] held-out accuracy" in train
    assert "{'rank': 0, 'accuracy':" in train
    found = re.search(r"accuracy on 297 held-out digits: ([\d.]+)%", texts[3])
    assert found is not None, texts[3]
    accuracy = float(found.group(1))
    assert accuracy > 80
    assert texts[4].startswith("%dist_check of 2 ranks"), texts[4]
    assert "all-reduce (bus bandwidth as nccl-tests computes it):" in texts[4]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sessions_notebook_iterates_on_live_ranks() -> None:
    """The sessions notebook trains twice on the same ranks and pulls the history back."""
    texts = execute("02-sessions.ipynb")
    assert "2 ranks ready on local" in texts[1]
    assert "[rank 0] epochs so far: 20" in texts[4] and "[rank 1] epochs so far: 20" in texts[4]
    assert "[rank 0] epochs so far: 40" in texts[5]  # the second run went on from the first
    first, second = float(texts[4].split()[-1]), float(texts[5].split()[-1])
    assert second < first
    assert "40 epochs: loss" in texts[6]
    assert "defined on the ranks:" in texts[7] and "history" in texts[7]
    assert "MB" in texts[7]  # each rank's memory, reported after every cell
    assert "stopped: its 2 ranks are gone" in texts[8]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="needs tensorflow and tf-keras (nbdist[tf])")
def test_keras_notebook_trains_with_mwms_on_two_ranks() -> None:
    """The Keras notebook trains on two MWMS workers and leaves the chief's checkpoints only."""
    texts = execute("03-keras.ipynb")
    train = texts[2]
    assert "[rank 0] Epoch 6/6" in train and "[rank 1] Epoch" not in train  # chief's log only
    for rank in (0, 1):
        assert f"[rank {rank}] held-out accuracy" in train
    summary = texts[3]
    assert "2 workers; accuracy on 297 held-out digits" in summary
    found = re.search(r"held-out digits: ([\d.]+)%", summary)
    assert found is not None, summary
    accuracy = float(found.group(1))
    assert accuracy > 80
    assert "checkpoints: epoch-1.weights.h5" in summary and "epoch-6.weights.h5" in summary
    assert "workertemp" not in summary  # worker 1 wrote to a temporary directory, removed


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_children_notebook_carries_classes_functions_and_logging() -> None:
    """A rank's spawn DataLoader workers and forkserver pool use the notebook's class and function;
    the notebook's logging format shows the ranks' log lines live."""
    texts = execute("04-children.ipynb")
    train = texts[2]
    for rank in (0, 1):
        # sum of i*i for i < 16 is 1240: computed by the workers from the notebook's Squares
        line = f"[rank {rank}] INFO|train|rank {rank}: sum of squares 1240, cubes [0, 1, 8, 27]"
        assert line in train
    assert "(1240.0, [0, 1, 8, 27])" in train


@pytest.mark.spark
@pytest.mark.timeout(400)
def test_data_notebook_trains_from_a_spark_dataframe() -> None:
    """The data notebook trains DDP on two Spark ranks from equal shards of a Spark DataFrame
    (40 steps an epoch on each rank) and learns the table's linear rule."""
    texts = execute("05-data.ipynb")
    assert "20001 rows, columns ['id', 'x1', 'x2', 'y']" in texts[1]
    train = texts[2]
    for rank in (0, 1):
        assert f"[rank {rank}] <nbdist shard of Spark DataFrame 'df': rank {rank} of 2" in train
        assert "1 rows dropped for equal shards, 40 batches of 250>" in train
        assert f"[rank {rank}] epoch 4: 40 steps, loss" in train
    found = re.search(r"learned y = ([-\d.]+) x1 \+ ([-\d.]+) x2 \+ ([-\d.]+)", texts[3])
    assert found is not None, texts[3]
    w1, w2, b = map(float, found.groups())
    assert abs(w1 - 3) < 0.1 and abs(w2 + 2) < 0.1 and abs(b - 1) < 0.1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_figures_notebook_shows_rank_zeros_figure() -> None:
    """The figures notebook shows rank 0's Markdown and matplotlib figure below the panel."""
    pytest.importorskip("matplotlib")
    nb = run_notebook("06-figures.ipynb")
    draw = [c for c in nb.cells if c.cell_type == "code"][1]
    shown = [o for o in draw.outputs if o.output_type == "display_data"
             and o.get("metadata", {}).get("nbdist", {}).get("rank") == 0]
    assert [sorted(o.data) for o in shown] == [["text/markdown", "text/plain"],
                                              ["image/png", "text/plain"]]
    assert shown[0].data["text/markdown"].startswith("**rank 0**: slope 2.")
    assert shown[1].data["text/plain"].startswith("[rank 0] <Figure size")
    assert not any(o.get("metadata", {}).get("nbdist", {}).get("rank") == 1
                   for o in draw.outputs)
    result = [o for o in draw.outputs if o.output_type == "execute_result"]
    assert result and result[0].data["text/plain"].startswith("2.")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax (nbdist[jax])")
def test_frameworks_notebook_runs_plain_jax_and_resumes_fsdp2() -> None:
    """Plain JAX initializes with no arguments and psums across both ranks; FSDP2 saves a
    distributed checkpoint, loses rank 1, and both ranks resume from it with the saved weights."""
    texts = execute("07-frameworks.ipynb")
    jax = texts[1]
    assert "[rank 0] process 0 of 2: psum = 3.0" in jax
    assert "[rank 1] process 1 of 2: psum = 3.0" in jax
    fsdp = texts[3]
    assert "rank 1 was killed by SIGKILL" in fsdp and "restarted (rule 'signal')" in fsdp
    for rank in (0, 1):
        assert f"[rank {rank}] resumed at step 4; weights as saved: True" in fsdp
        assert f"[rank {rank}] attempt 1 step 7: loss" in fsdp
        assert f"[rank {rank}] attempt 0 step 4" not in fsdp  # attempt 0 ended at its checkpoint
    assert "{'attempt': 1, 'resumed_at': 4, 'final_loss':" in fsdp

"""Metrics from real ranks reach the driver's series: nbdist.report, tqdm's postfix, Lightning."""

from __future__ import annotations

from typing import Any

import pytest

import nbdist

from .helpers import run


def _report_and_postfix() -> int:
    import os

    from tqdm import tqdm

    import nbdist

    rank = int(os.environ["RANK"])
    bar = tqdm(range(30), desc="train", mininterval=0)
    for step in bar:
        nbdist.report(loss=1.0 / (step + 1) + rank, phase="train")
        bar.set_postfix(acc=step / 30, note="warm")
    bar.close()
    return rank


@pytest.mark.timeout(120)
def test_reports_and_tqdm_postfix_of_each_rank_become_series() -> None:
    """Each rank's reported loss is a series counted in reports, ending at its last value;
    tqdm's postfix numbers are a series counted in the bar's n; words are not charted."""
    job = nbdist.run(_report_and_postfix, np=2)
    assert job.results == [0, 1]
    series = job.state.series
    assert series.names() == ["loss", "acc"] or series.names() == ["acc", "loss"]
    for rank in (0, 1):
        points = series.points("loss", rank)
        # Coalescing may merge reports, never lose the newest; steps count the reports.
        assert points[-1].step == 30 and points[-1].value == pytest.approx(1 / 30 + rank)
        assert [p.step for p in points] == sorted({p.step for p in points})
        acc = series.points("acc", rank)
        assert acc[-1].value == pytest.approx(29 / 30, abs=1e-3) and acc[-1].step == 30
        assert job.state.ranks[rank].metrics["acc"] == pytest.approx(29 / 30, abs=1e-3)


def _report_a_tensor() -> None:
    import torch

    import nbdist

    nbdist.report(loss=torch.tensor(0.25), big=torch.ones(3))


@pytest.mark.timeout(120)
def test_a_one_element_tensor_is_reported_as_its_number() -> None:
    """``report(loss=tensor)`` charts the number; a tensor of several numbers stays text."""
    pytest.importorskip("torch")
    job = nbdist.run(_report_a_tensor, np=1)
    job.result(timeout=90)
    assert job.state.ranks[0].metrics["loss"] == 0.25
    assert isinstance(job.state.ranks[0].metrics["big"], str)
    assert job.state.series.names() == ["loss"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_logged_metrics_reach_the_charts_through_its_progress_bar(ip: Any) -> None:
    """``self.log(..., prog_bar=True)`` in a LightningModule is charted for rank 0 (the rank
    Lightning draws its bar on) when its bar is tqdm's (``TQDMProgressBar``; with ``rich``
    installed Lightning picks ``RichProgressBar`` by default), the steps going on across
    epochs."""
    pytest.importorskip("lightning")
    run(ip, "%%distributed -np 2 --quiet\n"
            "import torch, lightning as L\n"
            "from torch.utils.data import DataLoader, TensorDataset\n"
            "class Tiny(L.LightningModule):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.layer = torch.nn.Linear(4, 1)\n"
            "    def training_step(self, batch, _):\n"
            "        x, y = batch\n"
            "        loss = torch.nn.functional.mse_loss(self.layer(x), y)\n"
            "        self.log('train_loss', loss, prog_bar=True)\n"
            "        return loss\n"
            "    def configure_optimizers(self):\n"
            "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
            "torch.manual_seed(0)\n"
            "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
            "trainer = L.Trainer(accelerator='cpu', devices=2, strategy='ddp', max_epochs=3,\n"
            "                    enable_checkpointing=False, logger=False,\n"
            "                    enable_model_summary=False,\n"
            "                    callbacks=[L.pytorch.callbacks.TQDMProgressBar()])\n"
            "trainer.fit(Tiny(), DataLoader(data, batch_size=8))\n")
    from nbdist import job as jobs

    job = jobs.jobs()[-1]
    series = job.state.series
    assert "train_loss" in series.names() and "v_num" not in series.names()
    points = series.points("train_loss", 0)
    assert points[-1].step > 4  # 4 batches an epoch per rank: the steps went on past epoch 1
    assert [p.step for p in points] == sorted(p.step for p in points)

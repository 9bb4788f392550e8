"""Real distributed training on local ranks: torch DDP, Lightning and accelerate unchanged."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")


def run(ip: Any, cell: str) -> Any:
    result = ip.run_cell(cell)
    assert result.error_before_exec is None and result.error_in_exec is None, (
        result.error_before_exec or result.error_in_exec
    )
    return result.result


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_gloo_training_all_reduces_gradients(ip: Any) -> None:
    """Two ranks train one DDP model on different shards: equal parameters, falling loss."""
    run(ip, "import torch\nimport torch.nn as nn\n"
            "def make_model():\n"
            "    torch.manual_seed(0)\n"
            "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n"
            "steps = 30\n")
    out = run(ip, "%%distributed -np 2 -o per_rank --quiet\n"
                  "import torch.distributed as dist\n"
                  "dist.init_process_group('gloo')\n"
                  "rank = dist.get_rank()\n"
                  "torch.manual_seed(100 + rank)  # a different shard per rank\n"
                  "x = torch.randn(64, 8)\n"
                  "y = x.sum(dim=1, keepdim=True)\n"
                  "model = nn.parallel.DistributedDataParallel(make_model())\n"
                  "opt = torch.optim.SGD(model.parameters(), lr=0.05)\n"
                  "losses = []\n"
                  "for _ in range(steps):\n"
                  "    opt.zero_grad()\n"
                  "    loss = nn.functional.mse_loss(model(x), y)\n"
                  "    loss.backward()\n"
                  "    opt.step()\n"
                  "    losses.append(loss.item())\n"
                  "params = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
                  "dist.destroy_process_group()\n"
                  "(losses[0], losses[-1], params)\n")
    per_rank = ip.user_ns["per_rank"]
    assert out[0] == per_rank[0][0]
    first0, last0, params0 = per_rank[0]
    first1, last1, params1 = per_rank[1]
    assert last0 < first0 / 2 and last1 < first1 / 2
    assert torch.equal(params0, params1)
    assert first0 != first1  # the shards really differed, so equality came from all-reduce


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lightning_trainer_ddp_sees_two_processes(ip: Any) -> None:
    """Lightning's Trainer(strategy="ddp", devices=2) detects the torchrun environment and fits."""
    pytest.importorskip("lightning")
    out = run(ip, "%%distributed -np 2 -o lightning_out --quiet\n"
                  "import warnings\n"
                  "import torch, lightning as L\n"
                  "from torch.utils.data import DataLoader, TensorDataset\n"
                  "class Tiny(L.LightningModule):\n"
                  "    def __init__(self):\n"
                  "        super().__init__()\n"
                  "        self.layer = torch.nn.Linear(4, 1)\n"
                  "    def training_step(self, batch, _):\n"
                  "        x, y = batch\n"
                  "        return torch.nn.functional.mse_loss(self.layer(x), y)\n"
                  "    def configure_optimizers(self):\n"
                  "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
                  "torch.manual_seed(0)\n"
                  "data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))\n"
                  "trainer = L.Trainer(accelerator='cpu', devices=2, strategy='ddp',\n"
                  "                    max_epochs=2, enable_progress_bar=False,\n"
                  "                    enable_checkpointing=False,\n"
                  "                    logger=False, enable_model_summary=False)\n"
                  "trainer.fit(Tiny(), DataLoader(data, batch_size=8))\n"
                  "(trainer.world_size, trainer.global_rank, trainer.global_step,\n"
                  " type(trainer.strategy.cluster_environment).__name__)\n")
    assert out[0] == 2 and out[1] == 0
    assert out[3] == "TorchElasticEnvironment"
    assert [r[1] for r in ip.user_ns["lightning_out"]] == [0, 1]
    assert out[2] == 2 * (64 // 8 // 2)  # each rank saw half of the batches per epoch


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_accelerator_sees_two_processes(ip: Any) -> None:
    """accelerate's Accelerator() finds two processes and trains with gathered results."""
    pytest.importorskip("accelerate")
    out = run(ip, "%%distributed -np 2 -o acc_out --quiet\n"
                  "import torch\n"
                  "from accelerate import Accelerator\n"
                  "acc = Accelerator(cpu=True)\n"
                  "torch.manual_seed(0)\n"
                  "model = torch.nn.Linear(4, 1)\n"
                  "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                  "model, opt = acc.prepare(model, opt)\n"
                  "x = torch.randn(16, 4) + acc.process_index\n"
                  "for _ in range(3):\n"
                  "    opt.zero_grad()\n"
                  "    loss = model(x).pow(2).mean()\n"
                  "    acc.backward(loss)\n"
                  "    opt.step()\n"
                  "ranks = acc.gather(torch.tensor([acc.process_index]))\n"
                  "w = acc.unwrap_model(model).weight.detach().clone()\n"
                  "(acc.num_processes, acc.process_index, str(acc.distributed_type),\n"
                  " ranks.tolist(), w)\n")
    assert out[0] == 2 and out[1] == 0 and out[3] == [0, 1]
    assert "MULTI_CPU" in out[2]
    assert torch.equal(ip.user_ns["acc_out"][0][4], ip.user_ns["acc_out"][1][4])

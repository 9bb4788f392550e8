"""Capacity messages on GPUs count right ("1 GPU") and, where GPUs are fewer than ranks, say
how to run CPU ranks instead (``--no-gpu``)."""

from __future__ import annotations

from typing import Any

import pytest

import nbdist
from nbdist.launch import gpus_text
from nbdist.launch.local import LocalLauncher


def test_gpus_are_counted_in_words() -> None:
    """No GPU, 1 GPU, 2 GPUs."""
    assert [gpus_text(n) for n in (0, 1, 2)] == ["no GPU", "1 GPU", "2 GPUs"]


def test_one_gpu_and_two_ranks_names_the_gpu_and_the_cpu_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """-np 2 with one GPU: the error says "1 GPU", names it, and offers -np 1 or --no-gpu."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(abs, -1, np=2, gpu=True)
    assert str(info.value) == (
        "asked for 2 ranks with one GPU each, but this machine has 1 GPU (0): use -np 1 for "
        "one rank per GPU, or --no-gpu for 2 CPU ranks (gpu=False in nbdist.run; "
        "torch.distributed with 'gloo')")
    assert "1 GPU" in LocalLauncher().capacity().detail


def test_gpu_asked_where_there_is_none_says_use_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gpu on a machine without GPUs: "no GPU", and --no-gpu as the way out."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(nbdist.CapacityError) as info:
        nbdist.run(abs, -1, np=1, gpu=True)
    message = str(info.value)
    assert "this machine has no GPU (CUDA_VISIBLE_DEVICES and nvidia-smi name none)" in message
    assert message.endswith("use --no-gpu for 1 CPU rank (gpu=False in nbdist.run; "
                            "torch.distributed with 'gloo')")


def test_the_cell_magic_says_it_too(ip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``%%distributed -np 3 --gpu`` with two GPUs: the notebook shows the same hint."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(nbdist.CapacityError) as info:
        ip.run_cell_magic("distributed", "-np 3 --gpu --backend local", "1")
    assert "this machine has 2 GPUs (0, 1): use -np 2 for one rank per GPU, or --no-gpu for " \
           "3 CPU ranks" in str(info.value)

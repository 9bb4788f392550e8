"""The rendezvous arithmetic: hellos → torchrun environments."""

from __future__ import annotations

import pytest

from nbdist.world import Hello, plan_world


def test_single_host_gets_torchrun_variables() -> None:
    """Two ranks on one host get consecutive LOCAL_RANKs, one node, rank 0's port."""
    envs = plan_world({0: Hello(0, "h", 29500, cpus=4), 1: Hello(1, "h", cpus=4)}, 2, "run", "j1")
    assert envs[1]["RANK"] == "1" and envs[1]["WORLD_SIZE"] == "2"
    assert envs[1]["LOCAL_RANK"] == "1" and envs[1]["LOCAL_WORLD_SIZE"] == "2"
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "h"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] == "29500"
    assert envs[0]["GROUP_RANK"] == envs[0]["NODE_RANK"] == "0"
    assert envs[0]["TORCHELASTIC_RUN_ID"] == "run" and envs[0]["NBDIST_JOB_ID"] == "j1"
    assert envs[0]["OMP_NUM_THREADS"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in envs[0]


def test_hosts_are_grouped_and_gpus_follow_local_rank() -> None:
    """Ranks interleaved over two hosts get per-host LOCAL_RANKs and GPU lists in that order."""
    hellos = {
        0: Hello(0, "a", 1234, gpus=("0",)), 1: Hello(1, "b", gpus=("1",)),
        2: Hello(2, "a", gpus=("3",)), 3: Hello(3, "b", gpus=("2",)),
    }
    envs = plan_world(hellos, 4, "r", "j", use_gpus=True)
    assert [envs[r]["NODE_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4)] == ["0", "0", "1", "1"]
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "0,3" and envs[2]["NBDIST_GPU"] == "3"
    assert envs[3]["CUDA_VISIBLE_DEVICES"] == "1,2" and envs[3]["NBDIST_GPU"] == "2"
    assert all(envs[r]["MASTER_ADDR"] == "a" for r in range(4))


def test_user_env_wins_and_missing_ranks_are_refused() -> None:
    """--env values override nbdist's, and a plan without every rank is an error."""
    envs = plan_world({0: Hello(0, "h", 1)}, 1, "r", "j", user_env={"OMP_NUM_THREADS": "7"})
    assert envs[0]["OMP_NUM_THREADS"] == "7"
    with pytest.raises(ValueError, match=r"ranks \[1\]"):
        plan_world({0: Hello(0, "h", 1)}, 2, "r", "j")
    with pytest.raises(ValueError, match="no GPU"):
        plan_world({0: Hello(0, "h", 1)}, 1, "r", "j", use_gpus=True)

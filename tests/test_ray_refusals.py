"""What the Ray backend refuses before any Ray is started: Ray not installed, Ray not
initialized, a Ray Client (``ray://``) address, local-rank counts and bad settings; and that
without an initialized Ray the automatic choice stays local."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import nbdist
from nbdist.launch import backends
from nbdist.launch import ray as ray_backend


def test_without_ray_installed_the_backend_names_the_extra(monkeypatch: Any) -> None:
    """--backend ray where Ray cannot be imported says how to install it."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'nbdist\[ray\]'"):
        nbdist.run(os.getpid, np=2, backend="ray")
    assert not backends.ray_active()  # and the automatic choice does not try it


def test_a_ray_client_address_is_refused_with_what_to_do(monkeypatch: Any) -> None:
    """A ray:// address is refused: the ranks could not reach the notebook; run it on the
    cluster's network."""
    monkeypatch.setenv("RAY_ADDRESS", "ray://head.example:10001")
    with pytest.raises(ValueError, match=r"Ray Client.*cluster's network.*"
                       r"ray\.init\(address='auto'\).*RAY_ADDRESS=ray://head"):
        nbdist.run(os.getpid, np=2, backend="ray")


def test_ray_not_initialized_is_refused_and_auto_stays_local() -> None:
    """--backend ray without ray.init() says to call it; auto picks local ranks then."""
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray of another test is connected in this process")
    with pytest.raises(ValueError, match=r"call ray\.init\(\) first"):
        backends.choose(2, "ray")
    launcher, n = backends.choose(2, "auto")
    assert launcher.name == "local" and n == 2


def test_local_rank_counts_and_bad_settings_are_refused(monkeypatch: Any) -> None:
    """-np -N cannot go with --backend ray; a wrong strategy or bundle size names its
    setting."""
    with pytest.raises(ValueError, match="-np -N means local ranks"):
        backends.choose(-2, "ray")
    monkeypatch.setenv("NBDIST_RAY_STRATEGY", "CLOSE")
    with pytest.raises(ValueError, match="ray_strategy must be one of PACK"):
        ray_backend.placement()
    monkeypatch.setenv("NBDIST_RAY_STRATEGY", "spread")
    monkeypatch.setenv("NBDIST_RAY_GPUS_PER_BUNDLE", "0")
    with pytest.raises(ValueError, match="ray_gpus_per_bundle must be 1 or more"):
        ray_backend.placement()
    monkeypatch.setenv("NBDIST_RAY_GPUS_PER_BUNDLE", "4")
    assert ray_backend.placement()[:2] == (4, "SPREAD")


def test_the_config_traits_set_the_ray_settings(ip: Any) -> None:
    """%config DistMagics.ray_* sets what placement() reads, over the environment; a negative
    CPU count names its setting."""
    try:
        ip.run_line_magic("config", "DistMagics.ray_cpus_per_rank = 0.5")
        ip.run_line_magic("config", "DistMagics.ray_strategy = 'STRICT_SPREAD'")
        ip.run_line_magic("config", "DistMagics.ray_placement_wait = 7.0")
        ip.run_line_magic("config", "DistMagics.ray_gpus_per_bundle = 2")
        assert ray_backend.placement() == (2, "STRICT_SPREAD", 7.0, 0.5)
        ip.run_line_magic("config", "DistMagics.ray_cpus_per_rank = -1.0")
        with pytest.raises(ValueError, match="ray_cpus_per_rank must be 0 or more"):
            ray_backend.placement()
    finally:
        for name in ("cpus_per_rank", "strategy", "placement_wait", "gpus_per_bundle"):
            ip.run_line_magic("config", f"DistMagics.ray_{name} = None")
    assert ray_backend.placement() == (1, "PACK", 30.0, 1.0)

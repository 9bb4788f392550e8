"""The fault matrix on the Ray backend: the rows of ``tests/faults/rows.py`` on the package's
two-node cluster, the same faults in real ranks and the same checks of what the user gets as on
local ranks and Spark. Ray's own rows (a node lost, the placement wait, cancel leaving no
group) are in ``test_ray.py``. After each test no rank, actor or placement group is left
(``no_leftover_ray``), ranks forked from a node's zygote included (``ray_ranks``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..faults import rows
from .conftest import ray_ranks

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def ray_target(on_ray: Any) -> rows.Target:
    """The rows' target: ranks in nbdist's actors on the cluster's nodes."""
    return rows.Target("ray", ray_ranks)


@pytest.mark.torch
def test_exception_while_others_wait_in_a_collective(ray_target: rows.Target) -> None:
    """Rank 1 raising while rank 0 waits in all_reduce: its traceback, and rank 0 torn down."""
    rows.exception_in_a_collective(ray_target)


@pytest.mark.torch
@pytest.mark.parametrize(("fault", "signal_name"), rows.SIGNALS)
def test_rank_killed_by_a_signal_in_a_collective(
    ray_target: rows.Target, fault: str, signal_name: str
) -> None:
    """A rank dying of SIGKILL or a segfault is named with its signal; its peer is stopped."""
    rows.killed_by_a_signal(ray_target, fault, signal_name)


@pytest.mark.parametrize(("fault", "expected"), rows.EARLY_EXITS)
def test_rank_exits_early_without_a_result(
    ray_target: rows.Target, fault: str, expected: str
) -> None:
    """sys.exit(3) and os._exit(0) before the end are failures naming the rank and the code."""
    rows.exits_early(ray_target, fault, expected)


@pytest.mark.torch
def test_hung_collective_with_timeout(ray_target: rows.Target) -> None:
    """A deadlock (rank 1 never joins the collective) ends at --timeout naming both ranks."""
    rows.hung_collective(ray_target, timeout=60)  # a Ray job starts its workers first


def test_processes_a_rank_starts_die_with_it(ray_target: rows.Target, tmp_path: Path) -> None:
    """A child in a session of its own outlives nothing: it dies with its rank."""
    rows.lingering_children_die(ray_target, "setsid", tmp_path)


def test_a_child_in_its_own_session_dies_with_a_rank_killed_at_once(
    ray_target: rows.Target, tmp_path: Path
) -> None:
    """A rank SIGKILLed at once: its failure says so, and its escaped child dies too."""
    rows.escaped_child_dies_with_its_rank(ray_target, "SIGKILL", tmp_path)


def test_cancel_kills_escaped_children_too(ray_target: rows.Target, tmp_path: Path) -> None:
    """%dist_cancel ends the ranks and the children they started in sessions of their own."""
    rows.cancel_kills_escaped_children(ray_target, tmp_path)


def test_output_flood_keeps_driver_memory_bounded(ray_target: rows.Target) -> None:
    """Long lines, no newlines, bad UTF-8 and a \\r storm from a rank on another node: the
    job survives, lines are cut, and the driver's memory stays bounded."""
    rows.output_flood(ray_target, mib=32)

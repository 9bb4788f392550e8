"""Helpers the multi-host tests call (fixtures stay in ``conftest.py``, as in ``tests/``)."""

from __future__ import annotations

import psutil

from ..helpers import GONE_WITHIN_S, is_rank, none_left
from .hosts import Network

#: The workers: two task slots and two fake GPUs each.
WORKERS = ("wa", "wb", "wc")


def rank_processes(network: Network, hosts: tuple[str, ...] = WORKERS) -> list[psutil.Process]:
    """Rank interpreters (and what they started) on the given hosts: started fresh, or forked
    from the executor's zygote (which is not a rank itself: it stays for the next job)."""
    found = []
    for host in hosts:
        for proc in network.processes(host):
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any(is_rank(p) for p in (proc, *proc.parents())):
                    found.append(proc)
            except psutil.Error:
                pass
    return found


def ranks_gone(network: Network, within: float = GONE_WITHIN_S,
               hosts: tuple[str, ...] = WORKERS) -> None:
    """Every rank process on ``hosts`` is gone within ``within`` seconds (else kill, fail)."""
    none_left(lambda: rank_processes(network, hosts), within,
              f"rank processes left running on {', '.join(hosts)}")

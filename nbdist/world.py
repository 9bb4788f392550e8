"""Rendezvous arithmetic: from every rank's hello to the torchrun environment of each rank.

Pure functions; the driver runs them once every rank has said hello on the event channel.
Runs on no rank, imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hello:
    """What a rank's supervisor tells the driver when it connects."""

    rank: int
    host: str
    port: int | None = None  # a free port on the host, offered by rank 0 for MASTER_PORT
    gpus: tuple[str, ...] = ()  # GPU addresses this rank may use (Spark task resources)
    cpus: int = 1  # CPUs on the host, to size OMP_NUM_THREADS
    #: The host as the backend's scheduler names it (a Spark executor's address); "" locally.
    executor: str = ""

    @classmethod
    def from_event(cls, rank: int, event: Mapping[str, Any]) -> Hello:
        """A hello as it travels (JSON on the event channel or through Spark's allGather)."""
        port = event.get("port")
        return cls(
            rank=rank, host=str(event.get("host")), port=port if isinstance(port, int) else None,
            gpus=tuple(str(g) for g in event.get("gpus") or ()), cpus=int(event.get("cpus") or 1),
            executor=str(event.get("executor") or ""),
        )

    def on(self, host: str) -> bool:
        """Whether this rank runs on ``host`` (by its address or its executor's)."""
        return host in (self.host, self.executor)


def plan_world(
    hellos: Mapping[int, Hello],
    world_size: int,
    run_id: str,
    job_id: str,
    *,
    use_gpus: bool = False,
    user_env: Mapping[str, str] | None = None,
) -> dict[int, dict[str, str]]:
    """Return rank → environment, the same variables ``torchrun`` sets, plus nbdist's own.

    Hosts are numbered by their lowest rank (NODE_RANK / GROUP_RANK); LOCAL_RANK is a rank's
    position among the ranks on its host. With GPUs, ``CUDA_VISIBLE_DEVICES`` on a host lists
    the GPUs of that host's ranks in LOCAL_RANK order, so ``cuda:LOCAL_RANK`` is the rank's
    own GPU exactly as under torchrun, and ``NBDIST_GPU`` names it.
    """
    missing = sorted(set(range(world_size)) - set(hellos))
    if missing:
        raise ValueError(f"ranks {missing} have not said hello")
    zero = hellos[0]
    if zero.port is None:
        raise ValueError("rank 0 offered no MASTER_PORT")
    hosts: list[str] = []
    by_host: dict[str, list[int]] = {}
    for rank in range(world_size):
        host = hellos[rank].host
        if host not in by_host:
            hosts.append(host)
            by_host[host] = []
        by_host[host].append(rank)
    user = dict(user_env or {})
    envs: dict[int, dict[str, str]] = {}
    for rank in range(world_size):
        hello = hellos[rank]
        peers = by_host[hello.host]
        local_rank = peers.index(rank)
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "GROUP_RANK": str(hosts.index(hello.host)),
            "GROUP_WORLD_SIZE": str(len(hosts)),
            "NODE_RANK": str(hosts.index(hello.host)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": zero.host,
            "MASTER_PORT": str(zero.port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            # NCCL hangs become errors instead of silent waits (what Ray Train sets too).
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "NBDIST_JOB_ID": job_id,
            # torchrun sets 1 when it starts several processes; we share the host's cores.
            "OMP_NUM_THREADS": str(max(1, hello.cpus // len(peers))),
        }
        if use_gpus:
            gpus = _host_gpus(hellos, peers)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env["NBDIST_GPU"] = gpus[local_rank]
        env.update(user)
        envs[rank] = env
    return envs


def _host_gpus(hellos: Mapping[int, Hello], peers: Sequence[int]) -> list[str]:
    gpus: list[str] = []
    for rank in peers:
        own = [g for g in hellos[rank].gpus if g not in gpus]
        if not own:
            raise ValueError(f"rank {rank} has no GPU of its own on {hellos[rank].host}")
        gpus.append(own[0])
    return gpus

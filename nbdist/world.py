"""Rendezvous arithmetic: from every rank's hello to the torchrun environment of each rank.

Pure functions; the driver runs them once every rank has said hello on the event channel.
Runs on no rank, imports nothing heavy.
"""

from __future__ import annotations

import json
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
    #: A port reserved on the host for this rank's TensorFlow worker (its entry in TF_CONFIG).
    tf_port: int | None = None
    #: Rank 0: a port reserved for JAX's coordinator (``NBDIST_JAX_COORDINATOR``).
    jax_port: int | None = None

    @classmethod
    def from_event(cls, rank: int, event: Mapping[str, Any]) -> Hello:
        """A hello as it travels (JSON on the event channel or through Spark's allGather)."""
        port, tf_port, jax_port = event.get("port"), event.get("tf_port"), event.get("jax_port")
        return cls(
            rank=rank, host=str(event.get("host")), port=port if isinstance(port, int) else None,
            gpus=tuple(str(g) for g in event.get("gpus") or ()), cpus=int(event.get("cpus") or 1),
            executor=str(event.get("executor") or ""),
            tf_port=tf_port if isinstance(tf_port, int) else None,
            jax_port=jax_port if isinstance(jax_port, int) else None,
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

    For TensorFlow and Keras: ``TF_CONFIG`` lists every rank's reserved port as a worker (rank
    N is worker N; worker 0 acts as chief), so ``tf.distribute.MultiWorkerMirroredStrategy()``
    needs no arguments; it is left out when a rank reserved no port. The
    ``KERAS_DISTRIBUTION_*`` variables point Keras 3's ``keras.distribution.initialize()``
    (the JAX backend's coordinator) at MASTER_ADDR:MASTER_PORT. ``NBDIST_JAX_COORDINATOR`` is
    rank 0's host and the port its supervisor held for plain JAX's coordinator, which
    ``rank/jax_cluster.py`` hands to ``jax.distributed.initialize()``.
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
    tf_workers = _tf_workers(hellos, world_size)
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
            # Keras 3's keras.distribution.initialize(); on JAX, job 0 is the coordinator.
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": address(zero.host, zero.port),
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(world_size),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(rank),
        }
        if zero.jax_port is not None:
            # jax.distributed.initialize() with no arguments (rank/jax_cluster.py).
            env["NBDIST_JAX_COORDINATOR"] = address(zero.host, zero.jax_port)
        if tf_workers is not None:
            env["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": tf_workers}, "task": {"type": "worker", "index": rank},
            })
        if use_gpus:
            gpus = _host_gpus(hellos, peers)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            env["NBDIST_GPU"] = gpus[local_rank]
        env.update(user)
        envs[rank] = env
    return envs


def address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (as gRPC and JAX's coordinator read it)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _tf_workers(hellos: Mapping[int, Hello], world_size: int) -> list[str] | None:
    """TF_CONFIG's worker list in rank order, or None when a rank reserved no port.

    Two ranks of one host that offered the same port would make one TensorFlow worker fail to
    start its server: an error here is clearer (and reservations held until the rank starts,
    as ``rank/supervisor.py`` does, make it impossible between nbdist's own ranks).
    """
    workers = []
    for rank in range(world_size):
        hello = hellos[rank]
        if hello.tf_port is None:
            return None
        workers.append(address(hello.host, hello.tf_port))
    clash = sorted({w for w in workers if workers.count(w) > 1})
    if clash:
        raise ValueError(f"two ranks reserved the same TensorFlow worker address {clash[0]}")
    return workers


def _host_gpus(hellos: Mapping[int, Hello], peers: Sequence[int]) -> list[str]:
    gpus: list[str] = []
    for rank in peers:
        own = [g for g in hellos[rank].gpus if g not in gpus]
        if not own:
            raise ValueError(f"rank {rank} has no GPU of its own on {hellos[rank].host}")
        gpus.append(own[0])
    return gpus

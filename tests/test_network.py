"""Networking parts that need no second host: bind vs advertise, the network settings, the
interface for gloo/NCCL, the rank side of the keepalive, and the text view of lost ranks.

The same things on real (simulated) hosts: ``tests/multihost``.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

import nbdist
from nbdist import channel, events, launch, state
from nbdist.rank.supervisor import RankSpec, Supervisor, interface_to
from nbdist.views.text import TextView
from nbdist.world import Hello, plan_world


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[launch.Settings]:
    """The kernel's network settings, restored after the test; no NBDIST_* variables."""
    for name in ("NBDIST_DRIVER_HOST", "NBDIST_DRIVER_PORT", "NBDIST_HEARTBEAT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    saved = launch.Settings(**vars(launch.settings))
    yield launch.settings
    for name, value in vars(saved).items():
        setattr(launch.settings, name, value)


def test_server_listens_on_one_address_and_advertises_another() -> None:
    """The advertised address need not be local (a forwarder's): the server binds its own."""
    server = events.EventServer(events.DriverAddress("127.0.0.1", "192.0.2.7", 0, "test"))
    try:
        host, port = server.address
        assert host == "192.0.2.7"  # what ranks are told (TEST-NET-1: no such host here)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert b'"challenge"' in sock.makefile("rb").readline()
    finally:
        server.close()


def test_server_on_every_interface_is_reached_at_any_local_address() -> None:
    """Bound to every interface (Spark's bindAddress unset), loopback reaches it too."""
    server = events.EventServer(events.DriverAddress("", "driver-host", 0))
    try:
        with socket.create_connection(("127.0.0.1", server.address[1]), timeout=5) as sock:
            assert b'"challenge"' in sock.makefile("rb").readline()
    finally:
        server.close()


def test_network_settings_config_wins_over_environment(
    settings: launch.Settings, monkeypatch: pytest.MonkeyPatch, ip: Any
) -> None:
    """%config DistMagics.<name> wins over NBDIST_<NAME>, which applies when it is unset."""
    assert launch.setting("driver_host") == ("", "")
    monkeypatch.setenv("NBDIST_DRIVER_HOST", "gateway")
    assert launch.setting("driver_host") == ("gateway", "NBDIST_DRIVER_HOST")
    ip.run_line_magic("config", "DistMagics.driver_host = 'forwarder'")
    try:
        assert launch.setting("driver_host") == ("forwarder", "%config DistMagics.driver_host")
    finally:
        ip.run_line_magic("config", "DistMagics.driver_host = ''")
    assert launch.setting("driver_host") == ("gateway", "NBDIST_DRIVER_HOST")


def test_heartbeat_timeout_default_off_and_bounds(
    settings: launch.Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 s by default; 0 turns the keepalive off; below 10 s or not a number is refused."""
    assert launch.heartbeat_timeout() == launch.HEARTBEAT_TIMEOUT_S == 60
    monkeypatch.setenv("NBDIST_HEARTBEAT_TIMEOUT", "0")
    assert launch.heartbeat_timeout() is None
    monkeypatch.setenv("NBDIST_HEARTBEAT_TIMEOUT", "5")
    with pytest.raises(ValueError, match="NBDIST_HEARTBEAT_TIMEOUT=5: the heartbeat timeout "
                                         "must be at least 10 s"):
        launch.heartbeat_timeout()
    settings.heartbeat_timeout = 30
    assert launch.heartbeat_timeout() == 30


def test_network_traits_refuse_bad_values_when_set(ip: Any, settings: launch.Settings) -> None:
    """``%config`` refuses a heartbeat timeout under 10 s and a port out of range at once."""
    from traitlets import TraitError

    from nbdist.magics import DistMagics

    magics = ip.magics_manager.registry[DistMagics.__name__]
    with pytest.raises(TraitError, match="DistMagics.heartbeat_timeout=5.0: the heartbeat "
                                          "timeout must be at least 10 s"):
        magics.heartbeat_timeout = 5.0
    with pytest.raises(TraitError, match="not 70000"):
        magics.driver_port = 70000
    magics.heartbeat_timeout = 0.0  # off
    assert launch.heartbeat_timeout() is None
    magics.heartbeat_timeout = None
    assert launch.heartbeat_timeout() == 60


def test_interface_to_an_address_is_the_one_routing_there() -> None:
    """Loopback addresses are reached through ``lo``; an unroutable one gives None."""
    assert interface_to("127.0.0.1") == "lo"
    assert interface_to("no-such-host.invalid") is None


def test_a_connect_clients_address_is_the_one_it_reaches_the_cluster_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without SPARK_LOCAL_IP or NBDIST_HOST, the address told to the ranks is the source
    address toward the first cluster host this machine does not reach over loopback (not
    what its name resolves to: 127.0.1.1 on Debian); the master URL names those hosts."""
    import psutil

    from nbdist.launch.spark import cluster_hosts

    assert cluster_hosts("spark://10.0.0.5:7077,m2:7077", "srv") == ["10.0.0.5", "m2", "srv"]
    assert cluster_hosts("k8s://https://api.k:443") == ["api.k"]
    assert cluster_hosts("local[4]", "localhost") == ["localhost"]
    assert cluster_hosts("yarn") == []
    own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not own:
        pytest.skip("this machine has no IPv4 address but loopback ones")
    for name in ("SPARK_LOCAL_IP", "NBDIST_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert channel.hostname_for_peers(["localhost", own[0]]) == own[0]
    assert channel.hostname_for_peers(["no-such-host.invalid", own[0]]) == own[0]
    monkeypatch.setenv("NBDIST_HOST", "10.9.9.9")  # said explicitly: it wins
    assert channel.hostname_for_peers([own[0]]) == "10.9.9.9"


def test_ranks_get_the_interface_to_master_addr_unless_set() -> None:
    """GLOO/NCCL_SOCKET_IFNAME name the interface routing to MASTER_ADDR; --env wins."""

    def ifnames() -> tuple[str | None, str | None]:
        import os

        return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")

    assert nbdist.run(ifnames, np=1, backend="local").result() == ("lo", "lo")
    chosen = nbdist.run(ifnames, np=1, backend="local", env={"GLOO_SOCKET_IFNAME": "eth7"})
    assert chosen.result() == ("eth7", "lo")


class _World:
    """The driver's side of one rank's job, as ``Job`` does it: the world on hello."""

    def __init__(self, server: events.EventServer, job: str) -> None:
        self.server, self.job = server, job
        self.connected = threading.Event()

    def on_connect(self, rank: int, hello: channel.Event) -> None:
        env = plan_world({0: Hello.from_event(0, hello)}, 1, "run", self.job)[0]
        self.server.send(self.job, rank, {"t": "world", "env": env})
        self.connected.set()

    def on_event(self, rank: int, event: channel.Event) -> None:
        pass

    def on_disconnect(self, rank: int) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("pinged", [False, True])
def test_a_rank_stops_when_its_driver_falls_silent(pinged: bool) -> None:
    """With a heartbeat timeout, a rank whose driver says nothing stops; pings keep it alive."""
    timeout = 3.0
    server = events.EventServer()
    secret = channel.new_secret()
    world = _World(server, "keepalive")
    server.add_job("keepalive", secret, world)
    def forever() -> None:
        import time

        while True:
            time.sleep(0.05)

    payload = cloudpickle.dumps({"kind": "call", "fn": forever, "args": (), "kwargs": {}})
    supervisor = Supervisor(RankSpec(0, 1, "keepalive", secret, server.address, payload,
                                     heartbeat_timeout=timeout))
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(supervisor.run()), daemon=True)
    started = time.monotonic()
    runner.start()
    try:
        assert world.connected.wait(60)
        if pinged:
            while time.monotonic() - started < 3 * timeout:
                server.send("keepalive", 0, {"t": "ping"})
                time.sleep(0.2)  # a pace: the driver pings every few seconds
            assert not outcome, "the rank stopped although its driver kept pinging"
            supervisor.cancel()
        runner.join(60)
        assert outcome and outcome[0].status == "cancelled"
    finally:
        supervisor.cancel()
        runner.join(10)
        server.close()


def test_a_rank_that_ended_is_not_heard_from_again() -> None:
    """The text view says when a rank falls silent and when it talks again, but a rank that
    ended (failed, say) is not "heard from again"."""
    job = state.JobState("j1", "spark", 2)
    for rank in (0, 1):
        job.apply(rank, {"t": "state", "state": "running", "pid": 10 + rank})
    out = io.StringIO()
    view = TextView(job, stream=out)
    with job.lock:
        for r in job.ranks:
            r.last_seen = time.time() - state.SILENT_AFTER_S - 1
    view.update()
    assert "[rank 0] silent since" in out.getvalue()
    assert "[rank 1] silent since" in out.getvalue()
    job.set_rank(1, state.FAILED)
    job.apply(0, {"t": "hb"})
    view.update()
    assert "[rank 0] heard from again" in out.getvalue()
    assert "[rank 1] heard from again" not in out.getvalue()

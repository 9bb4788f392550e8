"""The event channel: authenticated JSON lines, strangers and garbage rejected."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from nbdist import events

from .conftest import wait_for


class Recorder:
    def __init__(self) -> None:
        self.connected: list[int] = []
        self.events: list[tuple[int, dict[str, object]]] = []
        self.lock = threading.Lock()

    def on_connect(self, rank: int, hello: dict[str, object]) -> None:
        self.connected.append(rank)

    def on_event(self, rank: int, event: dict[str, object]) -> None:
        with self.lock:
            self.events.append((rank, event))

    def on_disconnect(self, rank: int) -> None:
        pass


@pytest.fixture
def server() -> Iterator[events.EventServer]:
    srv = events.EventServer("127.0.0.1")
    yield srv
    srv.close()


def test_authenticated_client_round_trip(server: events.EventServer) -> None:
    """A client with the job's secret delivers events and receives the driver's messages."""
    rec, secret = Recorder(), events.new_secret()
    server.add_job("j1", secret, rec)
    got: list[dict[str, object]] = []
    client = events.EventClient(server.address, "j1", 3, secret, {"host": "h"}, got.append)
    for i in range(100):
        client.send({"t": "metrics", "values": {"i": i}})
    wait_for(lambda: len(rec.events) == 100, 10, "100 events")
    assert rec.connected == [3] and rec.events[-1] == (3, {"t": "metrics", "values": {"i": 99}})
    assert server.send("j1", 3, {"t": "world", "env": {"RANK": "3"}})
    wait_for(lambda: got, 10, "the world message")
    assert got[0]["env"] == {"RANK": "3"}
    client.close()


@pytest.fixture
def raw(server: events.EventServer) -> Iterator[object]:
    """Open raw connections to the server; all closed after the test."""
    socks: list[socket.socket] = []

    def connect() -> tuple[socket.socket, str]:
        sock = socket.create_connection(server.address, timeout=5)
        socks.append(sock)
        with sock.makefile("rb") as f:
            challenge = json.loads(f.readline())
        return sock, challenge["nonce"]

    yield connect
    for sock in socks:
        sock.close()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_wrong_secret_garbage_and_replay_are_rejected(server: events.EventServer, raw) -> None:
    """Bad MACs, non-JSON and a hello replayed on a new connection are dropped and counted."""
    rec, secret = Recorder(), events.new_secret()
    server.add_job("j1", secret, rec)

    sock, nonce = raw()
    sock.sendall(events.encode({"t": "hello", "job": "j1", "rank": 0,
                                "mac": events.sign(events.new_secret(), nonce, "j1", 0)}))
    assert _closed(sock)

    sock, _ = raw()
    sock.sendall(b"\x00\xff garbage\n")
    assert _closed(sock)

    sock, nonce = raw()
    good = events.encode({"t": "hello", "job": "j1", "rank": 0,
                          "mac": events.sign(secret, nonce, "j1", 0)})
    sock.sendall(good)
    sock2, _ = raw()
    sock2.sendall(good)  # the same hello against another nonce
    assert _closed(sock2)

    sock3, _ = raw()
    sock3.sendall(b"x" * (events.MAX_HELLO_BYTES + 10))  # an endless first line
    assert _closed(sock3)

    wait_for(lambda: server.rejected == 4, 10, "4 rejections")
    sock.sendall(events.encode({"t": "metrics", "values": {"ok": 1}}))
    wait_for(lambda: rec.events, 10, "the legitimate event")
    assert rec.connected == [0]
    sock.close()


def test_unknown_job_is_rejected(raw) -> None:
    """A hello for a job the server does not know is dropped."""
    sock, nonce = raw()
    sock.sendall(events.encode({"t": "hello", "job": "nope", "rank": 0, "mac": "00"}))
    assert _closed(sock)


def test_free_port_is_below_the_ephemeral_range() -> None:
    """MASTER_PORT candidates come from outside the range the kernel hands out itself."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    port = events.free_port()
    assert 10000 <= port < low
    socket.create_server(("", port)).close()

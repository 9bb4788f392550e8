"""The event channel: authenticated JSON lines, strangers and garbage rejected."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from nbdist import channel, events, launch, state
from nbdist.rank.client import LAZY_S, EventClient

from . import hostile
from .helpers import wait_for


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
    """A client with the job's secret delivers output in order and gets the driver's messages."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    got: list[dict[str, object]] = []
    client = EventClient(server.address, "j1", 3, secret, {"host": "h"}, got.append)
    for i in range(100):
        client.send({"t": "out", "s": "o", "text": f"{i}\n"})
    expected = "".join(f"{i}\n" for i in range(100))

    def text() -> str:
        with rec.lock:
            return "".join(str(e["text"]) for _, e in rec.events)

    wait_for(lambda: text() == expected, 10, "100 lines, in order")
    assert rec.connected == [3] and len(rec.events) < 100  # queued output was merged
    assert server.send("j1", 3, {"t": "world", "env": {"RANK": "3"}})
    wait_for(lambda: got, 10, "the world message")
    assert got[0]["env"] == {"RANK": "3"}
    client.close()


def test_the_last_output_arrives_when_the_driver_writes_during_the_close(
    server: events.EventServer,
) -> None:
    """Messages from the driver while a client closes do not cost the rank its last lines."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    wait_for(lambda: rec.connected, 10, "the hello")
    chunk = ("x" * 999 + "\n") * 100
    for _ in range(100):  # 10 MB: still being read by the server when the client closes
        client.send({"t": "out", "s": "o", "text": chunk})
    closer = threading.Thread(target=client.close)
    closer.start()
    while closer.is_alive():  # what the driver says meanwhile (a cancel, a new pace)
        server.send("j1", 0, {"t": "pace", "every": 0.01})
    closer.join()

    def lines() -> int:
        with rec.lock:
            return sum(str(e["text"]).count("\n") for _, e in rec.events)

    wait_for(lambda: lines() == 10_000, 10, "every line")
    assert client.dropped == 0


def test_lazy_events_are_coalesced_and_close_sends_them(server: events.EventServer) -> None:
    """Progress keeps the latest update per bar, metrics merge, heartbeats fold; none is lost."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    for i in range(1, 101):
        client.send({"t": "progress", "id": 1, "n": i, "total": 100})
        client.send({"t": "progress", "id": 2, "n": 2 * i, "total": 200})
        client.send({"t": "metrics", "values": {"loss": 1 / i, f"k{i % 3}": i}})
        client.send({"t": "hb"})
    client.close()  # at once: what is still queued goes out first

    def latest() -> tuple[dict[object, object], dict[str, object]]:
        with rec.lock:
            got = [e for _, e in rec.events]
        bars = {e["id"]: e["n"] for e in got if e["t"] == "progress"}
        metrics: dict[str, object] = {}
        for e in got:
            if e["t"] == "metrics":
                metrics.update(cast("dict[str, object]", e["values"]))
        return bars, metrics

    expected = ({1: 100, 2: 200}, {"loss": 1 / 100, "k0": 99, "k1": 100, "k2": 98})
    wait_for(lambda: latest() == expected, 10, "the latest progress and metrics")
    kinds = [e["t"] for _, e in rec.events]
    assert len(kinds) < 400 and kinds.count("hb") <= kinds.count("progress")
    assert client.dropped == 0


def test_a_line_may_carry_an_array_of_events(server: events.EventServer, raw) -> None:
    """Protocol 2: one line with an array of events delivers each; an array of junk is refused."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    sock, nonce = raw()
    sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": 0,
                                "mac": channel.sign(secret, nonce, "j1", 0)}))
    sock.sendall(b'[{"t": "hb"}, {"t": "metrics", "values": {"a": 1}}]\n')
    wait_for(lambda: len(rec.events) == 2, 10, "both events of the array")
    assert [e["t"] for _, e in rec.events] == ["hb", "metrics"]
    sock.sendall(b'[{"t": "hb"}, 3]\n')
    assert _closed(sock) and server.rejected == 1 and len(rec.events) == 2


class BatchRecorder(Recorder):
    """A job that takes the events of a write together."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[list[str]] = []

    def on_events(self, rank: int, batch: list[dict[str, object]]) -> None:
        with self.lock:
            self.writes.append([str(e["t"]) for e in batch])


def test_a_job_that_takes_writes_whole_gets_each_array_in_one_call(
        server: events.EventServer, raw) -> None:
    """A job with ``on_events`` gets an array's events in one call, in order; a lone event
    still comes through ``on_event``."""
    rec, secret = BatchRecorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    sock, nonce = raw()
    sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": 0,
                                "mac": channel.sign(secret, nonce, "j1", 0)}))
    sock.sendall(b'[{"t": "out", "s": "o", "text": "x\\n"}, {"t": "hb"}, {"t": "res"}]\n')
    sock.sendall(b'{"t": "metrics", "values": {"a": 1}}\n')
    wait_for(lambda: rec.writes and rec.events, 10, "the array and the lone event")
    assert rec.writes == [["out", "hb", "res"]] and [e["t"] for _, e in rec.events] == ["metrics"]


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
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)

    sock, nonce = raw()
    sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": 0,
                                "mac": channel.sign(channel.new_secret(), nonce, "j1", 0)}))
    assert _closed(sock)

    sock, _ = raw()
    sock.sendall(b"\x00\xff garbage\n")
    assert _closed(sock)

    sock, nonce = raw()
    good = channel.encode({"t": "hello", "job": "j1", "rank": 0,
                          "mac": channel.sign(secret, nonce, "j1", 0)})
    sock.sendall(good)
    sock2, _ = raw()
    sock2.sendall(good)  # the same hello against another nonce
    assert _closed(sock2)

    sock3, _ = raw()
    sock3.sendall(b"x" * (channel.MAX_HELLO_BYTES + 10))  # an endless first line
    assert _closed(sock3)

    wait_for(lambda: server.rejected == 4, 10, "4 rejections")
    sock.sendall(channel.encode({"t": "metrics", "values": {"ok": 1}}))
    wait_for(lambda: rec.events, 10, "the legitimate event")
    assert rec.connected == [0]
    sock.close()


def test_unknown_job_is_rejected(raw) -> None:
    """A hello for a job the server does not know is dropped."""
    sock, nonce = raw()
    sock.sendall(channel.encode({"t": "hello", "job": "nope", "rank": 0, "mac": "00"}))
    assert _closed(sock)


def _three_ranks(server: events.EventServer, raw) -> list[tuple[socket.socket, Any]]:
    """Three ranks of job ``j1`` connected by hand: each one's socket and its reader."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    readers = []
    for rank in range(3):
        sock, nonce = raw()
        sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": rank,
                                    "mac": channel.sign(secret, nonce, "j1", rank)}))
        readers.append((sock, sock.makefile("rb")))
    wait_for(lambda: len(rec.connected) == 3, 10, "three ranks")
    return readers


def test_the_server_paces_its_clients_by_how_many_are_connected(
    server: events.EventServer, raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More connections make the server ask every client to write less often at once; fewer,
    more often once the closes settled, in one message however many closed."""
    monkeypatch.setattr(events, "MAX_WRITES_PER_S", 100)
    monkeypatch.setattr(events, "REPACE_AFTER_S", 0.3)
    readers = _three_ranks(server, raw)

    def paces(reader, until: float) -> list[float]:  # the paces told, up to ``until``
        got: list[float] = []
        while not got or got[-1] != pytest.approx(until):
            got.append(json.loads(reader.readline())["every"])
        return got

    assert paces(readers[0][1], 0.03) == pytest.approx([0.01, 0.02, 0.03])
    assert paces(readers[2][1], 0.03) == pytest.approx([0.03])
    for sock, reader in readers[1:]:
        reader.close()
        sock.close()
    assert paces(readers[0][1], 0.01) == pytest.approx([0.01])
    readers[0][1].close()


def test_the_shorter_pace_comes_at_most_repace_at_most_s_after_the_first_close(
    server: events.EventServer, raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closes that would postpone the shorter pace for a minute (REPACE_AFTER_S) still have it
    told REPACE_AT_MOST_S after the first of them: a job ending rank by rank does not keep its
    neighbours on its slow pace."""
    monkeypatch.setattr(events, "MAX_WRITES_PER_S", 100)
    monkeypatch.setattr(events, "REPACE_AFTER_S", 60.0)
    monkeypatch.setattr(events, "REPACE_AT_MOST_S", 0.5)
    readers = _three_ranks(server, raw)
    sock0, reader0 = readers[0]
    while json.loads(reader0.readline())["every"] != pytest.approx(0.03):
        pass
    for sock, reader in readers[1:]:
        reader.close()
        sock.close()
    sock0.settimeout(30)  # without the bound the pace would come after 60 s: fail at 30
    assert json.loads(reader0.readline())["every"] == pytest.approx(0.01)
    reader0.close()


def test_large_jobs_are_asked_for_fewer_writes_and_no_rank_for_a_silent_interval() -> None:
    """Up to 256 ranks the server aims at 400 writes a second, at 1024 ranks and beyond at 250,
    and never asks for an interval that would make a rank look silent."""
    assert [events.pace_for(n) for n in (1, 4, 16, 256)] == pytest.approx(
        [channel.SEND_EVERY_S, 0.01, 0.04, 0.64])
    assert 512 / events.pace_for(512) == pytest.approx(350)
    assert events.pace_for(1024) == pytest.approx(1024 / 250)
    assert events.pace_for(1200) == pytest.approx(1200 / 250)
    # Beyond, one heartbeat: heartbeats arrive well within the shortest heartbeat timeout.
    assert events.pace_for(2048) == events.pace_for(100_000) == events.MAX_EVERY_S
    assert events.MAX_EVERY_S <= state.HEARTBEAT_S
    assert 2 * events.MAX_EVERY_S <= launch.MIN_HEARTBEAT_TIMEOUT_S


def _paced_client(server: events.EventServer) -> tuple[Recorder, EventClient]:
    """A client told to write at most every 30 s, whose first line went at once."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    wait_for(lambda: rec.connected, 10, "the hello")
    assert server.send("j1", 0, {"t": "pace", "every": 30})
    wait_for(lambda: client._every == 30, 10, "the pace")
    client.send({"t": "out", "s": "o", "text": "first\n"})
    wait_for(lambda: rec.events, 10, "the first line, at once")
    return rec, client


def test_a_paced_client_holds_what_follows_a_write(server: events.EventServer) -> None:
    """Told to write at most every 30 s, a client sends a first event at once, holds the next
    (merged with what follows) and sends it when closed."""
    rec, client = _paced_client(server)
    client.send({"t": "out", "s": "o", "text": "second\n"})
    client.send({"t": "out", "s": "o", "text": "third\n"})
    time.sleep(0.3)  # a window to see that nothing else goes, not a wait for anything
    assert [e["text"] for _, e in rec.events] == ["first\n"]
    client.close()
    wait_for(lambda: len(rec.events) == 2, 10, "the held lines")
    assert rec.events[1][1]["text"] == "second\nthird\n"


def test_the_end_of_a_session_cell_goes_at_once_whatever_the_pace(
    server: events.EventServer,
) -> None:
    """Told to write at most every 30 s, a client still sends a session cell's end (and the
    output held before it) right away: the notebook waits for it."""
    rec, client = _paced_client(server)
    client.send({"t": "out", "s": "o", "text": "printed by the cell\n"})
    client.send({"t": "cell_result", "cell": 1, "mac": "m", "type": "int"})
    wait_for(lambda: len(rec.events) == 3, 20, "the cell's end, well before the 30 s pace")
    assert [e["t"] for _, e in rec.events] == ["out", "out", "cell_result"]
    client.close()


def test_a_lazy_event_waits_for_the_next_write_and_is_never_merged(
    server: events.EventServer,
) -> None:
    """An event sent lazily (a session rank's "running") goes with the next event that must
    go (a cell's end), or on its own after ``LAZY_S``; two of them both arrive."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    wait_for(lambda: rec.connected, 10, "the hello")
    client.send_all([{"t": "state", "state": "running"}], lazy=True)
    client.send_all([{"t": "state", "state": "running"}], lazy=True)
    client.send({"t": "cell_result", "cell": 1})
    wait_for(lambda: len(rec.events) == 3, 10, "the cell's end, with what waited")
    assert [e["t"] for _, e in rec.events] == ["state", "state", "cell_result"]
    started = time.monotonic()
    client.send_all([{"t": "state", "state": "running"}], lazy=True)
    wait_for(lambda: len(rec.events) == 4, 10, "the lazy event on its own")
    assert time.monotonic() - started >= LAZY_S * 0.9  # it waited its turn
    client.close()


def test_cell_ends_written_by_their_senders_keep_each_senders_order(
    server: events.EventServer,
) -> None:
    """Events that end a session cell are written by the thread that sends them, yet what
    each thread sends (output, small and large blocks, cell ends) arrives whole and in its
    order while other threads send too (the pumps and the control reader of one rank)."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)

    def sender(k: int) -> None:
        for i in range(200):
            client.send({"t": "out", "s": "o" if k % 2 else "e", "text": f"{k}:{i}\n"})
            blob = bytes([k]) * (100_000 if i % 50 == 0 else i)
            client.send_all([{"t": "cell_value", "cell": k, "i": i},
                             {"t": "cell_data", "cell": k, "i": i, "data": blob},
                             {"t": "cell_result", "cell": k, "i": i}])

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    wait_for(lambda: sum(e["t"] == "cell_result" for _, e in rec.events) == 800, 30,
             "every cell end")
    for k in range(4):
        mine = [e for _, e in rec.events if e.get("cell") == k]
        assert [(e["t"], e["i"]) for e in mine] == [
            (t, i) for i in range(200) for t in ("cell_value", "cell_data", "cell_result")]
        sizes = [100_000 if i % 50 == 0 else i for i in range(200)]
        assert [bytes(e["data"]) for e in mine if e["t"] == "cell_data"] == [  # type: ignore
            bytes([k]) * n for n in sizes]
        text = "".join(str(e["text"]) for _, e in rec.events
                       if e["t"] == "out" and e["s"] == ("o" if k % 2 else "e"))
        assert [line for line in text.splitlines() if line.startswith(f"{k}:")] == [
            f"{k}:{i}" for i in range(200)]
    assert server.rejected == 0 and client.dropped == 0


def test_free_port_is_below_the_ephemeral_range() -> None:
    """MASTER_PORT candidates come from outside the range the kernel hands out itself."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    port = channel.free_port()
    assert 10000 <= port < low
    socket.create_server(("", port)).close()


# -- hostile input ---------------------------------------------------------------------------
def test_every_malformed_input_closes_its_connection_and_the_server_goes_on(
    server: events.EventServer,
) -> None:
    """Deep nesting, a non-ASCII mac, huge numbers, wrong types in every field, NUL bytes, bad
    UTF-8: each connection is closed and counted, and then a rank still gets through."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    cases = hostile.malformed("j1")
    assert hostile.send_each(server.address, cases) == []
    wait_for(lambda: server.rejected == len(cases), 10, f"{len(cases)} rejections")
    assert server._thread.is_alive()
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    client.send({"t": "out", "s": "o", "text": "still here\n"})
    wait_for(lambda: rec.events, 10, "the rank's line")
    client.close()


def test_a_hello_for_a_job_that_just_ended_is_rejected(server: events.EventServer) -> None:
    """A correctly signed hello for a job removed from the server is closed and counted."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    server.remove_job("j1")
    sock, nonce = hostile.greet(server.address)
    with sock:
        sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": 0,
                                    "mac": channel.sign(secret, nonce, "j1", 0)}))
        assert hostile.closed_on_us(sock)
    wait_for(lambda: server.rejected == 1, 10, "the rejection")
    assert rec.connected == []


def test_an_authenticated_connection_breaking_the_protocol_is_closed_alone(
    server: events.EventServer, raw
) -> None:
    """After its hello, deep nesting, bad block sizes or a block inside an array close that
    connection only; another rank of the job goes on."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    other = EventClient(server.address, "j1", 1, secret, {}, lambda m: None)
    bad = [b"[" * 5000 + b"\n", b'{"t":"x","raw":-1}\n', b'{"t":"x","raw":"10"}\n',
           b'{"t":"x","raw":%d}\n' % (channel.MAX_BLOCK_BYTES + 1), b'[{"t":"x","raw":1}]\n',
           b'{"t":"x","raw":1.5}\n', b"\xff\n"]
    for line in bad:
        sock, nonce = raw()
        sock.sendall(channel.encode({"t": "hello", "job": "j1", "rank": 0,
                                    "mac": channel.sign(secret, nonce, "j1", 0)}) + line)
        assert _closed(sock)
    wait_for(lambda: server.rejected == len(bad), 10, "every bad connection counted")
    other.send({"t": "out", "s": "o", "text": "rank 1 goes on\n"})
    wait_for(lambda: any(r == 1 for r, _ in rec.events), 10, "rank 1's line")
    other.close()


def test_a_handler_that_raises_on_connect_costs_only_that_connection(
    server: events.EventServer,
) -> None:
    """A job whose on_connect raises loses that connection; the server serves the next one."""

    class Broken(Recorder):
        def on_connect(self, rank: int, hello: dict[str, object]) -> None:
            raise RuntimeError("a bug in a job's handler")

    secret = channel.new_secret()
    server.add_job("broken", secret, Broken())
    client = EventClient(server.address, "broken", 0, secret, {}, lambda m: None)
    wait_for(lambda: not client.alive, 10, "the connection closed")
    client.close()
    assert server.rejected == 1
    rec = Recorder()
    server.add_job("j2", secret, rec)
    good = EventClient(server.address, "j2", 0, secret, {}, lambda m: None)
    wait_for(lambda: rec.connected == [0], 10, "the next rank")
    good.close()


def test_binary_blocks_reach_the_job_whole_and_in_order(server: events.EventServer) -> None:
    """Events with bytes data travel as raw blocks, between ordinary events, in order."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    assert client.protocol >= 3
    blobs = [bytes([i]) * (i * 100_003 % channel.MAX_BLOCK_BYTES) for i in range(1, 30)]
    blobs.append(b"\n" * 1000 + b"[" * 1000)  # block bytes are never read as lines
    for i, blob in enumerate(blobs):
        client.send({"t": "blob", "i": i, "data": blob})
        client.send({"t": "out", "s": "o", "text": f"after {i}\n"})
    client.close()

    def blobs_got() -> list[bytes]:
        with rec.lock:
            return [bytes(e["data"]) for _, e in rec.events if e["t"] == "blob"]  # type: ignore

    wait_for(lambda: len(blobs_got()) == len(blobs), 30, "every block")
    assert blobs_got() == blobs
    texts = "".join(str(e["text"]) for _, e in rec.events if e["t"] == "out")
    assert texts == "".join(f"after {i}\n" for i in range(len(blobs)))
    assert server.rejected == 0


def test_a_slowloris_is_cut_at_the_deadline_and_counted(
    server: events.EventServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stranger trickling a byte at a time without a newline is closed at AUTH_DEADLINE_S."""
    monkeypatch.setattr(events, "AUTH_DEADLINE_S", 1.0, raising=False)
    cut = hostile.slowloris(server.address, every=0.2, limit_s=60)
    assert cut is not None, "the server kept the slowloris connection for a minute"
    wait_for(lambda: server.rejected == 1, 10, "the rejection")


@pytest.mark.slow
def test_a_thousand_idle_strangers_are_cut_and_counted_and_a_rank_gets_in(
    server: events.EventServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1000 connections that never say hello are closed (by the cap, then the deadline) and
    counted; a rank connecting while they are held is served."""
    monkeypatch.setattr(events, "AUTH_DEADLINE_S", 3.0, raising=False)
    with hostile.more_files(2600):
        strangers = [socket.create_connection(server.address, timeout=30) for _ in range(1000)]
        try:
            rec, secret = Recorder(), channel.new_secret()
            server.add_job("j1", secret, rec)
            client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
            client.send({"t": "out", "s": "o", "text": "in\n"})
            wait_for(lambda: rec.events, 30, "the rank's line")
            wait_for(lambda: server.rejected == 1000, 60, "every stranger cut")
            assert len(server._waiting) == 0
            client.close()
            for sock in strangers:
                sock.settimeout(10)
                assert hostile.closed_on_us(sock)
        finally:
            for sock in strangers:
                sock.close()


@pytest.mark.slow
def test_8000_connections_of_64_kb_do_not_grow_the_kernel(server: events.EventServer) -> None:
    """8000 strangers sending 64 KB each without a newline cost the server little memory; all
    are cut and counted."""
    flooded = hostile.flood(server, 8000, 64 * 1024)
    assert flooded.rejected == 8000
    assert flooded.peak_growth < 100 * 2**20, (
        f"the server grew by {flooded.peak_growth / 2**20:.0f} MiB")


def test_a_reconnect_storm_leaves_one_connection_per_rank(server: events.EventServer) -> None:
    """A rank reconnecting 100 times replaces its connection each time: the older ones are
    closed on the server's side, one is left, and no descriptor is left behind."""
    import psutil

    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    fds_before = psutil.Process().num_fds()
    clients = []
    for _ in range(100):
        clients.append(EventClient(server.address, "j1", 0, secret, {}, lambda m: None))
    wait_for(lambda: len(rec.connected) == 100, 30, "every hello")
    wait_for(lambda: not any(c.alive for c in clients[:-1]), 30, "the replaced ones closed")
    assert clients[-1].alive and len(server._conns) == 1 and server.rejected == 0
    for client in clients:
        client.close()
    wait_for(lambda: not server._conns, 10, "the last one gone")
    wait_for(lambda: psutil.Process().num_fds() <= fds_before, 10, "no descriptor left")


def test_events_after_a_large_block_share_one_line() -> None:
    """The events that follow a binary block over ``BATCH_LINE_BYTES`` in a write still go
    together in one line (before: the block's size counted as the next line's, which then
    held one event alone)."""
    from nbdist.rank.client import BATCH_LINE_BYTES, _lines

    block = b"\0" * (2 * BATCH_LINE_BYTES)
    after = [{"t": "out", "s": "o", "text": f"{i}\n"} for i in range(3)]
    written = _lines([{"t": "cell_data", "cell": 1, "data": block}, *after])
    assert written[1] is block  # the block as it is, not copied
    assert bytes(written[-1]) == json.dumps(after, separators=(",", ":")).encode() + b"\n"


def test_an_event_json_cannot_take_is_reported_and_the_channel_goes_on(
    server: events.EventServer,
) -> None:
    """An event with a value JSON cannot encode arrives as a line on the rank's stderr naming
    it, from the sender thread or from a cell's end written by the sending thread, and every
    event after it still arrives (before: the write raised with ``_writing`` left set, and
    the channel sent nothing more)."""
    rec, secret = Recorder(), channel.new_secret()
    server.add_job("j1", secret, rec)
    client = EventClient(server.address, "j1", 0, secret, {}, lambda m: None)
    assert client.send({"t": "metrics", "values": {"loss": object()}})  # the sender writes it
    assert client.send({"t": "out", "s": "o", "text": "after\n"})
    # A cell's end goes in the calling thread's own write (PROMPT); its block's head is bad.
    assert client.send_all([{"t": "cell_data", "cell": {1, 2}, "data": b"xyz"},
                            {"t": "cell_result", "cell": 1, "sig": "s"}])
    assert client.send({"t": "out", "s": "o", "text": "still\n"})

    def got() -> list[dict[str, object]]:
        with rec.lock:
            return [e for _, e in rec.events]

    wait_for(lambda: any(e.get("text") == "still\n" for e in got()), 10, "the last line")
    reports = [str(e["text"]) for e in got() if e.get("s") == "e"]
    assert len(reports) == 2
    assert reports[0].startswith("nbdist: a 'metrics' event of this rank could not be sent")
    assert "TypeError: Object of type object is not JSON serializable" in reports[0]
    assert reports[1].startswith("nbdist: a 'cell_data' event")
    assert [e["t"] for e in got() if e.get("s") != "e"] == ["out", "cell_result", "out"]
    assert client.alive
    client.close()

"""The wire of the rank ↔ driver event channel, shared by both ends.

What the kernel's server (``nbdist.events``) and a rank's client (``nbdist.rank.client``) must
agree on: the protocol version, the hello's signature, how an event is encoded, the largest
binary block, the clients' write interval; and two helpers both sides use to pick addresses.
Standard library only (ranks import it).

The protocol, a small authenticated JSON-lines protocol over TCP; nothing on it is ever unpickled.

1. The server sends ``{"t": "challenge", "nonce": HEX, "v": 3}``.
2. The client answers ``{"t": "hello", "job": ID, "rank": R, "mac": HMAC, ...}`` where HMAC is
   HMAC-SHA256 of ``"{nonce}:{job}:{rank}"`` keyed by the job's secret. The secret travels with
   the payload (pipe or Spark closure), never on this channel; the nonce makes a recorded hello
   useless on another connection. A connection that does not prove the secret within
   ``AUTH_DEADLINE_S``, in at most ``MAX_HELLO_BYTES``, is closed and counted in
   :attr:`EventServer.rejected`; so is one that breaks any rule of the protocol, whatever it
   sent: handling one connection never stops the server.
3. Then both sides send one JSON value per line: an event object, or (rank → driver) an
   array of event objects sent together. Rank → driver: output batches,
   progress, metrics, state changes, heartbeats. Driver → rank: the rendezvous answer
   (``world``), ``cancel``, and ``ping`` (a remote job's keepalive; see ``nbdist.job``).
4. An event (alone on its line) with ``"raw": N`` is followed by N
   raw bytes (at most ``MAX_BLOCK_BYTES``), handed to the job as the event's ``data``: how a
   session cell's value travels in pieces without base64 or JSON (``nbdist.values``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from collections.abc import Iterable, Mapping
from typing import Any

PROTOCOL_VERSION = 3
#: Longest line accepted before authentication (the hello, a few hundred bytes).
MAX_HELLO_BYTES = 16 * 1024
#: Longest binary block an event may announce (protocol 3, item 4 above).
MAX_BLOCK_BYTES = 16 * 1024 * 1024
#: A client writes at most this often; events sent in between go together in the next write.
SEND_EVERY_S = 0.005
#: Events that end a session cell, which the notebook waits for: a client writes them at once
#: (not ``SEND_EVERY_S`` after its last write, nor its pace), and the server reads on without
#: the pause it takes after a wake-up (``events.PACE_S``). A cell's round trip is a handful of
#: writes, so this costs nothing in a flood, and saves a trivial cell most of its latency.
PROMPT = frozenset({"cell_value", "cell_data", "cell_result", "cell_error"})

Event = dict[str, Any]


def new_secret() -> str:
    return secrets.token_hex(32)


def sign(secret: str, nonce: str, job_id: str, rank: int) -> str:
    msg = f"{nonce}:{job_id}:{rank}".encode()
    return hmac.new(bytes.fromhex(secret), msg, hashlib.sha256).hexdigest()


def encode(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def recv_some(sock: socket.socket, buf: bytearray | memoryview, size: int,
              flags: int) -> int | None:
    """Bytes read into ``buf`` (0: the peer closed or reset), None if none are there now."""
    try:
        return sock.recv_into(buf, size, flags)
    except BlockingIOError:
        return None
    except OSError:  # reset by the peer
        return 0


def free_port(host: str = "") -> int:
    """A TCP port for MASTER_PORT, chosen below the kernel's ephemeral range.

    Binding port 0 and closing it (what torchrun and TorchDistributor do) hands out a port
    from the ephemeral range, which the kernel may give to any outgoing connection before
    torch binds it. A port outside that range is never assigned implicitly, so once we saw it
    free only another program asking for that exact number could take it.
    """
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    top = max(low - 1, 10001)
    bottom = max(10000, top - 20000)
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randint(bottom, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # fall back to the OS's choice
        s.bind((host, 0))
        return int(s.getsockname()[1])


def source_address(host: str) -> str | None:
    """The address of this host that packets to ``host`` leave from, or None (no route, a
    name that does not resolve). A UDP socket's ``connect`` sends nothing: the kernel only
    picks the route, and with it the source address."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0]).split("%")[0]
    except (OSError, IndexError, UnicodeError):
        return None


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def hostname_for_peers(toward: Iterable[str] = ()) -> str:
    """This host's address as other hosts should use it.

    ``SPARK_LOCAL_IP`` or ``NBDIST_HOST`` when set (loopback when the tests say so); else the
    address that packets to the first of ``toward`` (hosts of the cluster) leave from, unless
    that is loopback (the host is this one); else what this host's name resolves to, which on
    Debian and Ubuntu is ``127.0.1.1`` (``/etc/hosts``), reached from this host only.
    """
    env = os.environ.get("SPARK_LOCAL_IP") or os.environ.get("NBDIST_HOST")
    if env:
        return env
    for host in toward:
        source = source_address(host)
        if source is not None and not _loopback(source):
            return source
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

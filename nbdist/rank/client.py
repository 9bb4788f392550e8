"""The rank's end of the event channel, used by the supervisor (``nbdist.rank.supervisor``).

See ``nbdist.events`` for the protocol and how clients coalesce their writes, and
``nbdist.channel`` for what both ends share. Standard library only.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from nbdist.channel import (
    MAX_HELLO_BYTES,
    PROMPT,
    PROTOCOL_VERSION,
    SEND_EVERY_S,
    Event,
    encode,
    sign,
)

log = logging.getLogger(__name__)
#: show them at most ten times a second, and one write then carries several events.
LAZY_S = 0.25
#: Bytes of events a client holds before ``send`` waits for the driver to take some: a rank
#: printing faster than the driver reads is slowed down, the supervisor's memory stays bounded.
MAX_PENDING_BYTES = 8 * 1024 * 1024
#: Queued output of a stream is merged into one event up to this many characters.
MERGE_CHARS = 64 * 1024
#: Most bytes of events put in one line (one JSON array) by a client.
BATCH_LINE_BYTES = 1024 * 1024
#: Binary blocks up to this size are copied into the write of the lines around them.
JOIN_BYTES = 64 * 1024
#: Events that need not go at once, and may be merged with a newer one of the same kind.
_LAZY = frozenset({"progress", "metrics", "hb", "res"})


class EventClient:
    """The rank-side end, used by the supervisor.

    ``send`` queues the event for a thread that writes it (see the module docstring for how
    events are coalesced), and never raises: when the driver cannot be reached the rank keeps
    running and the loss is counted in :attr:`dropped`. ``close`` sends what is still queued.
    """

    def __init__(
        self,
        address: tuple[str, int],
        job_id: str,
        rank: int,
        secret: str,
        hello: Mapping[str, Any],
        on_message: Callable[[Event], None],
        timeout: float = 10.0,
    ) -> None:
        self.dropped = 0
        self._on_message = on_message
        self._sock = socket.create_connection(address, timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = self._sock.makefile("rb")
        try:
            try:
                challenge = json.loads(self._reader.readline(MAX_HELLO_BYTES) or b"{}")
            except ValueError:
                challenge = {}
            nonce = challenge.get("nonce") if isinstance(challenge, dict) else None
            if not isinstance(nonce, str):
                raise ConnectionError(f"no nbdist event server at {address[0]}:{address[1]}")
            self._sock.settimeout(None)
            mac = sign(secret, nonce, job_id, rank)
            hello = {**hello, "t": "hello", "job": job_id, "rank": rank, "mac": mac}
            self._sock.sendall(encode(hello))
            version = challenge.get("v")
            if version != PROTOCOL_VERSION:
                # Ranks run the notebook's own nbdist (the same installation, or one Spark's
                # executors import from the same release): no older protocol is spoken.
                raise ConnectionError(
                    f"the nbdist event server at {address[0]}:{address[1]} speaks protocol "
                    f"{version}, this rank {PROTOCOL_VERSION}: install the same nbdist version "
                    f"on the driver and the ranks")
        except BaseException:
            self._reader.close()
            self._sock.close()
            raise
        #: The server's protocol version (always ``PROTOCOL_VERSION``; see the module docstring).
        self.protocol: int = version
        self._pending: list[Event] = []
        self._pending_bytes = 0
        self._urgent = False  # something in _pending must go without waiting LAZY_S
        self._prompt = False  # something in _pending goes now, whatever the pace (PROMPT)
        self._since = 0.0  # when the oldest pending event was queued
        self._last = 0.0  # when the last write ended
        self._writing = False  # a thread is writing a batch (one at a time, in order)
        self._closing = False
        self._every = SEND_EVERY_S  # the server may ask for a longer interval (``pace``)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the sender thread waits here for work
        #: Senders wait here for room in the queue: apart, so that taking a batch, which
        #: makes room, does not wake the sender thread too (at every cell's end).
        self._room = threading.Condition(lock)
        self.alive = True
        #: When the driver last said anything (``time.monotonic()``): a driver that keeps the
        #: ranks alive pings them (``{"t": "ping"}``), so a long silence means it is gone even
        #: where no connection reset ever arrives (a network cut off, a host powered down).
        self.last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._read, name="nbdist-client", daemon=True)
        self._thread.start()
        self._sender = threading.Thread(target=self._send_loop, name="nbdist-client-send",
                                        daemon=True)
        self._sender.start()

    def send(self, event: Mapping[str, Any]) -> bool:
        """Queue ``event`` for the driver; False (and counted) when the channel is down.

        An event whose ``data`` is bytes (at most ``MAX_BLOCK_BYTES``) travels as a binary
        block.
        """
        return self.send_all((event,))

    def send_all(self, events: Sequence[Mapping[str, Any]], lazy: bool = False) -> bool:
        """Queue ``events`` together, as ``send`` does each: one write carries them all.

        ``lazy``: they may wait (``LAZY_S`` at most) for something else to go with, as
        progress does, but are never merged with other events.

        An event that ends a session cell (``PROMPT``) is written at once by the calling
        thread, with what was queued before it, unless a write is under way (the sender
        thread then writes it next): a thread hop less on the way of every cell's end.
        """
        # Queued as they are (``_merge`` may fold later events of their kind into them).
        size = 0
        for event in events:
            size += len(event.get("text") or "") + 100  # what matters is the output text
            if event.get("t") == "display":  # a figure: its bundle (``DisplayEvent.size``)
                size += int(event.get("size") or 0)
            data = event.get("data")
            if isinstance(data, (bytes, bytearray, memoryview)):
                size += memoryview(data).nbytes
        with self._cond:
            while self._pending_bytes > MAX_PENDING_BYTES and self.alive:
                self._room.wait()  # the driver is behind: wait rather than pile up
            if not self.alive:
                self.dropped += len(events)
                return False
            # The sender's next write is due no sooner unless one of these changes.
            was = (bool(self._pending), self._urgent, self._prompt)
            if not self._pending:
                self._since = time.monotonic()
            for item in events:
                event = cast(Event, item)
                kind = event.get("t")
                if kind in _LAZY:
                    _merge(self._pending, event)
                elif lazy:
                    self._pending.append(event)
                else:
                    if kind != "out" or not _append_output(self._pending, event):
                        self._pending.append(event)
                    self._urgent = True
                    self._prompt = self._prompt or kind in PROMPT
            self._pending_bytes += size
            batch = None
            if self._prompt and not self._writing:
                batch = self._take()
            elif not self._writing and was != (True, self._urgent, self._prompt):
                self._cond.notify_all()
        if batch is not None:
            self._write(batch)
        return True

    def _take(self) -> list[Event]:
        """What is queued, to be written by the caller (``_cond`` held): no one else writes
        until ``_write`` is done with it."""
        batch, self._pending = self._pending, []
        self._pending_bytes, self._urgent, self._prompt = 0, False, False
        self._writing = True
        self._room.notify_all()
        return batch

    def _write(self, batch: list[Event]) -> None:
        """Write a batch taken with ``_take``; whatever happens, let the next write go (a
        ``_writing`` left set kept every later event queued for good, until the queue was
        full and every sender waited)."""
        if len(batch) > 1:  # a heartbeat says nothing that another event does not
            batch = [e for e in batch if e.get("t") != "hb"] or batch[-1:]
        failed = lost = False
        try:
            try:
                lines = _lines(batch)  # an event that JSON cannot take is reported there
            except Exception:  # nbdist's own fault: lose this batch, never the channel
                log.exception("nbdist: a batch of %d events could not be encoded", len(batch))
                lines, lost = [], True
            for data in lines:
                self._sock.sendall(data)
        except OSError:
            failed = True
        finally:
            with self._cond:
                if failed or lost:
                    self.alive = self.alive and not failed
                    self.dropped += len(batch)
                    self._room.notify_all()
                self._writing = False
                self._last = time.monotonic()
                if self._pending or self._closing or not self.alive:
                    self._cond.notify_all()  # the sender writes what came meanwhile, or ends

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._writing:
                        due = None  # another thread writes: it wakes us if more is queued
                    elif self._closing or not self.alive:
                        due = now
                    elif not self._pending:
                        due = None
                    elif self._prompt:
                        due = now
                    else:
                        due = max(self._last + self._every,
                                  now if self._urgent else self._since + LAZY_S)
                    if due is not None and due <= now:
                        break
                    self._cond.wait(None if due is None else due - now)
                batch = self._take()
                if not batch:
                    self._writing = False
                    return  # closing, everything sent
                if not self.alive:
                    self.dropped += len(batch)
                    self._writing = False
                    continue
            self._write(batch)

    def _read(self) -> None:
        try:
            for line in self._reader:
                self.last_heard = time.monotonic()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(event, dict) or event.get("t") == "ping":
                    continue
                if event.get("t") == "pace":
                    every = event.get("every")
                    if isinstance(every, (int, float)) and 0 <= every <= 60:
                        with self._cond:
                            self._every = max(SEND_EVERY_S, float(every))
                            self._cond.notify_all()
                    continue
                self._on_message(event)
        except OSError:
            pass
        with self._cond:
            self.alive = False
            self._cond.notify_all()
            self._room.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then disconnect once the driver has read it all.

        Waits at most ``timeout`` for each: the queue to go out, then the driver to close its
        end. Closing ours first while the driver may still write to us (a ``cancel``, a
        ``pace``) would make our kernel answer with a reset, and a reset makes the driver's
        kernel throw away what it has not read yet: the rank's last lines.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._sender.join(timeout)
        with self._cond:
            self.alive = False
            self._cond.notify_all()
            self._room.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the end of our writes, after the last one
        except OSError:
            pass
        self._thread.join(timeout)  # the reader ends when the driver closes its end
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sender.join(2)
        self._thread.join(2)
        self._sock.close()
        # The reader holds its own reference to the socket's fd: closing the socket alone
        # would leak one descriptor per connection.
        self._reader.close()


def _append_output(pending: list[Event], event: Event) -> bool:
    """Add an output event's text to the queued output of the same stream, if nothing but
    lazy events (which views show apart from the log) was queued after it."""
    text = event.get("text")
    if not isinstance(text, str):
        return False
    for i in range(len(pending) - 1, -1, -1):
        old = pending[i]
        kind = old.get("t")
        if kind in _LAZY:
            continue
        done = old.get("text")
        if kind == "out" and old.get("s") == event.get("s") and isinstance(done, str):
            if len(done) + len(text) > MERGE_CHARS:
                return False  # big chunks gain nothing from merging, and copying them costs
            pending[i] = {**old, "text": done + text}
            return True
        return False
    return False


def _lines(events: list[Event]) -> list[bytes | bytearray | memoryview]:
    """What one write carries: the events as arrays of up to ``BATCH_LINE_BYTES`` per line
    (each far below the server's ``MAX_LINE_BYTES``); an
    event with binary ``data`` alone on its line, ``"raw": N`` in place of the data, followed
    by the N bytes (joined with the lines when small, ``JOIN_BYTES``; else as they are:
    joining them would copy them)."""
    out: list[bytes | bytearray | memoryview] = []
    text: list[bytes] = []
    groups: list[list[bytes]] = [[]]
    size = 0

    def flush() -> None:
        nonlocal size
        text.extend(b"[" + b",".join(g) + b"]\n" if len(g) > 1 else g[0] + b"\n"
                    for g in groups if g)
        groups[:] = [[]]
        size = 0

    for e in events:
        data = e.get("data")
        if isinstance(data, (bytes, bytearray, memoryview)):
            flush()
            head = {k: v for k, v in e.items() if k != "data"}
            raw = memoryview(data).nbytes  # not ``size``: that counts the line's bytes
            line, ok = _dumps({**head, "raw": raw})
            text.append(line + b"\n")
            if not ok:  # its head cannot travel, nor can its bytes: the report goes instead
                continue
            if raw <= JOIN_BYTES:  # with the lines around it: one write, one read
                text.append(bytes(data))
                continue
            out += [b"".join(text), data]
            text.clear()
            continue
        p = _dumps(e)[0]
        if groups[-1] and size + len(p) > BATCH_LINE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += len(p) + 1
    flush()
    if text:
        out.append(b"".join(text))
    return out


def _dumps(event: Mapping[str, Any]) -> tuple[bytes, bool]:
    """An event's JSON and True; for one that JSON cannot take (a value of a type it does not
    know, a cycle), a line on the rank's stderr that says so, and False: the event is lost,
    never the channel."""
    try:
        return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode(), True
    except (TypeError, ValueError, RecursionError) as exc:
        report: Event = {"t": "out", "s": "e", "text": (
            f"nbdist: a {str(event.get('t'))[:40]!r} event of this rank could not be sent to "
            f"the notebook, and was dropped: {type(exc).__name__}: {str(exc)[:200]}\n")}
        return json.dumps(report, separators=(",", ":"), ensure_ascii=False).encode(), False


def _merge(pending: list[Event], event: Event) -> None:
    """Queue a lazy event, folding it into one of its kind already queued.

    Metrics merge into queued metrics. A progress update replaces the queued one of the same bar
    and goes to the end (views show the bar updated last); a heartbeat or a resources sample
    (``res``) replaces a queued one.
    """
    kind = event.get("t")
    for i, old in enumerate(pending):
        if old.get("t") != kind:
            continue
        if kind == "metrics":
            values, new = old.get("values"), event.get("values")
            if isinstance(values, dict) and isinstance(new, dict):
                # The newest event's other fields (its step) with both events' values.
                pending[i] = {**old, **event, "values": {**values, **new}}
                return
        elif kind == "hb" or old.get("id") == event.get("id"):
            del pending[i]
            break
    pending.append(event)


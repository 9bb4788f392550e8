"""What a rank runs, on its supervisor: a job's payload, or a session's cells.

``rank.Supervisor`` holds one ``RankWork`` and asks it everything that differs between a job's
rank and a session's (``JobWork``, ``SessionCells``); it never asks which of the two it has.

A job's rank gets its payload with its environment at start and nothing more from the driver;
its value or error is the rank's outcome. A session's rank starts without a payload; the
driver sends each cell on the event channel (``{"t": "cell"}``), and ``SessionCells`` forwards
it to the interpreter, interrupts it, or ends the session (``quit``). When a cell ends, the
interpreter writes a sync marker on stdout and stderr before its value or error: the cell's
value or error goes to the driver only once the output before the markers did
(``SYNC_WAIT_S`` at most), so the notebook shows them in order. A value comes in pieces, signed
as they pass (``nbdist.values``), its signature last.

Standard library only: this runs on ranks' hosts.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

from nbdist import values
from nbdist.protocol import Frame, RankEvent

#: How long a session cell's value waits for the cell's last output to be forwarded first.
SYNC_WAIT_S = 2.0
#: A value this small goes to the driver with its signature, in one write (a larger one goes
#: piece by piece as it comes, so that its first pieces travel while the rank sends the rest).
HOLD_BYTES = 64 * 1024


class _Interpreter(Protocol):
    """What of the rank's interpreter (``rank.RankProcess``) the cells use."""

    sync_marker: str

    def send(self, kind: int, body: bytes) -> bool: ...

    def send_parts(self, kind: int, parts: list[bytes]) -> bool: ...


class RankWork(Protocol):
    """What ``rank.Supervisor`` asks of the work its rank runs."""

    #: Without the event channel there is nothing to run (a session's cells come over it).
    needs_channel: bool
    #: The rank goes when its connection to the driver closes (a session: the kernel stopped).
    ends_with_driver: bool
    #: The driver said ``quit``: the rank's exit with code 0 is its normal end.
    quitting: bool
    #: The rank's "running" may wait for the next write to the driver (``LAZY_S`` at most)
    #: instead of a write of its own: a session's cells are mostly over within milliseconds,
    #: and their end then carries it. Written alone, it woke the kernel's event server, which
    #: then paused (``events.PACE_S``, longer with many ranks) while the cells' ends came in.
    lazy_start: bool

    def begin(self, rank: _Interpreter, env: bytes) -> None:
        """Give the new interpreter its environment frame, and its code if it has it now."""

    def on_message(self, msg: Mapping[str, Any], rank: _Interpreter | None) -> None:
        """A driver message the supervisor does not handle itself."""

    def strip_sync(self, marker: str, text: str) -> tuple[str, int]:
        """``text`` without the rank's sync markers, and how many there were."""

    def synced(self, stream: str, marks: int) -> None:
        """``stream``'s output up to ``marks`` more sync markers went to the driver."""

    def value(self, event: Mapping[str, Any], result_type: str | None) -> None:
        """The interpreter announced a value (its pieces follow)."""

    def piece(self, piece: bytes) -> None:
        """A piece of the announced value."""

    def ended(self, kind: int, body: bytes, result_type: str | None) -> bool:
        """A RESULT or ERROR frame: True when it was a cell's (sent here), False when it is
        the rank's outcome (the supervisor keeps it)."""


class JobWork:
    """A job's rank: the payload travels with the environment at start, then QUIT, so the
    interpreter ends after it; its value or error is the rank's outcome."""

    needs_channel = False
    ends_with_driver = False
    quitting = False
    lazy_start = False

    def __init__(self, payload: bytes) -> None:
        self._payload = payload

    def begin(self, rank: _Interpreter, env: bytes) -> None:
        # A send fails when the rank died at start-up: its exit status and stderr say why.
        payload, self._payload = self._payload, b""  # sent once; not kept for the job's life
        if rank.send(Frame.ENV, env) and rank.send(Frame.PAYLOAD, payload):
            rank.send(Frame.QUIT, b"")

    def on_message(self, msg: Mapping[str, Any], rank: _Interpreter | None) -> None:
        pass  # a job's rank takes only ``world`` and ``cancel``, which the supervisor handles

    def strip_sync(self, marker: str, text: str) -> tuple[str, int]:
        return text, 0  # only a session cell's end writes sync markers

    def synced(self, stream: str, marks: int) -> None:
        pass

    def value(self, event: Mapping[str, Any], result_type: str | None) -> None:
        pass  # the value comes whole, in the RESULT frame

    def piece(self, piece: bytes) -> None:
        pass

    def ended(self, kind: int, body: bytes, result_type: str | None) -> bool:
        return False


class SessionCells:
    """The cells of one session rank; ``send`` sends an event to the driver."""

    needs_channel = True
    ends_with_driver = True
    lazy_start = True

    def __init__(self, secret: str, send: Callable[[Sequence[RankEvent]], None],
                 rss: Callable[[], int | None]) -> None:
        self._secret = secret
        self._send = send  # events sent together, in one write
        self._rss = rss  # the rank's memory, sent with each cell's end (%dist_session)
        self._cell: int | None = None  # the cell running now
        self.quitting = False  # see RankWork
        self._synced = {"o": 0, "e": 0}  # sync markers each stream has shown
        self._cells_ended = 0
        self._sync_cond = threading.Condition()
        self._signer: Any = None  # the running HMAC of the value being forwarded
        #: A small value's announcement and piece, held to go with its signature (one write
        #: to the driver instead of three); None while a value goes piece by piece.
        self._held: list[RankEvent] | None = None
        #: The pieces of a large payload so far, and the cell they belong to (``cell_part``).
        self._parts = bytearray()
        self._parts_of: Any = None

    def begin(self, rank: _Interpreter, env: bytes) -> None:
        rank.send(Frame.ENV, env)  # the cells follow from the driver (on_message)

    # -- from the driver -----------------------------------------------------------------------
    def on_message(self, msg: Mapping[str, Any], rank: _Interpreter | None) -> None:
        """A driver message: run a cell, interrupt it, end the session."""
        kind = msg.get("t")
        if rank is None:
            return
        if kind == "cell_part":  # a piece of a large payload (protocol.CellEvent)
            if self._parts_of != msg["id"]:
                self._parts_of, self._parts = msg["id"], bytearray()
            self._parts += base64.b64decode(msg["data"])
        elif kind == "cell":
            self._cell = int(msg["id"])
            # False when the rank is gone: its exit ends the session with the reason.
            if "frame" in msg:  # handed over as a call: the parts as the driver holds them
                rank.send_parts(Frame.PAYLOAD, msg["frame"])
            elif msg.get("chunks"):
                body, self._parts, self._parts_of = self._parts, bytearray(), None
                rank.send_parts(Frame.PAYLOAD, [cast(bytes, body)])  # any bytes-like goes
            else:
                rank.send(Frame.PAYLOAD, base64.b64decode(msg["payload"]))
        elif kind == "interrupt":  # the rank's code gets a KeyboardInterrupt
            rank.send(Frame.INTERRUPT, str(int(msg["id"])).encode())
        elif kind == "quit":
            self.quitting = True
            rank.send(Frame.QUIT, b"")

    # -- from the interpreter's output ---------------------------------------------------------
    def strip_sync(self, marker: str, text: str) -> tuple[str, int]:
        marks = text.count(marker) if marker else 0
        return (text.replace(marker, ""), marks) if marks else (text, 0)

    def synced(self, stream: str, marks: int) -> None:
        with self._sync_cond:
            self._synced[stream] += marks
            self._sync_cond.notify_all()

    def _output_sent(self) -> None:
        """Wait (at most ``SYNC_WAIT_S``) until the cell's output went to the driver."""
        self._cells_ended += 1
        with self._sync_cond:
            want = self._cells_ended
            self._sync_cond.wait_for(lambda: min(self._synced.values()) >= want, SYNC_WAIT_S)

    # -- from the interpreter's control channel ------------------------------------------------
    def value(self, event: Mapping[str, Any], result_type: str | None) -> None:
        """A cell's value follows in pieces (``nbdist.values``): announce it."""
        self._output_sent()
        sizes = [int(s) for s in event.get("sizes") or ()]
        self._signer = values.signer(self._secret, self._cell or 0, sizes)
        as_bytes = [int(i) for i in event.get("bytes") or ()]  # received as bytes objects
        announce: RankEvent = {"t": "cell_value", "cell": self._cell, "sizes": sizes,
                               "type": result_type, "bytes": as_bytes}
        if sum(sizes) <= HOLD_BYTES:
            self._held = [announce]
        else:
            self._send([announce])

    def piece(self, piece: bytes) -> None:
        if self._signer is not None:
            self._signer.update(piece)
            data: RankEvent = {"t": "cell_data", "cell": self._cell, "data": piece}
            if self._held is not None:
                self._held.append(data)
            else:
                self._send([data])

    def ended(self, kind: int, body: bytes, result_type: str | None) -> bool:
        """Send the end of a cell to the driver: its error, or its value's signature (after
        the value's pieces)."""
        cell, self._cell = self._cell, None
        signer, self._signer = self._signer, None
        held, self._held = self._held or [], None
        rss = self._rss()  # what the cell left, for %dist_session
        if kind == Frame.ERROR:
            self._output_sent()
            self._send([{"t": "cell_error", "cell": cell, "error": json.loads(body),
                         "rss": rss}])
        elif signer is None:
            self._send([{"t": "cell_error", "cell": cell, "rss": rss, "error": {
                "type": "RuntimeError", "traceback": "",
                "message": "the cell's value was not announced"}}])
        else:
            self._send([*held, {"t": "cell_result", "cell": cell, "type": result_type,
                                "mac": signer.hexdigest(), "rss": rss}])
        return True

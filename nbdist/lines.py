"""Rank output as lines: the one line splitter, and the batcher a supervisor's pumps run.

Both are pure (no I/O, no clock: the time is passed in), so they are tested alone
(``tests/test_lines.py``); the supervisor reads the pipes and sends what comes out, ``state.py``
folds the lines into the driver's model. Standard library only: this runs on ranks' hosts.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable

#: Output lines longer than this are cut (the rest is counted, not sent).
MAX_LINE_CHARS = 16 * 1024
#: A partial line is sent after this long without a newline, so prompts and dots show up live.
PARTIAL_AFTER_S = 0.2

_BREAK = re.compile(r"(\r\n|\r|\n)")


def split_lines(text: str) -> tuple[list[list[str]], str]:
    """``[line, end]`` pairs, ``end`` being ``\\n`` (also for ``\\r\\n``) or ``\\r`` (a redraw),
    and the unfinished rest after the last line end ("" if there is none).

    The one splitter of rank output: the supervisor (``rank/supervisor.py``) and the driver's model
    (``state.py``) both use it.
    """
    parts = _BREAK.split(text)
    segs = [
        [line, "\r" if sep == "\r" else "\n"]
        for line, sep in zip(parts[0:-1:2], parts[1::2], strict=True)
    ]
    return segs, parts[-1]


def first_break(text: str) -> int:
    """Index of the first ``\\n`` or ``\\r`` in ``text``; -1 if there is none."""
    found = [i for i in (text.find("\n"), text.find("\r")) if i >= 0]
    return min(found) if found else -1


def after_last_break(text: str) -> int:
    """Index just after the last ``\\n`` or ``\\r`` in ``text``; 0 if there is none."""
    return max(text.rfind("\n"), text.rfind("\r")) + 1


def cut_line(line: str) -> str:
    """``line``, cut at ``MAX_LINE_CHARS`` with the number of characters that went."""
    if len(line) <= MAX_LINE_CHARS:
        return line
    return line[:MAX_LINE_CHARS] + f" [... {len(line) - MAX_LINE_CHARS} characters cut]"


def cut_long_lines(text: str) -> str:
    """``text`` with every line longer than ``MAX_LINE_CHARS`` cut (``cut_line``)."""
    if len(text) <= MAX_LINE_CHARS or max(map(len, text.splitlines())) <= MAX_LINE_CHARS:
        return text
    segs, rest = split_lines(text)
    return "".join(cut_line(line) + end for line, end in segs) + rest


class LineBatcher:
    """One output stream's bytes in, chunks of whole lines out.

    A chunk holds lines ended by ``\\n``, ``\\r\\n`` or ``\\r``, or an unfinished line that
    waited ``PARTIAL_AFTER_S`` (a prompt, a row of dots), or the first ``MAX_LINE_CHARS`` of an
    overlong line, whose rest is dropped up to its end and counted. ``strip`` takes a session's
    sync markers out of the text and counts them: a marker means a cell ended, so what is
    pending goes at once (``feed`` returns it with the count).

    The pump's loop: wait at most ``wait(now)`` for the pipe, ``feed`` what it read (and send
    what that returns), then send what ``take(now)`` returns; at the end of the pipe, ``close``.
    """

    def __init__(self, strip: Callable[[str], tuple[str, int]] | None = None) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = strip
        self.pending = ""  # decoded, not sent yet
        self._brk = 0  # length of the whole lines at the start of ``pending``
        self._partial_since = 0.0  # when the unfinished rest of ``pending`` started waiting
        self._cut = 0  # characters dropped from a line longer than MAX_LINE_CHARS, until it ends
        #: When ``take`` last sent whole lines (the pump paces its reads from it).
        self.last_sent = 0.0

    def wait(self, now: float) -> float | None:
        """How long the pump may wait for more before ``take`` is due (None: as long as it
        likes; zero or less: now)."""
        return None if not self.pending else self._partial_since + PARTIAL_AFTER_S - now

    def feed(self, data: bytes, now: float) -> tuple[list[str], int]:
        """Take bytes read from the pipe. Returns what must go at once, and the number of sync
        markers found (each a session cell's end): then ``take`` is not due this round."""
        text = self._decoder.decode(data)
        marks = 0
        if self._strip is not None:
            text, marks = self._strip(text)
        if self._cut:
            # The rest of an overlong line: drop it up to its end, then say how much went, as
            # cut_line does for a line that came whole.
            end = first_break(text)
            if end < 0 and not marks:
                self._cut += len(text)
                return [], 0
            if end < 0:  # a session cell ended inside the overlong line
                end = len(text)
            text = f" [... {self._cut + end} characters cut]" + text[end:]
            self._cut = 0
        if not self.pending:
            self._partial_since = now
        end = after_last_break(text)
        if end:
            self._brk = len(self.pending) + end
        self.pending += text
        if not marks:
            return [], 0
        # A session cell ended: what it printed goes now, then its value.
        out = [self.pending] if self.pending else []
        self.pending, self._brk = "", 0
        return out, marks

    def take(self, now: float) -> list[str]:
        """What is due: the whole lines pending, the start of an overlong line, or an
        unfinished line that waited long enough."""
        if self._brk:
            chunk, self.pending = self.pending[:self._brk], self.pending[self._brk:]
            self._brk = 0
            self.last_sent = self._partial_since = now
            return [chunk]
        if len(self.pending) >= MAX_LINE_CHARS:  # an overlong line: send its start
            self._cut = len(self.pending) - MAX_LINE_CHARS
            chunk, self.pending = self.pending[:MAX_LINE_CHARS], ""
            return [chunk]
        if self.pending and now - self._partial_since >= PARTIAL_AFTER_S:
            chunk, self.pending = self.pending, ""  # an unfinished line, shown as it is
            return [chunk]
        return []

    def close(self) -> str:
        """What is left at the end of the pipe."""
        rest = self.pending + self._decoder.decode(b"", final=True)
        self.pending = ""
        return rest

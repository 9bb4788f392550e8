"""The pure line batcher a supervisor's pumps run, and the one line splitter."""

from __future__ import annotations

from nbdist import lines
from nbdist.lines import LineBatcher


def test_whole_lines_go_in_one_chunk_and_the_unfinished_rest_waits() -> None:
    """Lines ended by \\n, \\r\\n or \\r go together; the rest waits for its end."""
    b = LineBatcher()
    assert b.feed(b"a\nb\r\nc\rpart", 1.0) == ([], 0)
    assert b.take(1.0) == ["a\nb\r\nc\r"]
    assert b.take(1.0) == [] and b.pending == "part"
    b.feed(b"ial\n", 1.1)
    assert b.take(1.1) == ["partial\n"]
    assert b.wait(1.1) is None  # nothing pending: the pump may wait as long as it likes


def test_an_unfinished_line_goes_after_it_waited_partial_after_s() -> None:
    """A prompt without a newline is sent once it waited PARTIAL_AFTER_S, not before."""
    b = LineBatcher()
    b.feed(b"Password: ", 0.0)
    wait = b.wait(0.0)
    assert wait is not None and abs(wait - lines.PARTIAL_AFTER_S) < 1e-9
    assert b.take(lines.PARTIAL_AFTER_S / 2) == []
    assert b.take(lines.PARTIAL_AFTER_S) == ["Password: "]
    assert b.pending == ""


def test_an_overlong_line_is_cut_and_what_went_is_counted() -> None:
    """The first MAX_LINE_CHARS of a line go; the rest is dropped up to its end and counted."""
    b = LineBatcher()
    n = lines.MAX_LINE_CHARS
    b.feed(b"x" * (n + 10), 0.0)
    assert b.take(0.0) == ["x" * n]
    b.feed(b"y" * 5, 0.0)  # still the same line: dropped, counted
    assert b.take(0.0) == []
    b.feed(b"z\nnext\n", 0.0)
    assert b.take(0.0) == [" [... 16 characters cut]\nnext\n"]


def test_utf8_split_across_reads_is_decoded_whole() -> None:
    """A character whose bytes come in two reads is not replaced."""
    b = LineBatcher()
    data = "é\n".encode()
    b.feed(data[:1], 0.0)
    b.feed(data[1:], 0.0)
    assert b.take(0.0) == ["é\n"]
    b.feed(b"\xc3", 0.0)
    assert b.close() == "\ufffd"  # cut off at the end of the pipe: replaced, not lost


def test_a_sync_marker_sends_what_is_pending_at_once() -> None:
    """A session cell's end (its sync marker) sends the pending text, even unfinished."""

    def strip(text: str) -> tuple[str, int]:
        return text.replace("<S>", ""), text.count("<S>")

    b = LineBatcher(strip)
    assert b.feed(b"done\nhalf", 0.0) == ([], 0)
    assert b.feed(b" a line<S>", 0.0) == (["done\nhalf a line"], 1)
    assert b.pending == "" and b.take(0.0) == []


def test_the_splitter_gives_pairs_and_the_rest() -> None:
    """split_lines: [line, end] pairs (\\r\\n counts as \\n) and the unfinished rest."""
    assert lines.split_lines("a\r\nb\rc\nrest") == ([["a", "\n"], ["b", "\r"], ["c", "\n"]],
                                                     "rest")
    assert lines.split_lines("") == ([], "")


def test_long_lines_are_cut_in_a_chunk() -> None:
    """cut_long_lines leaves short text alone and cuts each overlong line."""
    n = lines.MAX_LINE_CHARS
    assert lines.cut_long_lines("short\n") == "short\n"
    assert lines.cut_long_lines("a" * (n + 3) + "\nok\n") == (
        "a" * n + " [... 3 characters cut]\nok\n")

"""A trailing ``# comment`` on any nbdist magic line is cut off as a shell would cut it; a ``#``
inside a quoted argument or a word (``--env KEY=a#b``) stays."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from nbdist import magics
from nbdist import session as sessions
from nbdist.magicline import strip_comment
from nbdist.magics import DistMagics

from .helpers import run


@pytest.mark.parametrize(("line", "expected"), [
    ("-np 4   # same launch options", "-np 4"),
    ("-np 4 # a", "-np 4"),
    ("# only a comment", ""),
    ("lr  # send a notebook value", "lr"),
    ("-np 4 --env KEY=a#b", "-np 4 --env KEY=a#b"),
    ("-np 4 --env KEY=a#b  # note", "-np 4 --env KEY=a#b"),
    ("train.py --tag '#1' # note", "train.py --tag '#1'"),
    ('train.py --tag "a # b"', 'train.py --tag "a # b"'),
    ('train.py --tag "say \\"#\\"" # c', 'train.py --tag "say \\"#\\""'),
    ("train.py a\\ #b", "train.py a\\ #b"),
    ("-np 4\t# tab before", "-np 4"),
    ("-np 4#glued", "-np 4#glued"),
    ("--env K='open # quote", "--env K='open # quote"),
    ("", ""),
])
def test_strip_comment_cuts_what_a_shell_would(line: str, expected: str) -> None:
    """strip_comment cuts a '#' that starts a word outside quotes, and keeps every other '#'."""
    assert strip_comment(line) == expected


def test_distributed_options_with_a_comment_parse_and_keep_a_hash_in_a_value() -> None:
    """%%distributed's options parse with a trailing comment, and --env KEY=a#b keeps its '#'."""
    line = strip_comment("-np 4 --env KEY=a#b --timeout 30   # note: {not expanded}")
    opts = magics.parse_options(parse_argstring(DistMagics.distributed, line))
    assert (opts.np, opts.job.env, opts.job.timeout, opts.script) == (4, {"KEY": "a#b"}, 30.0,
                                                                      None)


def test_a_cell_with_a_commented_magic_line_runs_and_keeps_hashes_and_braces(ip: Any) -> None:
    """A real %%distributed cell with '# comment' on its line runs; '#' in --env and {x} in the
    cell reach the rank unchanged."""
    cell = ("%%distributed -np 1 --quiet --env NBDIST_T=a#b   # one rank {x}\n"
            "import os\n"
            "(os.environ['NBDIST_T'], '{x}')\n")
    assert run(ip, cell) == ("a#b", "{x}")


def test_a_word_after_the_options_of_a_cell_says_what_the_line_takes(ip: Any) -> None:
    """An argument left on a %%distributed line names the line form and how comments start."""
    with pytest.raises(UsageError, match=r"unexpected argument 'note'.*line form.*comment "
                                         r"starts with ' #'"):
        run(ip, "%%distributed -np 2 note\n1\n")


@pytest.fixture
def live(ip: Any) -> Iterator[sessions.Session]:
    """A one-rank session, started with a commented line and stopped after the test."""
    run(ip, "%dist_session start -np 1   # same launch options as %%distributed")
    live = sessions.current()
    assert live is not None
    yield live
    if live.alive:
        live.stop()
    sessions._current = None


def test_session_magics_take_a_trailing_comment(ip: Any, live: sessions.Session,
                                                capsys: Any) -> None:
    """%dist_push, %%distributed, %dist_pull, %dist_session and %dist_session stop, each with a
    trailing comment, do what they do without one (a variable named '#' is never pushed)."""
    ip.user_ns["lr"] = 0.25
    run(ip, "%dist_push lr   # send a notebook value to every rank")
    run(ip, "%%distributed   # no -np: runs on the session's ranks\ndoubled = lr * 2\n")
    run(ip, "%dist_pull doubled --rank 0   # bring it back")
    assert ip.user_ns["doubled"] == 0.5
    run(ip, "%dist_session   # ranks, hosts, names defined")
    run(ip, "%dist_session stop   # every rank leaves")
    assert not live.alive
    assert "pushed lr to the 1 ranks" in capsys.readouterr().out

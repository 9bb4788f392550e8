"""The docs as a newcomer types them: every magic line parses, every Python block is Python,
every ``nbdist.*`` name and keyword exists, every relative link resolves, and every figure of
performance.md and reliability.md cites what measured it (``tests/doccheck.py``). Each failure
is ``file:line: what is wrong``."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import nbdist
from nbdist import errors

from . import doccheck
from .doccheck import ROOT


@pytest.mark.parametrize("page", doccheck.pages())
def test_page_has_no_drift(page: str) -> None:
    """README.md and each page of docs/ pass every check of tests/doccheck.py."""
    problems = doccheck.check(page, (ROOT / page).read_text(encoding="utf-8"))
    assert not problems, "\n" + "\n".join(map(str, problems))


def test_the_exception_tree_of_the_docs_is_the_one_of_nbdist_errors() -> None:
    """docs/magics.md's "Errors and warnings" draws the tree of nbdist/errors.py's docstring,
    and every exported exception and warning is in it."""
    doc = errors.__doc__ or ""
    tree = textwrap.dedent(doc[doc.index("The tree::") + len("The tree::"):
                               doc.index("Bad user input")]).strip("\n")
    page = (ROOT / "docs" / "magics.md").read_text(encoding="utf-8")
    section = page[page.index("## Errors and warnings"):]
    drawn = next(b for b in doccheck.blocks(section) if b.lang == "text")
    assert "\n".join(drawn.lines) == tree
    exported = [n for n in nbdist.__all__ if isinstance(getattr(nbdist, n), type)
                and issubclass(getattr(nbdist, n), Warning | Exception)]
    assert [n for n in exported if f" {n} " not in tree] == []


# -- the checks fail on a broken page (tests of the test) ------------------------------------
def _problems(text: str, page: str = "docs/example.md") -> list[str]:
    return [str(p) for p in doccheck.check(page, textwrap.dedent(text))]


def test_a_magic_line_that_does_not_parse_is_named_with_its_line() -> None:
    """A bad option, -np 0, a refused session option, a script on a cell and an unknown setting
    each fail at their own line, with the parser's message."""
    problems = _problems("""\
        # Example

        ```python
        %%distributed -np 2 --nope   # a comment is fine, an unknown option is not
        1
        ```
        ```python
        %dist_session start -np 0
        %dist_session stop -np 2
        %dist_cancel j1 j2
        %dist_status j1 --lines 5
        %config DistMagics.no_such = 1
        %dist_push lr   # fine
        ```
        ```python
        %%distributed -np 2 train.py
        1
        ```
        """)
    assert len(problems) == 7, problems
    for line, what in [(4, "unrecognized arguments: --nope"), (8, "-np 0 runs nothing"),
                       (9, "takes no -np"), (10, "takes one job"), (11, "add --rank R"),
                       (12, "DistMagics.no_such: no such setting"), (16, "takes no script")]:
        assert any(p.startswith(f"docs/example.md:{line}: ") and what in p for p in problems), \
            (line, what, problems)


def test_a_python_block_that_does_not_parse_is_named_with_its_line() -> None:
    """A block that is not Python after IPython's transforms fails at the bad line; magics,
    shell escapes and a %%distributed body that is Python pass."""
    problems = _problems("""\
        ```python
        %load_ext nbdist
        !ls
        x = 1
        ```
        ```python
        %%distributed -np 2
        import os
        for i in range(3):
        print(i)
        ```
        """)
    assert problems == ["docs/example.md:10: not valid Python in a notebook cell: expected an "
                        "indented block after 'for' statement on line 9"], problems


def test_a_name_or_keyword_nbdist_lacks_is_named() -> None:
    """nbdist.nope (in code or prose), a keyword nbdist.run does not take, an internal path
    for an exported class and an unknown DistMagics setting fail; a keyword of the function
    run on the same page, and nbdist.report's free keywords, pass."""
    problems = _problems("""\
        Use `nbdist.nope()` or `nbdist.errors.PullWarning`; `DistMagics.viewz = 'text'`.
        In prose too: nbdist.gone.

        ```python
        def train(lr, epochs=1):
            nbdist.report(loss=0.1, acc=0.9)
        job = nbdist.run(train, np=2, lr=0.1, timout=5)
        ```
        """)
    assert len(problems) == 5, problems
    assert any(p.startswith("docs/example.md:1: nbdist.nope does not exist") for p in problems)
    assert any(p.startswith("docs/example.md:2: nbdist.gone does not exist") for p in problems)
    assert "docs/example.md:1: write nbdist.PullWarning, not nbdist.errors.PullWarning: the " \
           "docs name an exported class by its public name" in problems
    assert any(p.startswith("docs/example.md:1: DistMagics.viewz is no setting") for p in problems)
    assert any(p.startswith("docs/example.md:7: nbdist.run(... timout=...): 'timout' is not "
                            "one of its keywords (") and "timeout" in p
               and "nor a parameter of train" in p for p in problems), problems


def test_a_broken_link_or_anchor_is_named(tmp_path: Path) -> None:
    """A link to a missing file or a missing heading fails; links to existing pages, headings
    (GitHub's slugs, code and punctuation dropped) and to the web pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## `%dist_stacks`: where, now?\n")
    text = ("# Page\n\n## A heading\n\n"
            "[ok](other.md#dist_stacks-where-now) [ok](#a-heading) [web](https://x.org/y)\n"
            "[gone](missing.md) [no anchor](other.md#nope) [here](#nope)\n"
            "`[not a link](missing.md)`\n")
    problems = [str(p) for p in doccheck.link_problems("docs/page.md", text, tmp_path)]
    assert problems == [
        "docs/page.md:6: link to missing.md: no such file docs/missing.md",
        "docs/page.md:6: link to other.md#nope: docs/other.md has no heading with the anchor "
        "#nope",
        "docs/page.md:6: link to #nope: docs/page.md has no heading with the anchor #nope",
    ], problems


def test_a_blank_line_inside_a_table_is_named() -> None:
    """A blank line that cuts a table leaves rows without a header: named at the first one."""
    problems = _problems("""\
        | a | b |
        | --- | --- |
        | 1 | 2 |

        | 3 | 4 |
        """)
    assert len(problems) == 1 and problems[0].startswith("docs/example.md:5: a table row with "
                                                         "no table"), problems


def test_a_figure_without_its_benchmark_or_a_missing_citation_is_named(tmp_path: Path) -> None:
    """On a figure page, a section with a measured figure and no citation fails, and so does a
    citation of a file or a test that does not exist; a heading's citation covers its
    subsections, the page's introduction covers none."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_x.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_y.py").write_text("def test_y():\n    pass\n")
    text = textwrap.dedent("""\
        # Performance

        Measured by `benchmarks/bench_x.py`.

        ## Launch (`bench_x.py`)

        ### Local

        | run | seconds |
        | --- | --- |
        | one | 1.5 s |

        ## Streaming

        It takes 12 ms per line.

        ## Pulls

        0.8 s (`tests/test_y.py::test_y`, `tests/test_y.py::test_z`, `benchmarks/bench_q.py`).
        """)
    problems = [str(p) for p in doccheck.figure_problems("docs/performance.md", text, tmp_path)]
    assert problems == [
        "docs/performance.md:15: the figure '12 ms' names no benchmark or test: cite "
        "benchmarks/NAME.py or tests/PATH.py[::test_name] in its section (from line 13) or a "
        "heading above it",
        "docs/performance.md:19: cites tests/test_y.py::test_z, but tests/test_y.py has no "
        "test test_z",
        "docs/performance.md:19: cites benchmarks/bench_q.py, which does not exist",
    ], problems

"""Read the docs as a newcomer types them: the checks behind ``tests/test_docs.py``.

Each check takes a Markdown file's path and text and returns :class:`Problem` s, each naming
the file, the line and what is wrong, so that drift found after a merge is fixed from the
message alone:

- ``magic_problems``: every nbdist magic line in a ``python`` block goes through nbdist's own
  parsers (``%%distributed``'s options, ``%dist_status``'s, ``%dist_session``'s, ...), and
  every ``%config DistMagics.NAME = VALUE`` names a setting with a literal value;
- ``python_problems``: every ``python`` block, cut into cells at its ``%%`` lines, is turned
  into Python by IPython's ``TransformerManager`` and parsed with ``ast.parse``;
- ``name_problems``: every ``nbdist.X.Y`` in code exists, and every keyword of a call to an
  ``nbdist`` function is one it takes (``nbdist.run``'s own options, or a parameter of the
  function it runs when that function is defined on the same page);
- ``link_problems``: every relative link and image resolves, anchors included (GitHub's
  heading slugs);
- ``figure_problems`` (performance.md and reliability.md): every section that shows a figure
  cites where it comes from, and the citation exists (the convention is in
  docs/developing.md, "Docs are tested").
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Fence languages whose blocks are notebook cells.
PYTHON = frozenset({"python", "py", "ipython"})

#: Cell magics whose body is Python (the body of any other, ``%%bash``, is not checked).
PYTHON_CELL_MAGICS = frozenset({"distributed", "time", "timeit", "capture", "prun"})


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and its lines, with the number of the first."""

    lang: str
    first: int  # the line number of the block's first line of code
    lines: tuple[str, ...]


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, indented ones (in a list) included."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            line = lines[j]
            body.append(line[indent:] if not indent or line[:indent].isspace()
                        else line.lstrip())
            j += 1
        found.append(Block(lang, i + 2, tuple(body)))
        i = j + 1
    return found


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks, inline code spans blanked."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = ""
            continue
        if m is not None:
            fence = m.group(2)
            continue
        yield number, re.sub(r"`[^`]*`", lambda s: " " * len(s.group()), line)


def code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) of every inline code span outside fenced blocks."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = ""
            continue
        if m is not None:
            fence = m.group(2)
            continue
        for span in re.finditer(r"(`+)(.+?)\1", line):
            yield number, span.group(2).strip()


def cells(block: Block) -> Iterator[tuple[int, list[str]]]:
    """A ``python`` block's notebook cells: a ``%%`` line starts a new one."""
    start, current = block.first, list[str]()
    for offset, line in enumerate(block.lines):
        if line.startswith("%%") and current:
            yield start, current
            start, current = block.first + offset, []
        current.append(line)
    if current:
        yield start, current


# -- magic lines ------------------------------------------------------------------------------
_MAGIC = re.compile(r"^\s*(%%?)([A-Za-z_]\w*)(.*)$")


def _nbdist_magics() -> Any:
    from nbdist.magics import DistMagics

    return DistMagics


def magic_line_problem(kind: str, name: str, rest: str) -> str | None:
    """What is wrong with one magic line (``kind`` ``%`` or ``%%``), or None: the line goes
    through the parsers the magic itself uses."""
    from IPython.core.error import UsageError
    from IPython.core.magic_arguments import parse_argstring

    from nbdist import magics
    from nbdist.magicline import strip_comment

    cls = _nbdist_magics()
    line = strip_comment(rest.strip())
    if name in ("load_ext", "reload_ext", "unload_ext"):
        return None if line == "nbdist" or not line.startswith("nbdist") else (
            f"%{name} takes the extension's name, nbdist, not {line!r}")
    if name == "config":
        return _config_problem(cls, line)
    table = cls.magics["cell" if kind == "%%" else "line"]
    if name not in table and name not in cls.magics["line"]:
        return None  # not one of nbdist's (%pip, %timeit, ...)
    if kind == "%%" and name not in cls.magics["cell"]:
        return f"%%{name} is a line magic: write %{name}"
    try:
        if name == "distributed":
            args = parse_argstring(cls.distributed, line)
            opts = magics.parse_options(args, session=True)
            if kind == "%%" and opts.script:
                return f"%%distributed takes no script ({opts.script!r}): the cell is what runs"
            if kind == "%" and not opts.script:
                return "%distributed (the line form) needs a script: %distributed -np 4 train.py"
        elif name == "dist_status":
            magics.parse_status(line)
        elif name == "dist_cancel":
            magics.parse_cancel(line)
        else:
            args = parse_argstring(getattr(cls, name), line)
            if name == "dist_session":
                magics.check_session_args(args)
    except UsageError as exc:
        return f"{kind}{name} {line}: {exc}"
    return None


def _config_problem(cls: Any, line: str) -> str | None:
    m = re.fullmatch(r"(\w+)\.(\w+)\s*=\s*(.+)", line)
    if m is None:
        return None if not line.startswith("DistMagics") else (
            f"%config {line}: write %config DistMagics.NAME = VALUE")
    owner, name, value = m.groups()
    if owner != "DistMagics":
        return None
    traits = cls.class_traits(config=True)
    if name not in traits:
        return f"%config DistMagics.{name}: no such setting (settings: {', '.join(sorted(traits))})"
    try:
        ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return f"%config DistMagics.{name} = {value}: the value is not a Python literal"
    return None


def magic_problems(path: str, text: str) -> list[Problem]:
    problems = []
    for block in blocks(text):
        if block.lang not in PYTHON:
            continue
        for offset, line in enumerate(block.lines):
            m = _MAGIC.match(line)
            if m is None:
                continue
            problem = magic_line_problem(m.group(1), m.group(2), m.group(3))
            if problem is not None:
                problems.append(Problem(path, block.first + offset, problem))
    # Inline spans (`%dist_pull`, `%%distributed --mlflow`) name a magic or an option in
    # prose; only a block's lines are typed as they stand.
    return problems


# -- Python blocks ----------------------------------------------------------------------------
def python_problems(path: str, text: str) -> list[Problem]:
    from IPython.core.inputtransformer2 import TransformerManager

    manager = TransformerManager()
    problems = []
    for block in blocks(text):
        if block.lang not in PYTHON:
            continue
        for first, lines in cells(block):
            head = _MAGIC.match(lines[0])
            body_first = first
            if lines[0].startswith("%%") and head is not None:
                if head.group(2) not in PYTHON_CELL_MAGICS:
                    continue
                lines, body_first = lines[1:], first + 1
            source = manager.transform_cell("\n".join(lines) + "\n")
            try:
                ast.parse(source)
            except SyntaxError as exc:
                # The transform keeps lines one for one, so the error's line is the doc's.
                where = body_first + (exc.lineno or 1) - 1
                msg = _doc_lines(exc.msg, body_first)
                problems.append(Problem(path, where, f"not valid Python in a notebook cell: "
                                                     f"{msg}"))
    return problems


def _doc_lines(message: str, first: int) -> str:
    """A SyntaxError's message with its ``on line N`` counted from the page's top."""
    return re.sub(r"on line (\d+)", lambda m: f"on line {first + int(m.group(1)) - 1}", message)


# -- nbdist names and keywords ----------------------------------------------------------------
_NAME = re.compile(r"(?<![\w./-])nbdist(?:\.[A-Za-z_]\w*)+")


def resolve(dotted: str) -> Any:
    """The object ``nbdist.a.b`` names, importing modules on the way; AttributeError if none."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        except ModuleNotFoundError:
            raise AttributeError(f"{'.'.join(parts[:i])} has no {part!r}") from None
    return obj


def _code_texts(text: str) -> Iterator[tuple[int, str]]:
    """(first line, code) of every python block's cell bodies, every inline code span, and
    the prose (whose ``nbdist.X`` names must exist too; it never parses as Python)."""
    from IPython.core.inputtransformer2 import TransformerManager

    manager = TransformerManager()
    for block in blocks(text):
        if block.lang not in PYTHON:
            continue  # output: what nbdist printed, not what a user types
        for first, lines in cells(block):
            if lines[0].startswith("%%"):
                lines = ["", *lines[1:]]  # the cell's body, its line numbers kept
            yield first, manager.transform_cell("\n".join(lines) + "\n")
    yield from code_spans(text)
    for number, line in prose_lines(text):
        if "nbdist." in line:
            yield number, line + "\n#"  # a comment: never a call to check


def _accepted(target: Any, dotted: str) -> tuple[set[str], bool]:
    """The keywords a call of ``target`` takes by name, and whether it passes others on."""
    def named(fn: Any) -> tuple[set[str], bool]:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            return set(), True
        return ({p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)},
                any(p.kind is p.VAR_KEYWORD for p in params))

    names, more = named(target)
    if dotted == "nbdist.run":  # its options are the engine's, plain or elastic
        for engine in ("nbdist.job.run", "nbdist.elastic.run"):
            engine_names, _ = named(resolve(engine))
            names |= engine_names
        names.discard("fn")
    return names, more


def name_problems(path: str, text: str) -> list[Problem]:
    problems = []
    functions: dict[str, ast.FunctionDef] = {}  # defined on this page, for nbdist.run(f, ...)
    trees: list[tuple[int, ast.Module]] = []
    for first, code in _code_texts(text):
        for m in _NAME.finditer(code):
            dotted = m.group().rstrip(".")
            line = first + code[: m.start()].count("\n")
            try:
                resolve(dotted)
            except (AttributeError, ImportError) as exc:
                problems.append(Problem(path, line, f"{dotted} does not exist ({exc})"))
                continue
            public = _public_name(dotted)
            if public is not None:
                problems.append(Problem(path, line, f"write {public}, not {dotted}: the docs "
                                                    f"name an exported class by its public name"))
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue  # prose in a code span; python blocks are python_problems' business
        trees.append((first, tree))
        functions.update({n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)})
    for number, span in code_spans(text):
        for setting in re.findall(r"(?<![\w.])DistMagics\.(\w+)", span):
            traits = _nbdist_magics().class_traits(config=True)
            if setting not in traits and not setting.isupper():  # DistMagics.NAME: a synopsis
                problems.append(Problem(path, number, f"DistMagics.{setting} is no setting "
                                                      f"(settings: {', '.join(sorted(traits))})"))
    for first, tree in trees:
        imported = {a.asname or a.name: f"nbdist.{a.name}" for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module == "nbdist" for a in n.names}
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            called = _dotted(call.func, imported)
            if called is None:
                continue
            try:
                target = resolve(called)
            except (AttributeError, ImportError):
                continue  # said above
            line = first + call.lineno - 1
            problems.extend(Problem(path, line, what)
                            for what in _keyword_problems(called, target, call, functions))
    return problems


def _public_name(dotted: str) -> str | None:
    """``nbdist.X`` when ``dotted`` is ``nbdist.errors.X`` (or any module's) and ``X`` is in
    ``nbdist.__all__``: the one name the docs use for it."""
    import nbdist

    parts = dotted.split(".")
    if len(parts) != 3 or parts[2] not in nbdist.__all__:
        return None
    return f"nbdist.{parts[2]}" if resolve(dotted) is getattr(nbdist, parts[2]) else None


def _dotted(node: ast.expr, imported: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    if node.id == "nbdist":
        return ".".join(["nbdist", *reversed(parts)])
    if node.id in imported:
        return ".".join([imported[node.id], *reversed(parts)])
    return None


def _keyword_problems(dotted: str, target: Any, call: ast.Call,
                      functions: dict[str, ast.FunctionDef]) -> Iterator[str]:
    if not callable(target):
        return
    names, passes_on = _accepted(target, dotted)
    if passes_on and dotted != "nbdist.run":
        return  # takes any keyword (nbdist.report(**metrics))
    fn = functions.get(call.args[0].id) if (
        call.args and isinstance(call.args[0], ast.Name)) else None
    for keyword in call.keywords:
        if keyword.arg is None or keyword.arg in names:
            continue
        if passes_on and fn is not None and (
                fn.args.kwarg is not None
                or keyword.arg in {a.arg for a in [*fn.args.args, *fn.args.kwonlyargs]}):
            continue  # a keyword of the function nbdist.run runs
        known = ", ".join(sorted(names))
        whose = f" nor a parameter of {fn.name}" if fn is not None else ""
        yield f"{dotted}(... {keyword.arg}=...): {keyword.arg!r} is not one of its keywords " \
              f"({known}){whose}"


# -- links ------------------------------------------------------------------------------------
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown text defines: its headings' slugs (GitHub numbers repeats)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines_raw(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is not None:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def prose_lines_raw(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line outside fenced blocks, code spans kept."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence:
            if line.strip().startswith(fence):
                fence = ""
            continue
        if m is not None:
            fence = m.group(2)
            continue
        yield number, line


def link_problems(path: str, text: str, root: Path = ROOT) -> list[Problem]:
    here = (root / path).parent
    problems = []
    for number, line in prose_lines(text):
        targets = [m.group(1) for m in _LINK.finditer(line)]
        targets += [m.group(1) for m in [_REFERENCE.match(line)] if m is not None]
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            if not file:  # an anchor of this page
                if anchor not in anchors(text):
                    problems.append(Problem(path, number, f"link to {target}: {path} has no "
                                                          f"heading with the anchor #{anchor}"))
                continue
            dest = (here / file).resolve()
            if not dest.exists():
                problems.append(Problem(path, number, f"link to {target}: no such file "
                                                      f"{_relative(dest, root)}"))
                continue
            if anchor and dest.suffix == ".md":
                if anchor not in anchors(dest.read_text()):
                    problems.append(Problem(path, number, f"link to {target}: "
                                                          f"{_relative(dest, root)} has no "
                                                          f"heading with the anchor #{anchor}"))
    return problems


def _relative(dest: Path, root: Path) -> str:
    try:
        return str(dest.relative_to(root.resolve()))
    except ValueError:
        return str(dest)


# -- tables ----------------------------------------------------------------------------------
def table_problems(path: str, text: str) -> list[Problem]:
    """A table's first row must be followed by its ``| --- |`` line: a blank line inside a
    table starts a new one without it, shown as a paragraph of pipes."""
    problems = []
    previous = ""
    for number, line in prose_lines_raw(text):
        row = line.strip().startswith("|")
        if row and not previous.strip().startswith("|"):
            following = _line_after(text, number)
            if not re.fullmatch(r"\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*", following):
                problems.append(Problem(path, number, "a table row with no table: the line "
                                                      "above it is not a row (a blank line "
                                                      "inside a table?) and no | --- | line "
                                                      "follows it"))
        previous = line
    return problems


def _line_after(text: str, number: int) -> str:
    lines = text.splitlines()
    return lines[number] if number < len(lines) else ""


# -- figures ----------------------------------------------------------------------------------
#: Pages whose every figure names what measured it.
FIGURE_PAGES = ("docs/performance.md", "docs/reliability.md")

#: A measured figure: a number with a unit of time, size, rate or ratio.
_FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?\s?(?:ms|µs|us|s|min|MB|GB|KB|MiB|GiB|KiB|"
                     r"MB/s|GB/s|%|×|x)(?![\w])")

#: A citation: a benchmark script or a test file, optionally one of its tests.
_CITE = re.compile(r"(?<![\w/])((?:benchmarks|tests)/[\w/.-]+\.py)(?:::(\w+))?"
                   r"|(?<![\w/])(bench_\w+\.py)")


def sections(text: str) -> list[tuple[int, int, list[tuple[int, str]]]]:
    """(level, first line, lines) of every section: a heading and what follows it up to the
    next heading (a page's text before its first heading is a section of level 0)."""
    found: list[tuple[int, int, list[tuple[int, str]]]] = [(0, 1, [])]
    for number, line in prose_lines_raw(text):
        m = re.match(r"^(#{1,6})\s", line)
        if m is not None:
            found.append((len(m.group(1)), number, []))
        found[-1][2].append((number, line))
    return found


def citations(lines: list[tuple[int, str]]) -> list[tuple[int, str, str | None]]:
    """(line, path, test name or None) of every citation in the lines."""
    found: list[tuple[int, str, str | None]] = []
    for number, line in lines:
        for m in _CITE.finditer(line):
            if m.group(3):
                found.append((number, f"benchmarks/{m.group(3)}", None))
            else:
                found.append((number, m.group(1), m.group(2)))
    return found


def figure_problems(path: str, text: str, root: Path = ROOT) -> list[Problem]:
    problems = []
    parents: list[tuple[int, bool]] = []  # (level, cites) of the sections above this one
    for level, first, lines in sections(text):
        cited = citations(lines)
        for number, file, test in cited:
            if not (root / file).is_file():
                problems.append(Problem(path, number, f"cites {file}, which does not exist"))
            elif test is not None and not re.search(rf"^\s*(?:async\s+)?def {test}\(",
                                                   (root / file).read_text(), re.M):
                problems.append(Problem(path, number, f"cites {file}::{test}, but {file} "
                                                      f"has no test {test}"))
        while parents and parents[-1][0] >= level:
            parents.pop()
        # A page's title and its introduction (levels 0 and 1) cover no section below them.
        covered = bool(cited) or any(cites for above, cites in parents if above >= 2)
        parents.append((level, covered))
        if covered:
            continue
        for number, line in lines:
            figure = _FIGURE.search(line)
            if figure is not None and not line.lstrip().startswith("#"):
                problems.append(Problem(
                    path, number, f"the figure {figure.group().strip()!r} names no benchmark "
                    f"or test: cite benchmarks/NAME.py or tests/PATH.py[::test_name] in its "
                    f"section (from line {first}) or a heading above it"))
                break  # one per section: the citation fixes them all
    return problems


# -- all --------------------------------------------------------------------------------------
def pages(root: Path = ROOT) -> list[str]:
    """README.md and every page of docs/, as paths relative to the repository."""
    return ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]


def check(path: str, text: str, root: Path = ROOT) -> list[Problem]:
    """Every problem of one page."""
    problems = [*magic_problems(path, text), *python_problems(path, text),
                *name_problems(path, text), *link_problems(path, text, root),
                *table_problems(path, text)]
    if path in FIGURE_PAGES:
        problems += figure_problems(path, text, root)
    return sorted(problems, key=lambda p: (p.path, p.line))

"""The cell as text: editor line numbers, IPython's syntax, and the code a rank cannot run.

- :class:`Lines` addresses the user's lines as the editor numbers them (the ``%%distributed``
  line is 1), for every message capture writes;
- :func:`parse` turns the cell into Python and its tree, through IPython's ``transform_cell``
  only when the cell needs it;
- :func:`has_value` decides, as IPython does, whether the cell's last line is its value;
- :func:`check_call` looks at each call the scope analysis walks: a transformed magic that
  cannot run on a rank is refused here, with a hint of what to do instead, and a shell command
  (``!cmd {x} $y``) gives the variables it expands. The other refusals of code (top-level
  ``await`` and ``yield``, relative imports) are built here too; the scope analysis raises them
  where it finds them, in its single walk of the tree.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from collections.abc import Callable

from nbdist.errors import CaptureError

#: Line magics that can run on a rank; ``RankShell`` in ``rank/shell.py`` implements them.
RANK_MAGICS = frozenset({"pip", "sx", "system", "matplotlib"})

#: The compiler flag of ``from __future__ import annotations``: the only future feature that
#: changes what capture must do (annotations are then never evaluated).
CO_FUTURE_ANNOTATIONS: int = importlib.import_module("__future__").annotations.compiler_flag


class Lines:
    """The user's cell lines, addressed by editor line numbers (``line_offset`` + body line)."""

    def __init__(self, cell: str, offset: int) -> None:
        self.lines = cell.splitlines()
        self.offset = offset

    def text(self, line: int) -> str:
        i = line - self.offset - 1
        return self.lines[i].strip() if 0 <= i < len(self.lines) else ""

    def where(self, line: int) -> str:
        text = self.text(line)
        return f"line {line}: `{text}`" if text else f"line {line}"


def parse(cell: str, transform: Callable[[str], str] | None, filename: str, offset: int
          ) -> tuple[str, ast.Module]:
    """The cell as Python, and its tree with editor line numbers.

    IPython's static transforms only rewrite lines that are not valid Python (``!cmd``,
    ``%magic``, ``x?``), and its dynamic ones (automagic) only one-line cells: a multi-line
    cell that parses as it is needs no transform (which costs more than the parse here).
    """
    pad = "\n" * offset
    if transform is None or cell.strip().count("\n"):
        try:
            return cell, ast.parse(pad + cell, filename)
        except SyntaxError:
            if transform is None:
                raise
    assert transform is not None
    source = transform(cell)
    # IPython drops leading blank lines; keep them, so that line numbers match the editor's
    lost = _leading_blank_lines(cell) - _leading_blank_lines(source)
    source = "\n" * max(lost, 0) + source
    return source, ast.parse(pad + source, filename)


def _leading_blank_lines(text: str) -> int:
    n = 0
    for line in text.splitlines():
        if line.strip():
            break
        n += 1
    return n


def last_expr(source: str) -> ast.Expr | None:
    """The cell's last statement if it is an expression (for ``--show-source``)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    return body[-1] if body and isinstance(body[-1], ast.Expr) else None


def has_value(tree: ast.Module, source: str, offset: int) -> bool:
    """Whether the cell has a value, as IPython decides it: a last expression, and no ``;``
    token after it (only the tail after the expression is tokenized: tokenizing the whole
    cell would cost more than the rest of the capture)."""
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr) or last.end_lineno is None:
        return False
    tail = source.splitlines(True)[last.end_lineno - 1 - offset:]  # tree lines include offset
    if not tail:
        return True
    tail[0] = tail[0].encode()[last.end_col_offset or 0:].decode(errors="replace")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO("".join(tail)).readline))
    except (tokenize.TokenError, SyntaxError):
        return not source.rstrip().endswith(";")
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
            tokenize.INDENT, tokenize.DEDENT)
    for tok in reversed(tokens):
        if tok.type in skip:
            continue
        return not (tok.type == tokenize.OP and tok.string == ";")
    return True


# -- what cannot run on a rank at all -----------------------------------------------------------
_MAGIC_HINTS = {
    "load_ext": "extensions load into the notebook's kernel, not into the ranks; run it in a "
    "normal cell, and import in this cell what the ranks need",
    "reload_ext": "extensions live in the notebook's kernel; run it in a normal cell",
    "unload_ext": "extensions live in the notebook's kernel; run it in a normal cell",
    "time": "measure inside the cell with time.perf_counter(), or put %%time on a normal cell",
    "timeit": "measure inside the cell with time.perf_counter() or the timeit module",
    "prun": "profile inside the cell with cProfile",
    "pinfo": "help (`?`) is for the notebook: ask it in a normal cell",
    "pinfo2": "help (`??`) is for the notebook: ask it in a normal cell",
    "psearch": "help (`?`) is for the notebook: ask it in a normal cell",
    "env": "give the ranks environment variables with %%distributed --env KEY=VALUE, or set "
    "os.environ[...] in the cell",
    "cd": "ranks start in the notebook's working directory; use os.chdir(...) in the cell",
    "run": "run a script on the ranks with the line form: %distributed -np N script.py",
    "config": "configure the notebook in a normal cell",
    "autoreload": "autoreload acts on the notebook's kernel; run it in a normal cell",
}
#: IPython's default aliases: shell commands written without ``!``.
_ALIASES = frozenset({
    "cat", "clear", "cp", "ldir", "less", "lf", "lk", "ll", "ls", "lx", "man", "mkdir",
    "more", "mv", "rm", "rmdir",
})


_SHELL_METHODS = frozenset({"system", "getoutput", "run_line_magic"})
_SHELL_VAR = re.compile(r"\{([A-Za-z_]\w*)|\$([A-Za-z_]\w*)")


def _shell_names(node: ast.Call) -> list[str]:
    """Variables a transformed ``!cmd {x} $y`` expands at run time (``x``, ``y``): they
    appear only inside the command string, and the rank expands them as IPython does."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr in _SHELL_METHODS
            and isinstance(func.value, ast.Call) and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "get_ipython"):
        return []
    names: list[str] = []
    for arg in node.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            names.extend(a or b for a, b in _SHELL_VAR.findall(arg.value))
    return names


def _magic_call(node: ast.Call) -> tuple[str, str] | None:
    """``(method, magic name)`` of a transformed ``get_ipython().run_*_magic('name', ...)``."""
    func = node.func
    if not (isinstance(func, ast.Attribute)
            and func.attr in ("run_line_magic", "run_cell_magic")
            and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "get_ipython"):
        return None
    first = node.args[0] if node.args else None
    name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else "?"
    return func.attr, name


def _refuse_magic(node: ast.Call, method: str, name: str, lines: Lines) -> CaptureError:
    where = lines.where(node.lineno)
    if method == "run_cell_magic" or name.startswith("%"):
        magic = "%%" + name.lstrip("%")
        return CaptureError(
            f"{where}: {magic} cannot run on the ranks: a cell magic must start a cell, and "
            f"this cell's is %%distributed. Run it in a normal cell, or do its job in Python "
            f"inside this one."
        )
    if name in _ALIASES:
        hint = f"write it as a shell command, which runs on each rank: `!{lines.text(node.lineno)}`"
        hint = hint.replace("!%", "!")
    else:
        hint = _MAGIC_HINTS.get(
            name, "magics run in the notebook's kernel, and ranks run plain Python; run it in "
            "a normal cell before %%distributed"
        )
    return CaptureError(
        f"{where}: %{name} cannot run on the ranks: {hint}. (On a rank only shell commands "
        f"`!cmd`, `x = !cmd`, %pip and %matplotlib run.)"
    )


#: The ``get_ipython()`` methods IPython's transforms call: other calls need no closer look.
_SHELL_CALLS = _SHELL_METHODS | {"run_cell_magic"}


def check_call(node: ast.Call, lines: Lines) -> list[str]:
    """Refuse a transformed magic that cannot run on a rank; return the variables a
    transformed shell command expands (see :func:`_shell_names`)."""
    func = node.func
    if type(func) is not ast.Attribute or func.attr not in _SHELL_CALLS:
        return []  # the cell's own calls: nearly all of them, so checked first and cheaply
    magic = _magic_call(node)
    # "?": a name computed at run time (user code calling get_ipython() itself): the rank decides
    if magic is not None and (magic[0] == "run_cell_magic" or magic[1] not in RANK_MAGICS | {"?"}):
        raise _refuse_magic(node, *magic, lines)
    return _shell_names(node)


def await_error(line: int, lines: Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(line)}: top-level `await` (or `async for`/`async with`) needs the "
        f"notebook's event loop, and ranks run the cell as plain Python. Put the async code "
        f"in a function and run it: `async def main(): ...` then `asyncio.run(main())`."
    )


def yield_error(line: int, lines: Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(line)}: `yield` outside a function: a cell cannot be a generator. "
        f"Collect the values in a list, or define a generator function in the cell and "
        f"iterate over it."
    )


def relative_error(node: ast.ImportFrom, lines: Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(node.lineno)}: a relative import needs a package, and a notebook cell "
        f"is not part of one (on the ranks either). Import by the absolute name: "
        f"`from {node.module or 'package'} import ...` with the package installed or on "
        f"sys.path."
    )



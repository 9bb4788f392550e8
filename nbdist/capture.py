"""Cell source + the notebook's namespace → a self-contained payload, or a clear error.

What the cell uses from earlier cells travels in one of two ways:

- **by name**: modules, and objects that can be imported from a module (``from math import
  sqrt as s``), become import statements run on the rank: never pickled;
- **by value**: functions and classes defined in the notebook, and plain values, are shipped
  with cloudpickle (which ships notebook functions with the globals *they* use). All values go
  in one pickle stream with one memo, so objects shared between them stay shared, and notebook
  functions get the rank's cell namespace as their globals, as they had the notebook's.

Which names the cell takes from the notebook is decided by scoping, as Python would: a name
the cell binds on every path before reading it is the cell's own; a name read before any
binding is the notebook's (*needed*); a name the cell binds on some paths only, or reads under
``except NameError``, is shipped when it can be and otherwise left to the cell (*optional*).
Reads inside a function the cell defines happen when the function is used, so they are
resolved where the cell first uses the function's name.

A needed value that cannot travel (a Spark session, a lock, an open file, a CUDA tensor, ...)
is refused before launch with a :class:`~nbdist.errors.CaptureError` naming the variable, its
type, the cell line that uses it and what to do instead. This module does not import Spark,
widgets, torch or launchers: such objects are recognised by the names of their types.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import gc
import importlib
import io
import os
import re
import sys
import tokenize
import types
import warnings
from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from nbdist import runtime
from nbdist.errors import CaptureError, CaptureWarning

#: Values that pickle to more than this many bytes make capture warn (``CaptureWarning``):
#: every rank receives a copy at start-up. ``%config DistMagics.large_value_mb = 500`` sets it
#: for ``%%distributed``; ``capture_cell(warn_bytes=...)`` per call.
LARGE_VALUE_BYTES = 100_000_000

#: Names IPython puts in the user namespace that never travel.
_IPYTHON_NAMES = frozenset({
    "In", "Out", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "_sh", "exit", "quit",
    "get_ipython", "__builtin__", "__builtins__", "__name__", "__doc__", "__spec__",
    "__loader__", "__package__", "__file__",
})

#: Line magics that can run on a rank; ``_RankShell`` in ``runtime.py`` implements them.
RANK_MAGICS = frozenset({"pip", "sx", "system"})

_CO_FUTURE_ANNOTATIONS: int = importlib.import_module("__future__").annotations.compiler_flag
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # ``except*`` is Python 3.11+
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_MISSING = object()


# -- the result ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    """A notebook name re-imported on the rank: ``import module as name`` or
    ``from module import attr as name``."""

    name: str
    module: str
    attr: str | None = None

    def statement(self) -> str:
        if self.attr is None:
            if self.name == self.module:
                return f"import {self.module}"
            return f"import {self.module} as {self.name}"
        if self.name == self.attr:
            return f"from {self.module} import {self.attr}"
        return f"from {self.module} import {self.attr} as {self.name}"


@dataclass(frozen=True)
class Value:
    """A notebook name shipped by value: what it is and how many bytes it adds to the payload
    (an object shared with an earlier value is counted once, with the first)."""

    name: str
    kind: str
    size: int
    line: int
    optional: bool = False


@dataclass
class Captured:
    """A cell made self-contained: what :func:`capture_cell` returns."""

    source: str  # the cell as Python (IPython syntax already transformed)
    filename: str
    imports: list[Import] = field(default_factory=list)
    submodules: list[str] = field(default_factory=list)  # imported for ``pkg.sub.x`` uses
    values: list[Value] = field(default_factory=list)
    data: bytes = b""  # the values, pickled one after another with one memo
    left_out: dict[str, str] = field(default_factory=dict)  # optional name → why not shipped
    returns_last: bool = True
    line_offset: int = 0  # lines above the cell body (the %%distributed line)
    flags: int = 0  # compiler flags of __future__ features in effect in the notebook

    def payload(self) -> dict[str, Any]:
        """What ``runtime._run_cell`` executes on each rank."""
        return {
            "kind": "cell",
            "source": self.source,
            "filename": self.filename,
            "line_offset": self.line_offset,
            "flags": self.flags,
            "imports": [(i.name, i.module, i.attr) for i in self.imports],
            "submodules": list(self.submodules),
            "data": self.data,
            "value_names": [v.name for v in self.values],
            "returns_last": self.returns_last,
        }

    def function_source(self, name: str = "cell") -> str:
        """The cell as the self-contained function that runs on each rank (for --show-source)."""
        out = [f"def {name}():"]
        if self.imports or self.submodules:
            out.append("    # imported on the rank, by name (never pickled)")
            out.extend(f"    {i.statement()}" for i in self.imports)
            if self.submodules:
                subs = ", ".join(self.submodules)
                out.append(f"    # and the submodules the cell reaches: {subs}")
        if self.values:
            total = sum(v.size for v in self.values)
            out.append(f"    # shipped by value from the notebook (cloudpickle, {_human(total)})")
            for v in self.values:
                note = ", optional" if v.optional else ""
                out.append(f"    {v.name} = ...  # {v.kind}, {_human(v.size)}{note}")
        for key, why in self.left_out.items():
            out.append(f"    # not shipped: {key} ({why})")
        out.append("    # the cell")
        body = self.source.rstrip("\n").splitlines() or ["pass"]
        last = _last_expr(self.source) if self.returns_last else None
        if last is not None:
            start = last.lineno - 1
            body[start] = "return " + body[start]
            # a multi-line last expression keeps its lines; indent them under the return
            for i in range(start + 1, (last.end_lineno or last.lineno)):
                body[i] = "       " + body[i]
        out.extend(f"    {line}" if line.strip() else "" for line in body)
        return "\n".join(out) + "\n"

    def export(self, path: str | os.PathLike[str], np: int = 1) -> list[Path]:
        """Write a standalone script (and its values) that ``torchrun`` runs without nbdist.

        Parameters
        ----------
        path : str or path-like
            The script to write (``train.py``). The captured values, if any, go next to it in
            ``<stem>.values.pkl``; keep the two files together.
        np : int
            The number of processes per node the script's header suggests.

        Returns
        -------
        list of Path
            The files written, the script first.
        """
        return _write_export(self, Path(path), np)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns


# -- the entry point ----------------------------------------------------------------------------
def capture_cell(
    cell: str,
    user_ns: Mapping[str, Any],
    *,
    transform: Callable[[str], str] | None = None,
    filename: str = "<cell>",
    line_offset: int = 0,
    compile_flags: int = 0,
    warn_bytes: int | None = None,
    remote_names: Collection[str] = (),
) -> Captured:
    """Turn a cell into a :class:`Captured`, or raise :class:`CaptureError` / ``SyntaxError``.

    Parameters
    ----------
    cell : str
        The cell body, as the user wrote it.
    user_ns : mapping
        The notebook's namespace (``shell.user_ns``).
    transform : callable, optional
        Turns IPython syntax (``!cmd``, ``%magic``) into Python; pass ``shell.transform_cell``.
    filename : str
        The name remote tracebacks show for the cell (``<cell In[7]>``).
    line_offset : int
        Lines above the body in the notebook's cell (1 for the ``%%distributed`` line), so that
        line numbers in messages and tracebacks match the editor's.
    compile_flags : int
        The notebook compiler's flags (``shell.compile.flags``); ``from __future__ import
        annotations`` done in an earlier cell is carried over from them.
    warn_bytes : int, optional
        Warn (``CaptureWarning``) about values that pickle to more bytes than this; default
        :data:`LARGE_VALUE_BYTES`.
    remote_names : collection of str
        Names already defined on the ranks (a persistent session's earlier cells): neither
        shipped nor imported, so the notebook's values never shadow the ranks' own.

    Raises
    ------
    CaptureError
        A value the cell needs cannot travel, or the cell uses something that cannot run on a
        rank (a magic, top-level ``await``, a relative import); the message says what to do.
    """
    flags = compile_flags & _CO_FUTURE_ANNOTATIONS
    lines = _Lines(cell, line_offset)
    with _gc_paused():
        source, needs, returns_last = _analyse(cell, transform, filename, lines, user_ns,
                                               bool(flags))
    captured = Captured(
        source=source, filename=filename, returns_last=returns_last,
        line_offset=line_offset, flags=flags,
    )
    shipping: dict[str, _Need] = {}
    for name, need in needs.items():
        if name in _IPYTHON_NAMES or (name.startswith("_i") and name[2:].isdigit()):
            continue
        if name in remote_names:
            continue
        value = user_ns.get(name, _MISSING)
        if value is _MISSING or getattr(builtins, name, _MISSING) is value:
            continue
        imp = _as_import(name, value)
        if imp is None:
            shipping[name] = need
            continue
        captured.imports.append(imp)
    modules = {i.name: i.module for i in captured.imports if i.attr is None}
    for name, paths in _attr_paths(source, modules).items():
        for sub in _submodules(modules[name], paths):
            if sub not in captured.submodules:
                captured.submodules.append(sub)
    if shipping:
        _ship(captured, shipping, user_ns, lines)
        limit = LARGE_VALUE_BYTES if warn_bytes is None else warn_bytes
        for v in captured.values:
            if v.size > limit:
                warnings.warn(_large_message(v, limit, lines), CaptureWarning, stacklevel=2)
    return captured


def _analyse(cell: str, transform: Callable[[str], str] | None, filename: str, lines: _Lines,
             universe: Container[str], future_annotations: bool
             ) -> tuple[str, dict[str, _Need], bool]:
    """The cell as Python, the notebook names it reads, and whether it has a value. Only
    these small results outlive the call: the tree goes with it (see :func:`_gc_paused`)."""
    source, tree = _parse(cell, transform, filename, lines.offset)
    # a ``from __future__ import annotations`` in the cell is seen by the flow itself
    needs = _Flow(lines, future_annotations, filename, universe).run(tree)
    return source, needs, _returns_last(tree, source, lines.offset)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while the cell's tree exists. Parsing makes
    thousands of AST nodes at once, none in a reference cycle, and the collections their
    allocation triggers would walk them over and over (and move them to the oldest
    generation, bringing a full collection of the kernel's heap closer) only for reference
    counting to free them all when the tree is dropped: drop it before resuming."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass
class _Need:
    """A read of a notebook name: its first line, and whether the cell can do without it."""

    line: int
    optional: bool


class _Lines:
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


def _parse(cell: str, transform: Callable[[str], str] | None, filename: str, offset: int
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


def _attr_paths(source: str, names: Iterable[str]) -> dict[str, set[str]]:
    """Dotted attribute paths the source uses on each of ``names``
    (``xml.etree.ElementTree.parse`` → ``{"xml": {"etree.ElementTree.parse"}}``). Text, not the
    tree, in one pass: a hit in a comment only adds an import of a submodule the notebook has
    loaded anyway."""
    alternatives = "|".join(map(re.escape, names))
    found: dict[str, set[str]] = {}
    if alternatives:
        # what comes before a hit is checked here, not by a lookbehind in the pattern, which
        # would stop the regex engine from skipping ahead to the names' first letters (2x)
        for m in re.finditer(rf"({alternatives})((?:\.\w+)+)", source):
            before = source[m.start() - 1] if m.start() else " "
            if before == "." or before == "_" or before.isalnum():  # ``x.np.y``, ``my_np.y``
                continue
            found.setdefault(m.group(1), set()).add(m.group(2)[1:])
    return found


def _last_expr(source: str) -> ast.Expr | None:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    return body[-1] if body and isinstance(body[-1], ast.Expr) else None


def _returns_last(tree: ast.Module, source: str, offset: int) -> bool:
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
    "matplotlib": "ranks have no display to draw on; save figures to files "
    "(plt.savefig(...)) on the ranks, or return the data and plot it in a normal cell",
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


def _refuse_magic(node: ast.Call, method: str, name: str, lines: _Lines) -> CaptureError:
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
        f"`!cmd`, `x = !cmd` and %pip run.)"
    )


#: The ``get_ipython()`` methods IPython's transforms call: other calls need no closer look.
_SHELL_CALLS = _SHELL_METHODS | {"run_cell_magic"}


def _check_call(node: ast.Call, lines: _Lines) -> list[str]:
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


def _await_error(line: int, lines: _Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(line)}: top-level `await` (or `async for`/`async with`) needs the "
        f"notebook's event loop, and ranks run the cell as plain Python. Put the async code "
        f"in a function and run it: `async def main(): ...` then `asyncio.run(main())`."
    )


def _yield_error(line: int, lines: _Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(line)}: `yield` outside a function: a cell cannot be a generator. "
        f"Collect the values in a list, or define a generator function in the cell and "
        f"iterate over it."
    )


def _relative_error(node: ast.ImportFrom, lines: _Lines) -> CaptureError:
    return CaptureError(
        f"{lines.where(node.lineno)}: a relative import needs a package, and a notebook cell "
        f"is not part of one (on the ranks either). Import by the absolute name: "
        f"`from {node.module or 'package'} import ...` with the package installed or on "
        f"sys.path."
    )


# -- scoping: which names the cell takes from the notebook --------------------------------------
class _Scope:
    """A nested scope (function, class body or comprehension) and the names it binds."""

    __slots__ = ("kind", "names", "globals", "nonlocals")

    def __init__(
        self, kind: str, names: set[str], glob: set[str] | None = None,
        nonloc: set[str] | None = None,
    ) -> None:
        self.kind = kind
        self.globals = glob or set()
        self.nonlocals = nonloc or set()
        self.names = names - self.globals - self.nonlocals


def _bound_in(body: Iterable[ast.AST]) -> tuple[set[str], set[str], set[str]]:
    """(names bound, names declared global, names declared nonlocal) in one scope's code,
    without entering nested scopes (but with the walrus targets of its comprehensions)."""
    names: set[str] = set()
    glob: set[str] = set()
    nonloc: set[str] = set()
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                names.add(node.id)
            continue
        if isinstance(node, _FUNCS):
            names.add(node.name)
            stack.extend(node.decorator_list)
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)
            continue
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            stack.extend(node.decorator_list)
            stack.extend(node.bases)
            stack.extend(k.value for k in node.keywords)
            continue
        if isinstance(node, ast.Lambda):
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)
            continue
        if isinstance(node, _COMPS):
            # the comprehension's targets are its own; := inside binds in this scope
            for sub in _walk_scope(node):
                if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
                    names.add(sub.target.id)
            stack.append(node.generators[0].iter)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
            if node.name:
                names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, ast.Global):
            glob.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            nonloc.update(node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names, glob, nonloc


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not enter function, lambda or class bodies."""
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        if cur is not node and isinstance(cur, (*_FUNCS, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(cur))


def _comp_scope(node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> _Scope:
    names: set[str] = set()
    for gen in node.generators:
        _target_names(gen.target, names)
    return _Scope("comprehension", names)


def _target_names(node: ast.expr, names: set[str]) -> None:
    """Add the names an assignment target binds: ``a, (b, *c)``; not ``d`` nor ``k`` in
    ``d[k]`` or ``d.k``, which it reads."""
    if type(node) is ast.Name:
        names.add(node.id)
    elif isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            _target_names(elt, names)
    elif isinstance(node, ast.Starred):
        _target_names(node.value, names)


def _function_scope(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> _Scope:
    a = node.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    params.update(x.arg for x in (a.vararg, a.kwarg) if x is not None)
    body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
    names, glob, nonloc = _bound_in(body)
    return _Scope("function", names | params, glob, nonloc)


class _Resolver:
    """Global names read inside nested scopes, resolved as Python resolves them.

    ``reads`` are (name, line) in source order; ``global_binds`` are names a function assigns
    after ``global name``; ``module_binds`` are := targets of comprehensions at module level.
    """

    def __init__(self, future_annotations: bool, lines: _Lines) -> None:
        self.future = future_annotations
        self.lines = lines
        self.reads: list[tuple[str, int]] = []
        self.global_binds: set[str] = set()
        self.module_binds: set[str] = set()

    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                 chain: list[_Scope]) -> None:
        """The body of a function or lambda (its decorators and defaults are the caller's)."""
        inner = [*chain, _function_scope(node)]
        if isinstance(node, ast.Lambda):
            self.visit(node.body, inner)
        else:
            for stmt in node.body:
                self.visit(stmt, inner)

    def comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp,
                      chain: list[_Scope]) -> None:
        """A comprehension, except its first iterable (evaluated in the enclosing scope)."""
        inner = [*chain, _comp_scope(node)]
        for i, gen in enumerate(node.generators):
            if i:
                self.visit(gen.iter, inner)
            self.visit(gen.target, inner)
            for cond in gen.ifs:
                self.visit(cond, inner)
        if isinstance(node, ast.DictComp):
            self.visit(node.key, inner)
            self.visit(node.value, inner)
        else:
            self.visit(node.elt, inner)

    def _arguments(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                   chain: list[_Scope]) -> None:
        a = node.args
        for d in (*a.defaults, *a.kw_defaults):
            if d is not None:
                self.visit(d, chain)
        if not self.future and not isinstance(node, ast.Lambda):
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    self.visit(arg.annotation, chain)
            if node.returns is not None:
                self.visit(node.returns, chain)

    def visit(self, node: ast.AST, chain: list[_Scope]) -> None:
        t = type(node)
        if t is ast.Name:
            assert isinstance(node, ast.Name)
            if isinstance(node.ctx, ast.Store):
                if node.id in chain[-1].globals:
                    self.global_binds.add(node.id)
            else:
                self._resolve(node.id, node.lineno, chain)
            return
        if t is ast.Constant:
            return
        if t is ast.Attribute:
            self.visit(node.value, chain)  # type: ignore[attr-defined]
            return
        fields = _EXPR_FIELDS.get(t)
        if fields is not None:
            for name in fields:
                sub = getattr(node, name)
                if type(sub) is list:
                    for item in sub:
                        if item is not None:
                            self.visit(item, chain)
                elif sub is not None:
                    self.visit(sub, chain)
            return
        if t is ast.Call:
            assert isinstance(node, ast.Call)
            for name in _check_call(node, self.lines):
                self._resolve(name, node.lineno, chain)
            self.visit(node.func, chain)
            for arg in node.args:
                self.visit(arg, chain)
            for kw in node.keywords:
                self.visit(kw.value, chain)
            return
        if isinstance(node, _FUNCS):
            for d in node.decorator_list:
                self.visit(d, chain)
            self._arguments(node, chain)
            self.function(node, chain)
            return
        if isinstance(node, ast.Lambda):
            self._arguments(node, chain)
            self.function(node, chain)
            return
        if isinstance(node, ast.ClassDef):
            for d in (*node.decorator_list, *node.bases, *(k.value for k in node.keywords)):
                self.visit(d, chain)
            names, glob, nonloc = _bound_in(node.body)
            inner = [*chain, _Scope("class", names, glob, nonloc)]
            for stmt in node.body:
                self.visit(stmt, inner)
            return
        if isinstance(node, _COMPS):
            if any(g.is_async for g in node.generators) and not _in_function(chain):
                raise _await_error(node.lineno, self.lines)
            self.visit(node.generators[0].iter, chain)
            self.comprehension(node, chain)
            return
        if isinstance(node, ast.NamedExpr):
            self.visit(node.value, chain)
            name = node.target.id
            target = next((s for s in reversed(chain) if s.kind != "comprehension"), None)
            if target is None:
                self.module_binds.add(name)
            elif name in target.globals:
                self.global_binds.add(name)
            return
        if isinstance(node, ast.AnnAssign):
            # annotations of a function's local variables are never evaluated
            if not self.future and chain[-1].kind == "class":
                self.visit(node.annotation, chain)
            self.visit(node.target, chain)
            if node.value is not None:
                self.visit(node.value, chain)
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            raise _relative_error(node, self.lines)
        if isinstance(node, ast.Await | ast.Yield | ast.YieldFrom) and not _in_function(chain):
            # inside a comprehension of the cell's top level
            error = _await_error if isinstance(node, ast.Await) else _yield_error
            raise error(node.lineno, self.lines)
        for child in ast.iter_child_nodes(node):
            self.visit(child, chain)

    def _resolve(self, name: str, line: int, chain: list[_Scope]) -> None:
        cur = chain[-1]
        if name in cur.globals:
            self.reads.append((name, line))
            return
        if name in cur.names or name in cur.nonlocals:
            return
        for scope in reversed(chain[:-1]):
            if scope.kind == "class":
                continue  # a class body's names are not visible in its methods
            if name in scope.globals:
                break
            if name in scope.names or name in scope.nonlocals:
                return
        self.reads.append((name, line))


#: Sub-expressions of plain expression nodes, in evaluation order: walking these directly is
#: several times faster than ``ast.iter_child_nodes`` (which also yields ``ctx`` and operator
#: objects), and capture walks every node of the cell.
_EXPR_FIELDS: dict[type, tuple[str, ...]] = {
    ast.Subscript: ("value", "slice"), ast.BinOp: ("left", "right"),
    ast.Compare: ("left", "comparators"), ast.Tuple: ("elts",), ast.List: ("elts",),
    ast.Set: ("elts",), ast.UnaryOp: ("operand",), ast.keyword: ("value",),
    ast.Starred: ("value",), ast.JoinedStr: ("values",),
    ast.FormattedValue: ("value", "format_spec"), ast.Slice: ("lower", "upper", "step"),
    ast.Dict: ("keys", "values"), ast.Expr: ("value",), ast.Return: ("value",),
}


def _in_function(chain: list[_Scope]) -> bool:
    return any(scope.kind == "function" for scope in chain)


@dataclass
class _Deferred:
    """A function, class or lambda the cell defines: the globals its code reads when called."""

    reads: list[tuple[str, int]]
    global_binds: set[str]
    index: int  # the top-level statement that defines it
    definite: frozenset[str]  # names surely bound when it was defined
    activated: bool = False


class _Frame:
    """Binding state of the module (or of a class body being run) at one point of the flow."""

    __slots__ = ("definite", "maybe", "live", "deferred")

    def __init__(self) -> None:
        self.definite: set[str] = set()
        self.maybe: set[str] = set()
        self.live = True
        self.deferred: _Deferred | None = None  # a class body: its methods' reads


_State = tuple[set[str], set[str], bool]


class _Flow:
    """Which notebook names the cell reads: a definite-assignment analysis of the cell's
    top level (and of class bodies, which run when defined), in source order.

    Only names of the notebook (``universe``) can be needs, and whether a name is bound never
    depends on other names, so the module's binding state tracks those alone: the cell's own
    variables, usually most of its names, are not copied at every branch and loop.
    """

    def __init__(self, lines: _Lines, future_annotations: bool, filename: str,
                 universe: Container[str]) -> None:
        self.lines = lines
        self.filename = filename
        self.future = future_annotations
        self.universe = universe
        self.mod = _Frame()
        self.frame = self.mod
        self.needs: dict[str, _Need] = {}
        self.defs: dict[str, _Deferred] = {}
        self.all_defs: list[_Deferred] = []
        self.optional = 0  # depth inside ``try`` bodies that catch NameError
        self.cond = 0  # depth inside conditional parts of expressions (and/or, x if c else y)
        self.loops: list[tuple[list[_State], list[_State]]] = []  # (breaks, continues)
        self.activating: set[str] = set()
        self.index = 0
        self.body: list[ast.stmt] = []

    def run(self, tree: ast.Module) -> dict[str, _Need]:
        self.body = tree.body
        for i, stmt in enumerate(tree.body):
            self.index = i
            if not self.frame.live:
                break
            self.stmt(stmt)
        self._fallback()
        return dict(sorted(self.needs.items(), key=lambda kv: kv[1].line))

    # -- reads and binds ---------------------------------------------------------------------
    def read(self, name: str, line: int, *, skip_class: bool = False) -> None:
        frame = self.frame
        if frame is not self.mod and not skip_class and name in frame.definite:
            return
        mod = self.mod
        if name not in mod.definite and name in self.universe:
            optional = name in mod.maybe or self.optional > 0
            need = self.needs.get(name)
            if need is None:
                self.needs[name] = _Need(line, optional)
            elif need.optional and not optional:
                need.optional = False
                need.line = line
        d = self.defs.get(name)
        if d is not None and name not in self.activating:
            self._activate(name, d)

    def _activate(self, name: str, d: _Deferred) -> None:
        """The cell uses a function it defined: its global reads happen now."""
        d.activated = True
        self.activating.add(name)
        saved, self.frame = self.frame, self.mod
        try:
            for n, line in d.reads:
                self.read(n, line)
            for n in d.global_binds:
                self._bind_module(n)
        finally:
            self.frame = saved
            self.activating.discard(name)

    def bind(self, name: str, *, definite: bool = True) -> None:
        frame = self.frame
        if frame is self.mod:
            self.defs.pop(name, None)
            if name not in self.universe:
                return
        # a class body tracks all its names: each hides the module's from the reads after it
        if definite and not self.cond:
            frame.definite.add(name)
        frame.maybe.add(name)

    def _bind_module(self, name: str) -> None:
        if name in self.universe:
            self.mod.definite.add(name)
            self.mod.maybe.add(name)

    def define(self, name: str, d: _Deferred) -> None:
        """``name`` is bound to a function/class/lambda with deferred reads ``d``."""
        frame = self.frame
        self.bind(name)
        if frame is self.mod:
            self.defs[name] = d
            self.all_defs.append(d)
        elif frame.deferred is not None:  # a method: part of the class
            frame.deferred.reads.extend(d.reads)
            frame.deferred.global_binds |= d.global_binds

    def _deferred(self) -> _Deferred:
        return _Deferred([], set(), self.index, frozenset(self.mod.definite))

    # -- branches ----------------------------------------------------------------------------
    def fork(self) -> _State:
        f = self.frame
        return set(f.definite), set(f.maybe), f.live

    def restore(self, state: _State) -> None:
        f = self.frame
        f.definite, f.maybe, f.live = set(state[0]), set(state[1]), state[2]

    def join(self, *states: _State) -> None:
        f = self.frame
        live = [s for s in states if s[2]]
        maybe: set[str] = set()
        for s in states:
            maybe |= s[1]
        f.maybe = maybe
        if live:
            definite = set(live[0][0])
            for s in live[1:]:
                definite &= s[0]
            f.definite, f.live = definite, True
        else:
            f.live = False

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if not self.frame.live:
                return
            self.stmt(stmt)

    # -- statements --------------------------------------------------------------------------
    def stmt(self, node: ast.stmt) -> None:
        if isinstance(node, ast.AsyncFor | ast.AsyncWith):
            raise _await_error(node.lineno, self.lines)
        if isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
            if (len(node.targets) == 1 and isinstance(target, ast.Name)
                    and isinstance(node.value, ast.Lambda)):
                self._arguments(node.value)
                self.define(target.id, self._function_reads(node.value))
                return
            self.expr(node.value)
            for t in node.targets:
                self.target(t)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self.read(node.target.id, node.lineno)
            self.expr(node.value)
            self.target(node.target)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.expr(node.value)
            if not self.future:
                self.expr(node.annotation)
            if isinstance(node.target, ast.Name):
                if node.value is not None:
                    self.bind(node.target.id)
            else:
                self.target(node.target)
        elif isinstance(node, _FUNCS):
            for d in node.decorator_list:
                self.expr(d)
            self._arguments(node)
            self.define(node.name, self._function_reads(node))
        elif isinstance(node, ast.ClassDef):
            self._class(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                self.bind((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            self._import_from(node)
        elif isinstance(node, ast.If):
            self.expr(node.test)
            start = self.fork()
            self.block(node.body)
            after_body = self.fork()
            self.restore(start)
            self.block(node.orelse)
            self.join(after_body, self.fork())
        elif isinstance(node, ast.For):
            self.expr(node.iter)
            self._loop(node, forever=False)
        elif isinstance(node, ast.While):
            self.expr(node.test)
            forever = isinstance(node.test, ast.Constant) and bool(node.test.value)
            self._loop(node, forever=forever)
        elif isinstance(node, _TRY):
            self._try(node)
        elif isinstance(node, ast.With):
            for item in node.items:
                self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.target(item.optional_vars)
            self.block(node.body)
        elif isinstance(node, ast.Match):
            self._match(node)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.read(t.id, t.lineno)
                else:
                    self.target(t)
        elif isinstance(node, ast.Break | ast.Continue):
            if not self.loops:  # what compile() would say, found without compiling
                what = "'break' outside loop" if isinstance(node, ast.Break) else \
                    "'continue' not properly in loop"
                raise self._syntax_error(what, node)
            self.loops[-1][isinstance(node, ast.Continue)].append(self.fork())
            self.frame.live = False
        elif isinstance(node, ast.Return):
            raise self._syntax_error("'return' outside function", node)
        elif isinstance(node, ast.Raise):
            self.expr(node.exc)
            self.expr(node.cause)
            self.frame.live = False

        elif isinstance(node, ast.Global | ast.Nonlocal | ast.Pass):
            pass
        else:  # Assert, TypeAlias, ...: their expressions, in order
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def _syntax_error(self, message: str, node: ast.stmt) -> SyntaxError:
        text = self.lines.text(node.lineno)
        return SyntaxError(message, (self.filename, node.lineno, node.col_offset + 1, text))

    def target(self, node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            self.bind(node.id)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self.target(elt)
        elif isinstance(node, ast.Starred):
            self.target(node.value)
        elif isinstance(node, ast.Attribute):
            self.expr(node.value)
        elif isinstance(node, ast.Subscript):
            self.expr(node.value)
            self.expr(node.slice)

    def _arguments(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        for d in (*a.defaults, *a.kw_defaults):
            if d is not None:
                self.expr(d)
        if not self.future and not isinstance(node, ast.Lambda):
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    self.expr(arg.annotation)
            if node.returns is not None:
                self.expr(node.returns)

    def _function_reads(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                        ) -> _Deferred:
        r = _Resolver(self.future, self.lines)
        r.function(node, [])
        d = self._deferred()
        d.reads, d.global_binds = r.reads, r.global_binds
        return d

    def _class(self, node: ast.ClassDef) -> None:
        for d in (*node.decorator_list, *node.bases, *(k.value for k in node.keywords)):
            self.expr(d)
        outer = self.frame
        frame = _Frame()
        frame.deferred = self._deferred()
        self.frame = frame
        saved_loops, self.loops = self.loops, []
        try:
            self.block(node.body)
        finally:
            self.frame = outer
            self.loops = saved_loops
        self.define(node.name, frame.deferred)

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.level:
            raise _relative_error(node, self.lines)
        if node.module == "__future__":
            if any(a.name == "annotations" for a in node.names):
                self.future = True
        for alias in node.names:
            if alias.name == "*":
                for name in _star_names(node.module or "", node.lineno, self.lines):
                    self.bind(name)
            else:
                self.bind(alias.asname or alias.name)

    def _loop(self, node: ast.For | ast.AsyncFor | ast.While, *, forever: bool) -> None:
        start = self.fork()
        if isinstance(node, ast.For | ast.AsyncFor):
            self.target(node.target)
        self.loops.append(([], []))
        self.block(node.body)
        breaks, continues = self.loops.pop()
        if forever:  # ``while True``: the only way out is a break
            if breaks:
                self.join(*breaks)
            else:
                self.frame.live = False
            return
        self.join(start, self.fork(), *continues)  # the body may run zero times
        self.block(node.orelse)
        self.join(self.fork(), *breaks)

    def _try(self, node: ast.Try) -> None:
        handles_name_error = any(_catches_name_error(h.type) for h in node.handlers)
        start = self.fork()
        self.optional += handles_name_error
        try:
            self.block(node.body)
        finally:
            self.optional -= handles_name_error
        after_body = self.fork()
        ends: list[_State] = []
        for handler in node.handlers:
            # the exception may come before any statement of the body ran
            self.restore((start[0], start[1] | after_body[1], start[2]))
            if handler.type is not None:
                self.expr(handler.type)
            if handler.name:
                self.bind(handler.name)
            self.block(handler.body)
            ends.append(self.fork())
        self.restore(after_body)
        self.block(node.orelse)
        self.join(self.fork(), *ends)
        if node.finalbody:
            normal = self.fork()
            self.restore((start[0] & normal[0], normal[1], start[2]))
            entry = set(self.frame.definite)
            self.block(node.finalbody)
            final = self.fork()
            added = final[0] - entry
            self.restore((normal[0] | added, final[1], normal[2] and final[2]))

    def _match(self, node: ast.Match) -> None:
        self.expr(node.subject)
        start = self.fork()
        ends: list[_State] = []
        exhaustive = False
        for case in node.cases:
            self.restore(start)
            self._pattern(case.pattern)
            if case.guard is not None:
                self.expr(case.guard)
            self.block(case.body)
            ends.append(self.fork())
            if case.guard is None and isinstance(case.pattern, ast.MatchAs) \
                    and case.pattern.pattern is None:
                exhaustive = True  # ``case _:`` or ``case name:``
        if not exhaustive:
            ends.append(start)
        self.join(*ends)

    def _pattern(self, node: ast.pattern) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.MatchValue):
                self.expr(sub.value)
            elif isinstance(sub, ast.MatchClass):
                self.expr(sub.cls)
            elif isinstance(sub, ast.MatchMapping):
                for key in sub.keys:
                    self.expr(key)
                if sub.rest:
                    self.bind(sub.rest)
            elif isinstance(sub, ast.MatchAs | ast.MatchStar) and sub.name:
                self.bind(sub.name)

    # -- expressions -------------------------------------------------------------------------
    def expr(self, node: ast.AST | None) -> None:
        # the commonest nodes first, tested by exact type (parsed trees have no subclasses)
        if type(node) is ast.Name:
            if type(node.ctx) is not ast.Store:
                self.read(node.id, node.lineno)
            return
        if type(node) is ast.Call:
            shell_names = _check_call(node, self.lines)
            if shell_names:  # expanded when the command runs, if they exist: optional
                self.optional += 1
                for name in shell_names:
                    self.read(name, node.lineno)
                self.optional -= 1
            self.expr(node.func)
            for arg in node.args:
                self.expr(arg)
            for kw in node.keywords:
                self.expr(kw.value)
            return
        t = type(node)
        if node is None or t is ast.Constant:
            return
        if t is ast.Attribute:
            self.expr(node.value)  # type: ignore[attr-defined]
            return
        fields = _EXPR_FIELDS.get(t)
        if fields is not None:
            for name in fields:
                sub = getattr(node, name)
                if type(sub) is list:
                    for item in sub:
                        self.expr(item)
                else:
                    self.expr(sub)
            return
        if isinstance(node, ast.NamedExpr):
            self.expr(node.value)
            self.bind(node.target.id)
            return
        if isinstance(node, ast.BoolOp):
            self.expr(node.values[0])
            self.cond += 1
            for value in node.values[1:]:
                self.expr(value)
            self.cond -= 1
            return
        if isinstance(node, ast.IfExp):
            self.expr(node.test)
            self.cond += 1
            self.expr(node.body)
            self.expr(node.orelse)
            self.cond -= 1
            return
        if isinstance(node, ast.Lambda):
            # not bound to a name: assume it is used right away (sorted(key=...), map(...))
            self._arguments(node)
            for name, line in self._function_reads(node).reads:
                self.read(name, line)
            return
        if isinstance(node, _COMPS):
            if any(g.is_async for g in node.generators):
                raise _await_error(node.lineno, self.lines)
            self.expr(node.generators[0].iter)
            r = _Resolver(self.future, self.lines)
            r.comprehension(node, [])
            # a comprehension in a class body does not see the class's names
            for name, line in r.reads:
                self.read(name, line, skip_class=True)
            for name in r.module_binds:
                self.bind(name, definite=False)
            return
        if isinstance(node, ast.Await):
            raise _await_error(node.lineno, self.lines)
        if isinstance(node, ast.Yield | ast.YieldFrom):
            raise _yield_error(node.lineno, self.lines)
        assert node is not None
        for child in ast.iter_child_nodes(node):
            self.expr(child)

    # -- functions the cell never uses by name -----------------------------------------------
    def _fallback(self) -> None:
        """A function the cell defines but never uses by name (a decorator registered it, a
        method called through an instance of a class from the notebook, ...) may run at any
        time: the globals it reads that the cell binds nowhere after it are optional needs."""
        pending = [d for d in self.all_defs if not d.activated and d.reads]
        if not pending:
            return
        later: list[set[str]] = [set() for _ in range(len(self.body) + 1)]
        for i in range(len(self.body) - 1, -1, -1):
            later[i] = later[i + 1] | _bound_in([self.body[i]])[0]
        late_global = set().union(*(d.global_binds for d in self.all_defs))
        for d in pending:
            for name, line in d.reads:
                if name in d.definite or name in later[d.index] or name in late_global:
                    continue
                if name not in self.needs and name in self.universe:
                    self.needs[name] = _Need(line, optional=True)


def _catches_name_error(node: ast.expr | None) -> bool:
    if node is None:
        return True  # a bare ``except:``
    if isinstance(node, ast.Tuple):
        return any(_catches_name_error(e) for e in node.elts)
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name == "NameError"


def _star_names(module: str, line: int, lines: _Lines) -> list[str]:
    """The names ``from module import *`` binds, found by importing it here."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise CaptureError(
            f"{lines.where(line)}: nbdist must know which names `from {module} import *` "
            f"defines, to tell them from the notebook's, but {module!r} does not import in the "
            f"notebook: {type(exc).__name__}: {exc}. Import the names you use explicitly: "
            f"`from {module} import a, b`."
        ) from None
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return [str(n) for n in names]


# -- by name ------------------------------------------------------------------------------------
def _as_import(name: str, value: Any) -> Import | None:
    """An import that gives ``value`` on the rank, if there is one."""
    if isinstance(value, types.ModuleType):
        if value.__name__ == "__main__" or sys.modules.get(value.__name__) is not value:
            return None  # made up at run time: cloudpickle ships it by value
        return Import(name, value.__name__)
    try:
        modname: Any = getattr(value, "__module__", None)
        qualname: Any = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    except Exception:  # objects whose attribute access raises
        return None
    if not isinstance(modname, str) or not isinstance(qualname, str):
        return None
    if modname == "__main__" or "." in qualname or "<" in qualname:
        return None
    module = sys.modules.get(modname)
    if module is None:
        return None
    try:
        if getattr(module, qualname, _MISSING) is not value:
            return None
    except Exception:
        return None
    return Import(name, modname, qualname)


def _submodules(module: str, paths: Iterable[str]) -> list[str]:
    """Submodules of ``module`` the cell reaches through attributes (``xml.etree.ElementTree``):
    a fresh interpreter does not have them just because the package is imported."""
    found: list[str] = []
    for path in sorted(paths):
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            sub = module + "." + ".".join(parts[:k])
            if sub not in sys.modules:
                break
            if sub not in found:
                found.append(sub)
    return found


# -- by value -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rule:
    what: str
    why: str
    instead: str
    check: Callable[[Any], bool] | None = None


def _is_cuda(obj: Any) -> bool:
    try:
        return obj.is_cuda is True
    except Exception:
        return False


_SPARK_HANDLE = _Rule(
    "a Spark handle",
    "it belongs to the Spark driver in this notebook, which the ranks cannot reach",
    "read the data inside the cell with a library the ranks have (e.g. pandas.read_parquet("
    "path)), or turn what the ranks need into plain data in an earlier cell "
    "(pdf = df.toPandas()) and use that",
)
_SPARK_DATA = _Rule(
    "a Spark DataFrame (or RDD)",
    "its rows live in Spark, and it only works next to the notebook's Spark session",
    "collect what the ranks need into plain data in an earlier cell (pdf = df.toPandas()), "
    "or write it out (df.write.parquet(path)) and read the files inside the cell",
)
_THREAD = _Rule(
    "a thread", "a thread runs only inside the process that started it",
    "start the thread inside the cell, so each rank runs its own",
)
_LOCK = _Rule(
    "a lock", "a lock synchronises only the threads of the process that made it",
    "create it inside the cell; to coordinate ranks use torch.distributed "
    "(dist.barrier(), dist.all_reduce(...))",
)
_FILE = _Rule(
    "an open file", "an open file belongs to the process that opened it",
    "pass the path, and open the file inside the cell (with open(path) as f: ...)",
)
_SOCKET = _Rule(
    "a socket", "a connection belongs to the process that opened it",
    "open the connection inside the cell, so each rank makes its own",
)
_GENERATOR = _Rule(
    "a generator", "a running generator's state cannot be copied to another process",
    "ship what it produces (items = list(gen) in an earlier cell), or the function that "
    "creates it, and call that inside the cell",
)
_DATABASE = _Rule(
    "a database connection", "a connection belongs to the process that opened it",
    "connect inside the cell (e.g. sqlite3.connect(path)), so each rank opens its own",
)
_WIDGET = _Rule(
    "a Jupyter widget", "widgets live in the notebook's front end, which ranks do not have",
    "keep widgets in the notebook; on the ranks print, or use nbdist.progress(...) and "
    "nbdist.report(...) to show progress and metrics in the panel",
)
_CUDA = _Rule(
    "a CUDA tensor",
    "it lives in this machine's GPU memory; ranks may run on other machines, each with its "
    "own GPU",
    "move it to the CPU first (x.cpu(), model.cpu(), or a state_dict of CPU tensors), or "
    "create it on the rank: torch.device('cuda', int(os.environ['LOCAL_RANK']))",
    check=_is_cuda,
)
_SPARK_HANDLES = frozenset({
    "SparkSession", "SparkContext", "SQLContext", "HiveContext", "StreamingContext",
    "DataFrameReader", "DataFrameWriter", "DataStreamReader", "DataStreamWriter",
    "StreamingQuery", "Catalog",
})
_SPARK_DATAS = frozenset({"DataFrame", "RDD", "Column", "GroupedData", "Broadcast", "Accumulator"})
_DB_ROOTS = frozenset({
    "sqlite3", "_sqlite3", "psycopg", "psycopg2", "pymysql", "MySQLdb", "mysql", "sqlalchemy",
    "duckdb", "pyodbc", "cx_Oracle", "oracledb", "pymssql", "snowflake", "redis", "pymongo",
    "clickhouse_driver", "databricks",
})
_DB_WORDS = ("connection", "cursor", "engine", "session", "client", "pool", "redis", "blob")
_BY_TYPE: dict[tuple[str, str], _Rule] = {
    ("threading", "Thread"): _THREAD,
    ("_thread", "lock"): _LOCK, ("_thread", "RLock"): _LOCK,
    ("threading", "Condition"): _LOCK, ("threading", "Semaphore"): _LOCK,
    ("threading", "BoundedSemaphore"): _LOCK, ("threading", "Event"): _LOCK,
    ("threading", "Barrier"): _LOCK,
    ("_io", "_IOBase"): _FILE,
    ("socket", "socket"): _SOCKET, ("_socket", "socket"): _SOCKET,
    ("builtins", "generator"): _GENERATOR, ("builtins", "coroutine"): _GENERATOR,
    ("builtins", "async_generator"): _GENERATOR,
    ("ipywidgets.widgets.widget", "Widget"): _WIDGET,
    ("torch", "Tensor"): _CUDA,
}
_NOT_FILES = frozenset({("_io", "BytesIO"), ("_io", "StringIO")})
_rules: dict[type, _Rule | None] = {}


def _rule_for_type(t: type) -> _Rule | None:
    for cls in t.__mro__:
        module = getattr(cls, "__module__", "") or ""
        qualname = getattr(cls, "__qualname__", "") or ""
        key = (module, qualname)
        if key in _NOT_FILES:
            return None
        rule = _BY_TYPE.get(key)
        if rule is not None:
            return rule
        root = module.partition(".")[0]
        if root == "pyspark":
            if qualname in _SPARK_HANDLES:
                return _SPARK_HANDLE
            if qualname in _SPARK_DATAS:
                return _SPARK_DATA
        elif module in ("multiprocessing.synchronize", "asyncio.locks"):
            return _LOCK
        elif root in _DB_ROOTS and any(w in qualname.lower() for w in _DB_WORDS):
            return _DATABASE
    return None


def _rule_for(obj: Any) -> _Rule | None:
    t = type(obj)
    try:
        rule = _rules[t]
    except KeyError:
        if len(_rules) > 10_000:  # notebooks that redefine classes in a loop
            _rules.clear()
        rule = _rules[t] = _rule_for_type(t)
    except TypeError:  # an unhashable metaclass
        rule = _rule_for_type(t)
    if rule is None or (rule.check is not None and not rule.check(obj)):
        return None
    return rule


class _Refused(Exception):
    def __init__(self, obj: Any, rule: _Rule) -> None:
        super().__init__(rule.what)
        self.obj = obj
        self.rule = rule


class _NamespaceMarker(dict[str, Any]):
    """Stands for the notebook's namespace as the globals of notebook functions: pickled as a
    reference to ``runtime._cell_namespace``, which the rank's loader maps to the namespace
    the cell runs in (so notebook functions see what the cell assigns, as in the notebook)."""


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    def __init__(self, file: io.BytesIO, user_ns: Mapping[str, Any]) -> None:
        super().__init__(file)
        self.globals_ref[id(user_ns)] = _NamespaceMarker()

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _NamespaceMarker:
            return runtime._cell_namespace, ()
        rule = _rule_for(obj)
        if rule is not None:
            raise _Refused(obj, rule)
        return super().reducer_override(obj)


def _ship(captured: Captured, shipping: dict[str, _Need], user_ns: Mapping[str, Any],
          lines: _Lines) -> None:
    """Pickle the values in one stream; refuse needed ones that cannot go, drop optional ones.

    A failed dump leaves the stream and its memo half-written, so after dropping an optional
    value everything is pickled again from the start (failures are rare; retries cheap)."""
    names = list(shipping)
    while True:
        buf = io.BytesIO()
        pickler = _Pickler(buf, user_ns)
        values: list[Value] = []
        failed: str | None = None
        for name in names:
            value = user_ns[name]
            start = buf.tell()
            try:
                pickler.dump(value)
            except _Refused as exc:
                error = _refusal(name, value, shipping[name], exc, lines)
                what = f"{exc.rule.what} ({_type_name(type(exc.obj))})"
            except Exception as exc:
                error = _unpicklable(name, value, shipping[name], exc, lines)
                what = f"a {_kind(value)} that cloudpickle cannot serialise"
            else:
                need = shipping[name]
                values.append(Value(name, _kind(value), buf.tell() - start, need.line,
                                    need.optional))
                continue
            if not shipping[name].optional:
                raise error
            captured.left_out[name] = f"{what}, which cannot be sent; the cell can do without it"
            failed = name
            break
        if failed is None:
            captured.values = values
            captured.data = buf.getvalue()
            return
        names.remove(failed)


def _kind(value: Any) -> str:
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType):
        return "function"
    if isinstance(value, type):
        return "class"
    if isinstance(value, types.ModuleType):
        return "module"
    return _type_name(type(value))


def _type_name(t: type) -> str:
    module = getattr(t, "__module__", "") or ""
    qualname = getattr(t, "__qualname__", t.__name__)
    return qualname if module in ("builtins", "__main__", "") else f"{module}.{qualname}"


def _refusal(name: str, value: Any, need: _Need, exc: _Refused, lines: _Lines) -> CaptureError:
    rule = exc.rule
    kind = _type_name(type(exc.obj))
    what = rule.what if kind.lower() in rule.what else f"{rule.what} ({kind})"
    if exc.obj is value:
        held = f"it is {what}"
    else:
        path = _find_path(name, value, exc.obj)
        held = f"it is a {_kind(value)} that holds {what}" + (f" at {path}" if path else "")
    return CaptureError(
        f"cannot send {name!r} to the ranks: {held}; the cell uses it at "
        f"{lines.where(need.line)}.\n"
        f"Why: {rule.why}.\n"
        f"Instead: {rule.instead}."
    )


def _unpicklable(name: str, value: Any, need: _Need, exc: Exception, lines: _Lines
                 ) -> CaptureError:
    return CaptureError(
        f"cannot send {name!r} to the ranks: it is a {_kind(value)} that cloudpickle cannot "
        f"serialise ({type(exc).__name__}: {exc}); the cell uses it at "
        f"{lines.where(need.line)}.\n"
        f"Instead: create it inside the cell, so each rank makes its own, or ship the plain "
        f"data it is made from."
    )


def _find_path(name: str, root: Any, target: Any, limit: int = 20_000) -> str:
    """Where ``target`` sits inside ``root``, as an expression (``cfg['db']``,
    ``train → global lock``), by a bounded breadth-first search of what pickling follows."""
    seen = {id(root)}
    queue: deque[tuple[Any, str]] = deque([(root, name)])
    steps = 0
    while queue and steps < limit:
        obj, path = queue.popleft()
        steps += 1
        for child, sub in _children(obj, path):
            if child is target:
                return sub
            if id(child) not in seen and not isinstance(child, (str, bytes, int, float)):
                seen.add(id(child))
                queue.append((child, sub))
    return ""


def _children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:
    try:
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:1000]:
                yield v, f"{path}[{k!r}]"
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj[:1000]):
                yield v, f"{path}[{i}]"
        elif isinstance(obj, set | frozenset):
            for v in list(obj)[:1000]:
                yield v, f"{path} (an element)"
        elif isinstance(obj, types.FunctionType):
            for g in sorted(_code_globals(obj.__code__)):
                if g in obj.__globals__:
                    yield obj.__globals__[g], f"{path} → global {g}"
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
                try:
                    yield cell.cell_contents, f"{path} → closure {var}"
                except ValueError:
                    pass
            for i, d in enumerate(obj.__defaults__ or ()):
                yield d, f"{path} → default {i}"
        elif isinstance(obj, types.MethodType):
            yield obj.__self__, f"{path}.__self__"
            yield obj.__func__, path
        elif isinstance(obj, type):
            if obj.__module__ == "__main__":
                for k, v in vars(obj).items():
                    if not k.startswith("__"):
                        yield v, f"{path}.{k}"
        else:
            func = getattr(obj, "func", None)  # functools.partial
            if callable(func) and hasattr(obj, "keywords"):
                yield func, f"{path}.func"
                yield from ((a, f"{path}.args[{i}]") for i, a in enumerate(obj.args))
                yield from ((v, f"{path}.keywords[{k!r}]") for k, v in obj.keywords.items())
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                for k, v in attrs.items():
                    yield v, f"{path}.{k}"
    except Exception:  # a diagnostic must not fail the capture: give up on this branch
        return


def _code_globals(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_globals(const)
    return names


def _large_message(v: Value, limit: int, lines: _Lines) -> str:
    return (
        f"{v.name!r} ({v.kind}) is {_human(v.size)} pickled, over the {_human(limit)} warning "
        f"threshold: every rank receives a copy at start-up, which is slow. The cell uses it "
        f"at {lines.where(v.line)}. Load it inside the cell from a file the ranks can read, "
        f"or raise the threshold: %config DistMagics.large_value_mb = "
        f"{max(1, int(v.size / 1e6) + 1)}"
    )


# -- export: a standalone script for torchrun ---------------------------------------------------
_EXPORT_LOADER = '''\
def _nbdist_load_values():
    import os
    import pickle

    class _Loader(pickle.Unpickler):
        def find_class(self, module, name):
            # notebook functions get this script's globals, as they had the notebook's
            if (module, name) == ("nbdist.runtime", "_cell_namespace"):
                return globals
            return super().find_class(module, name)

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), {data!r})
    with open(path, "rb") as f:
        loader = _Loader(f)
        for name in {names!r}:
            globals()[name] = loader.load()


_nbdist_load_values()
'''


def _without_annotations(source: str) -> str:
    """``source`` without annotations: the script must not need ``typing`` names, nor a
    ``from __future__ import annotations`` that would change how the cell's own behave."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, _FUNCS):
            node.returns = None
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    arg.annotation = None
    return ast.unparse(tree) + "\n"


def _write_export(captured: Captured, path: Path, np: int) -> list[Path]:
    import inspect

    source = captured.source
    tree = ast.parse(source)
    body = source.splitlines()
    futures: list[str] = []
    if captured.flags & _CO_FUTURE_ANNOTATIONS:
        futures.append("from __future__ import annotations")
    for stmt in tree.body:  # future imports must open the file: move them there
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            futures.append(ast.unparse(stmt))
            for i in range(stmt.lineno - 1, stmt.end_lineno or stmt.lineno):
                body[i] = "# (moved to the top) " + body[i]
    data = path.with_name(path.stem + ".values.pkl")
    out = [
        '"""A notebook cell exported by nbdist (%%distributed --export).',
        "",
        f"Run it with:  torchrun --nproc-per-node {np} {path.name}",
        "It needs the packages the cell imports"
        + (f", plus cloudpickle to load {data.name} (keep it next to this file)."
           if captured.values else "."),
        'The value of the last line is printed by rank 0.',
        '"""',
        *dict.fromkeys(futures),
        "import os as _nbdist_os",
        "",
    ]
    if captured.imports or captured.submodules:
        out.append("# -- names from earlier cells, imported by name --")
        out.extend(i.statement() for i in captured.imports)
        if captured.submodules:
            out.append("import importlib as _nbdist_importlib")
            out.extend(f"_nbdist_importlib.import_module({m!r})" for m in captured.submodules)
        out.append("")
    if captured.values:
        names = [v.name for v in captured.values]
        out.append(f"# -- values from earlier cells: {', '.join(names)} --")
        out.append(_EXPORT_LOADER.format(data=data.name, names=tuple(names)))
    if "get_ipython" in source:
        out.append("# -- IPython's !cmd and %pip, run through a shell --")
        out.append(_without_annotations(inspect.getsource(runtime._RankShell)))
        out.append("def get_ipython():\n    return _RankShell(globals())\n\n")
    out.append("# -- the cell --")
    last = tree.body[-1] if captured.returns_last and tree.body else None
    if isinstance(last, ast.Expr):
        out.extend(body[: last.lineno - 1])
        # statements before it on its line (``y = 2; y + 1``); offsets count UTF-8 bytes
        before = body[last.lineno - 1].encode()[:last.col_offset].decode()
        if before.strip():
            out.append(before.rstrip())
        out.append("_nbdist_value = (")
        out.extend("    " + line for line in
                   (ast.get_source_segment(source, last.value) or "None").splitlines())
        out.append(")")
        out.append('if _nbdist_value is not None and _nbdist_os.environ.get("RANK", "0") == "0":')
        out.append("    print(repr(_nbdist_value))")
        out.extend(body[(last.end_lineno or last.lineno):])
    else:
        out.extend(body)
    path.write_text("\n".join(out).rstrip("\n") + "\n")
    written = [path]
    if captured.values:
        data.write_bytes(captured.data)
        written.append(data)
    return written

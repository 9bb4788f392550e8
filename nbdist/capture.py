"""Cell source + the notebook's namespace → a self-contained payload, or a clear error.

What the cell uses from earlier cells travels in one of two ways:

- **by name**: modules, and objects that can be imported from a module (``from math import
  sqrt as s``), become import statements run on the rank: never pickled;
- **by value**: functions and classes defined in the notebook, and plain values, are shipped
  with cloudpickle (which ships notebook functions with the globals *they* use).

Names the cell assigns before using them are the cell's own and are not captured. A value
that cannot be pickled is refused before launch, naming the variable, its type and the line.
This module does not import Spark, widgets or launchers.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from nbdist.errors import CaptureError

#: Names IPython puts in the user namespace that never travel.
_IPYTHON_NAMES = frozenset({
    "In", "Out", "_", "__", "___", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "exit", "quit",
    "get_ipython", "__builtin__", "__builtins__", "__name__", "__doc__", "__spec__",
    "__loader__", "__package__",
})


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


@dataclass
class Captured:
    """A cell made self-contained."""

    source: str  # the cell as Python (IPython syntax already transformed)
    filename: str
    imports: list[Import] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    returns_last: bool = True
    line_offset: int = 0  # lines above the source in the user's cell (the %%distributed line)

    def payload(self) -> dict[str, Any]:
        return {
            "kind": "cell",
            "source": self.source,
            "filename": self.filename,
            "imports": [(i.name, i.module, i.attr) for i in self.imports],
            "values": self.values,
            "returns_last": self.returns_last,
            "line_offset": self.line_offset,
        }

    def function_source(self, name: str = "cell") -> str:
        """The cell as the self-contained function that runs on each rank (for --show-source)."""
        out = [f"def {name}():"]
        if self.imports:
            out.append("    # imported on the rank, by name")
            out.extend(f"    {i.statement()}" for i in self.imports)
        if self.values:
            out.append("    # shipped by value from the notebook (cloudpickle)")
            for key, value in self.values.items():
                out.append(f"    {key} = ...  # {_describe(value)}")
        out.append("    # the cell")
        body = self.source.rstrip("\n").splitlines() or ["pass"]
        try:
            tree = ast.parse(self.source)
            last = tree.body[-1] if tree.body else None
        except SyntaxError:
            last = None
        if self.returns_last and isinstance(last, ast.Expr):
            start = last.lineno - 1
            body[start] = "return " + body[start].lstrip() if not body[start][:1].isspace() \
                else body[start]
        out.extend(f"    {line}" if line else "" for line in body)
        return "\n".join(out) + "\n"


def _describe(value: Any) -> str:
    kind = type(value).__qualname__
    if isinstance(value, types.FunctionType):
        kind = "function"
    elif isinstance(value, type):
        kind = "class"
    try:
        size = len(cloudpickle.dumps(value))
    except Exception:
        return kind
    return f"{kind}, {_human(size)}"


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def capture_cell(
    cell: str,
    user_ns: Mapping[str, Any],
    *,
    transform: Callable[[str], str] | None = None,
    filename: str = "<cell>",
    line_offset: int = 0,
) -> Captured:
    """Turn a cell into a :class:`Captured`, or raise :class:`CaptureError` / ``SyntaxError``.

    ``transform`` turns IPython syntax (``!cmd``, ``%magic``) into Python; pass the shell's
    ``transform_cell``.
    """
    source = transform(cell) if transform is not None else cell
    tree = ast.parse(source, filename)
    returns_last = bool(tree.body) and isinstance(tree.body[-1], ast.Expr) and not (
        cell.rstrip().endswith(";")
    )
    captured = Captured(
        source=source, filename=filename, returns_last=returns_last, line_offset=line_offset
    )
    for name, line in _free_names(tree):
        if name in _IPYTHON_NAMES or name not in user_ns:
            continue
        value = user_ns[name]
        if getattr(builtins, name, _MISSING) is value:
            continue
        imp = _as_import(name, value)
        if imp is not None:
            captured.imports.append(imp)
        else:
            _check_picklable(name, value, line, cell)
            captured.values[name] = value
    return captured


_MISSING = object()


def _as_import(name: str, value: Any) -> Import | None:
    """An import that gives ``value`` on the rank, if there is one."""
    if isinstance(value, types.ModuleType):
        if value.__name__ == "__main__":
            return None
        return Import(name, value.__name__)
    modname: Any = getattr(value, "__module__", None)
    qualname: Any = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if not isinstance(modname, str) or not isinstance(qualname, str):
        return None
    if modname == "__main__" or "." in qualname or "<" in qualname:
        return None
    module = sys.modules.get(modname)
    if module is None:
        try:
            module = importlib.import_module(modname)
        except Exception:
            return None
    if getattr(module, qualname, _MISSING) is not value:
        return None
    return Import(name, modname, qualname)


def _check_picklable(name: str, value: Any, line: int, cell: str) -> None:
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        text = cell.splitlines()[line - 1].strip() if 0 < line <= len(cell.splitlines()) else ""
        raise CaptureError(
            f"the cell uses {name!r} (a {type(value).__module__}.{type(value).__qualname__}) "
            f"from the notebook at line {line}: {text!r}, but it cannot be sent to the ranks: "
            f"{type(exc).__name__}: {exc}. Create it inside the cell instead, so each rank "
            f"makes its own."
        ) from None


def _free_names(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """Names the cell may read from the notebook, with the line of their first use.

    A name is the cell's own (not captured) when the first top-level statement that mentions
    it binds it without reading it first, unconditionally.
    """
    bound: set[str] = set()
    seen: set[str] = set()
    for stmt in tree.body:
        loads: list[tuple[str, int]] = []
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Load, ast.Del)):
                loads.append((node.id, node.lineno))
            elif isinstance(node, ast.Global | ast.Nonlocal):
                loads.extend((n, node.lineno) for n in node.names)
        for name, line in loads:
            if name not in bound and name not in seen:
                seen.add(name)
                yield name, line
        bound.update(_binds(stmt))


def _binds(stmt: ast.stmt) -> set[str]:
    """Names an unconditional top-level statement binds."""
    names: set[str] = set()
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        for alias in stmt.names:
            if alias.name != "*":
                names.add((alias.asname or alias.name).split(".")[0])
    elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        names.add(stmt.name)
    elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
    elif isinstance(stmt, ast.With | ast.For):
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names

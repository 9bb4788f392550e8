"""What travels to the ranks, and how: by name (imports) or by value (one cloudpickle stream).

- **by name**: modules, and objects that can be imported from a module (``from math import
  sqrt as s``), become import statements run on the rank, never pickled (:func:`by_name`);
  so do the submodules the cell reaches through a package (:func:`submodules_reached`);
- **by value**: functions and classes defined in the notebook, and plain values, are shipped
  with cloudpickle, which ships notebook functions with the globals *they* use (:func:`ship`).
  All values go in one pickle stream with one memo, so objects shared between them stay
  shared, and notebook functions get the rank's cell namespace as their globals, as they had
  the notebook's.

The pickler asks ``_refusals.py`` about every object it meets: a needed value that holds
something that cannot travel is refused, an optional one is left out.
"""

from __future__ import annotations

import builtins
import io
import re
import sys
import types
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nbdist._pickling import Pickler
from nbdist.capture._local import objects_modules
from nbdist.capture._refusals import Refused, kind_of, refusal, rule_for, type_name, unpicklable
from nbdist.capture._scope import Need
from nbdist.capture._syntax import Lines
from nbdist.protocol import ShippedCode, cell_namespace

#: Names IPython puts in the user namespace that never travel.
_IPYTHON_NAMES = frozenset({
    "In", "Out", "_i", "_ii", "_iii", "_oh", "_ih", "_dh", "_sh", "exit", "quit",
    "get_ipython", "__builtin__", "__builtins__", "__name__", "__doc__", "__spec__",
    "__loader__", "__package__", "__file__",
})
_MISSING = object()


@dataclass(frozen=True)
class Import:
    """A notebook name re-imported on the rank: ``import module as name`` or
    ``from module import attr as name``."""

    name: str
    module: str
    attr: str | None = None

    def statement(self) -> str:
        """The import statement, as the rank runs it (and ``--show-source`` shows it)."""
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


# -- by name ------------------------------------------------------------------------------------
def by_name(needs: Mapping[str, Need], user_ns: Mapping[str, Any],
            remote_names: Collection[str]) -> tuple[list[Import], dict[str, Need]]:
    """The notebook names the cell reads, split into imports and values to ship. IPython's
    own names, names the ranks already have, builtins the notebook did not rebind and names
    the notebook does not have (the cell fails on them as in the notebook) are neither."""
    imports: list[Import] = []
    shipping: dict[str, Need] = {}
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
        imports.append(imp)
    return imports, shipping


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


def submodules_reached(source: str, imports: Iterable[Import]) -> list[str]:
    """Submodules the source reaches through the modules it imports by name
    (``xml.etree.ElementTree.parse(...)`` with ``xml`` imported → ``xml.etree``,
    ``xml.etree.ElementTree``)."""
    modules = {i.name: i.module for i in imports if i.attr is None}
    found: list[str] = []
    for name, paths in _attr_paths(source, modules).items():
        for sub in _submodules(modules[name], paths):
            if sub not in found:
                found.append(sub)
    return found


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


# -- by value -----------------------------------------------------------------------------------
class _NamespaceMarker(dict[str, Any]):
    """Stands for the notebook's namespace as the globals of notebook functions: pickled as a
    reference to ``protocol.cell_namespace``, which the rank's loader maps to the namespace
    the cell runs in (so notebook functions see what the cell assigns, as in the notebook)."""


class _Pickler(Pickler):
    def __init__(self, file: io.BytesIO, user_ns: Mapping[str, Any]) -> None:
        super().__init__(file)
        self.globals_ref[id(user_ns)] = _NamespaceMarker()
        #: modules the stream refers to (classes, functions and modules pickled by name, what
        #: the functions pickled by value import): the notebook's own among them travel too
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _NamespaceMarker:
            return cell_namespace, ()
        rule = rule_for(obj)
        if rule is not None:
            raise Refused(obj, rule)
        if isinstance(obj, type | types.FunctionType | types.ModuleType):
            self.modules.update(objects_modules((obj,)))
        return super().reducer_override(obj)


def ship(shipping: Mapping[str, Need], user_ns: Mapping[str, Any], lines: Lines,
         modules: set[str] | None = None, replace: Mapping[str, Any] | None = None,
         ) -> tuple[list[Value], bytes, dict[str, str]]:
    """Pickle the values in one stream; refuse needed ones that cannot go, drop optional ones.
    Returns the values shipped, the stream, and why each optional value left out was; adds
    the modules the stream refers to to ``modules``. ``replace`` maps names to what is sent in
    their place (a table's shard plan).

    A failed dump leaves the stream and its memo half-written, so after dropping an optional
    value everything is pickled again from the start (failures are rare; retries cheap)."""
    names = list(shipping)
    left_out: dict[str, str] = {}
    while True:
        buf = io.BytesIO()
        pickler = _Pickler(buf, user_ns)
        values: list[Value] = []
        failed: str | None = None
        for name in names:
            value = replace[name] if replace and name in replace else user_ns[name]
            start = buf.tell()
            try:
                pickler.dump(value)
            except Refused as exc:
                error = refusal(name, value, shipping[name], exc, lines)
                what = f"{exc.rule.what} ({type_name(type(exc.obj))})"
            except Exception as exc:
                error = unpicklable(name, value, shipping[name], exc, lines)
                what = f"a {kind_of(value)} that cloudpickle cannot serialise"
            else:
                need = shipping[name]
                values.append(Value(name, kind_of(value), buf.tell() - start, need.line,
                                    need.optional))
                continue
            if not shipping[name].optional:
                raise error
            left_out[name] = f"{what}, which cannot be sent; the cell can do without it"
            failed = name
            break
        if failed is None:
            if modules is not None:
                modules.update(pickler.modules)
            return values, buf.getvalue(), left_out
        names.remove(failed)


def human_size(n: float) -> str:
    """A byte count as people read it: ``813 B``, ``9.2 KB``, ``150.0 MB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns


def large_message(v: Value, limit: int, lines: Lines) -> str:
    """The warning for a value that pickles to more than ``limit`` bytes."""
    return (
        f"{v.name!r} ({v.kind}) is {human_size(v.size)} pickled, over the "
        f"{human_size(limit)} warning threshold: every rank receives a copy at start-up, "
        f"which is slow. The cell uses it at {lines.where(v.line)}. Load it inside the cell "
        f"from a file the ranks can read, or raise the threshold: "
        f"%config DistMagics.large_value_mb = "
        f"{max(1, int(v.size / 1e6) + 1)}"
    )


def code_summary(code: ShippedCode) -> str:
    """The notebook's own modules in a line: ``helpers (1.2 KB), mypkg/ (3 files, 4.5 KB)``."""
    parts = []
    for name, count, size in code.modules:
        files = f"{count} files, " if name.endswith("/") else ""
        parts.append(f"{name} ({files}{human_size(size)})")
    return ", ".join(parts)


def large_code_message(code: ShippedCode, limit: int) -> str:
    """The warning for the notebook's own modules when they are more than ``limit`` bytes."""
    return (
        f"the notebook's own modules shipped by value ({code_summary(code)}) are "
        f"{human_size(code.size)}, over the {human_size(limit)} warning threshold: every rank "
        f"receives a copy at start-up, which is slow. Keep data files out of the package's "
        f"folder, install the package where the ranks run (then it is imported by name), or "
        f"raise the threshold: %config DistMagics.large_value_mb = "
        f"{max(1, int(code.size / 1e6) + 1)}"
    )

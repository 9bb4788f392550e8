"""The entry point: :func:`capture_cell` turns a cell and the notebook's namespace into a
:class:`Captured` (what runs on the ranks), or refuses it with a clear error.

The steps, each in a module of its own: ``_syntax.parse`` (the cell as Python),
``_scope.Flow`` (which notebook names it reads), ``_ship.by_name`` and ``_ship.ship``
(imports, and values in one cloudpickle stream, refused by ``_refusals`` when they cannot
travel). ``_export`` writes what ``--show-source`` and ``--export`` show.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Callable, Collection, Container, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.capture import _launchers as launchers
from nbdist.capture._export import function_source, write_export
from nbdist.capture._local import objects_modules, shadowing, shipped_code
from nbdist.capture._scope import Flow, Need
from nbdist.capture._shards import shard_only
from nbdist.capture._ship import (
    Import,
    Value,
    by_name,
    large_code_message,
    large_message,
    ship,
    submodules_reached,
)
from nbdist.capture._syntax import CO_FUTURE_ANNOTATIONS, Lines, has_value, parse
from nbdist.errors import CaptureError, CaptureWarning
from nbdist.importscan import source_imports
from nbdist.protocol import CellPayload, ShippedCode
from nbdist.rank.shard import ShardPlan
from nbdist.settings import settings


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
    code: ShippedCode | None = None  # the notebook's own modules, by value
    shards: dict[str, ShardPlan] = field(default_factory=dict)  # tables sent as their plans

    def payload(self) -> CellPayload:
        """What the rank runtime executes on each rank (``protocol.CellPayload``)."""
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
            "code": self.code,
        }

    def function_source(self, name: str = "cell") -> str:
        """The cell as the self-contained function that runs on each rank (for --show-source)."""
        return function_source(self, name)

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
        return write_export(self, Path(path), np)


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
        ``%config DistMagics.large_value_mb`` (``nbdist.settings``).
    remote_names : collection of str
        Names already defined on the ranks (a persistent session's earlier cells): neither
        shipped nor imported, so the notebook's values never shadow the ranks' own.

    Raises
    ------
    CaptureError
        A value the cell needs cannot travel, or the cell uses something that cannot run on a
        rank (a magic, top-level ``await``, a relative import); the message says what to do.
    """
    flags = compile_flags & CO_FUTURE_ANNOTATIONS
    lines = Lines(cell, line_offset)
    with _gc_paused():
        source, needs, returns_last, modules, sharded = _analyse(
            cell, transform, filename, lines, user_ns, bool(flags))
    imports, shipping = by_name(needs, user_ns, remote_names)
    captured = Captured(
        source=source, filename=filename, imports=imports,
        submodules=submodules_reached(source, imports), returns_last=returns_last,
        line_offset=line_offset, flags=flags,
        shards=_shard_plans(sharded, shipping, user_ns, lines),
    )
    modules.update(i.module for i in imports)
    limit = settings.large_value_bytes if warn_bytes is None else warn_bytes
    if shipping:
        captured.values, captured.data, captured.left_out = ship(
            shipping, user_ns, lines, modules, replace=captured.shards)
        for v in captured.values:
            if v.size > limit:
                warnings.warn(large_message(v, limit, lines), CaptureWarning, stacklevel=2)
    captured.code = shipped_code(modules)
    if captured.code is not None and captured.code.size > limit:
        warnings.warn(large_code_message(captured.code, limit), CaptureWarning, stacklevel=2)
    for name, file in shadowing(modules):
        warnings.warn(shadow_message(name, file), CaptureWarning, stacklevel=2)
    return captured


def shadow_message(name: str, file: str) -> str:
    """The warning for a notebook module that shadows an installed or standard one."""
    what = "a standard module" if name in sys.stdlib_module_names else "an installed package"
    return (f"the kernel imports {name} from the notebook's own {file}, which shadows "
            f"{what} of that name: the ranks import the installed {name}, not this file, so "
            f"they would run different code. Rename the file (and import it by its new name) "
            f"to ship it to the ranks.")


def call_code(fn: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ShippedCode | None:
    """The caller's own modules that ``nbdist.run(fn, *args, **kwargs)`` needs on the ranks:
    those of ``fn`` (its module, what its code imports) and of the arguments' classes, with
    what they import; None when there are none. A large tree warns as in :func:`capture_cell`.
    """
    modules = objects_modules((fn, *args, *kwargs.values()))
    code = shipped_code(modules)
    limit = settings.large_value_bytes
    if code is not None and code.size > limit:
        warnings.warn(large_code_message(code, limit), CaptureWarning, stacklevel=3)
    for name, file in shadowing(modules):
        warnings.warn(shadow_message(name, file), CaptureWarning, stacklevel=3)
    return code


def _analyse(cell: str, transform: Callable[[str], str] | None, filename: str, lines: Lines,
             universe: Container[str], future_annotations: bool
             ) -> tuple[str, dict[str, Need], bool, set[str], set[str]]:
    """The cell as Python, the notebook names it reads, whether it has a value, the modules
    it imports, and the names it reads only through ``nbdist.shard(name)``. Only these small
    results outlive the call: the tree goes with it (see :func:`_gc_paused`)."""
    source, tree = parse(cell, transform, filename, lines.offset)
    launchers.check(tree, lines)  # Lightning's ddp_notebook: refused before launch
    # a ``from __future__ import annotations`` in the cell is seen by the flow itself
    needs = Flow(lines, future_annotations, filename, universe).run(tree)
    return (source, needs, has_value(tree, source, lines.offset), set(source_imports(tree)),
            shard_only(tree) & set(needs))


def _shard_plans(sharded: set[str], shipping: Mapping[str, Need], user_ns: Mapping[str, Any],
                 lines: Lines) -> dict[str, ShardPlan]:
    """The plans of the notebook tables the cell reads only through ``nbdist.shard``, each
    exported once by ``nbdist/data.py`` (which imports pyarrow, and Spark's API for a Spark
    DataFrame, only when there is one)."""
    plans: dict[str, ShardPlan] = {}
    for name in sorted(sharded & set(shipping)):
        from nbdist import data

        if data.kind(user_ns[name]) is None:
            continue  # a path, or an object the rank's nbdist.shard judges
        try:
            plans[name] = data.plan_for(user_ns[name], name)
        except data.DataError as exc:
            raise CaptureError(f"{exc} (the cell uses it at "
                               f"{lines.where(shipping[name].line)})") from None
    return plans


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

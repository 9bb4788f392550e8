"""What ``--show-source`` prints and ``--export`` writes: the captured cell, made readable.

:func:`function_source` shows the cell as the self-contained function that runs on each rank
(imports by name, values with their kind and pickled size, names left out). :func:`write_export`
writes a standalone script for ``torchrun`` that does not import nbdist: the imports, a loader
for the values (saved next to it), a stand-in for ``get_ipython()`` when the cell runs shell
commands (the rank's own, copied from ``rank/shell.py``), and the cell.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from nbdist.capture._scope import FUNCS
from nbdist.capture._ship import code_summary, human_size
from nbdist.capture._syntax import CO_FUTURE_ANNOTATIONS, last_expr
from nbdist.rank.shell import RankShell

if TYPE_CHECKING:
    from nbdist.capture._api import Captured


# -- --show-source: the function that runs on each rank -----------------------------------------
def function_source(captured: Captured, name: str = "cell") -> str:
    """The cell as the self-contained function that runs on each rank (``--show-source``)."""
    out = [f"def {name}():"]
    if captured.imports or captured.submodules:
        out.append("    # imported on the rank, by name (never pickled)")
        out.extend(f"    {i.statement()}" for i in captured.imports)
        if captured.submodules:
            subs = ", ".join(captured.submodules)
            out.append(f"    # and the submodules the cell reaches: {subs}")
    if captured.code is not None:
        out.append(f"    # the notebook's own modules, shipped by value "
                   f"({human_size(captured.code.size)}): {code_summary(captured.code)}")
    if captured.values:
        total = sum(v.size for v in captured.values)
        out.append(f"    # shipped by value from the notebook (cloudpickle, {human_size(total)})")
        for v in captured.values:
            note = ", optional" if v.optional else ""
            out.append(f"    {v.name} = ...  # {v.kind}, {human_size(v.size)}{note}")
    for key, why in captured.left_out.items():
        out.append(f"    # not shipped: {key} ({why})")
    out.append("    # the cell")
    body = captured.source.rstrip("\n").splitlines() or ["pass"]
    last = last_expr(captured.source) if captured.returns_last else None
    if last is not None:
        start = last.lineno - 1
        body[start] = "return " + body[start]
        # a multi-line last expression keeps its lines; indent them under the return
        for i in range(start + 1, (last.end_lineno or last.lineno)):
            body[i] = "       " + body[i]
    out.extend(f"    {line}" if line.strip() else "" for line in body)
    return "\n".join(out) + "\n"


# -- --export: a standalone script for torchrun -------------------------------------------------
_EXPORT_LOADER = '''\
def _nbdist_load_values():
    import os
    import pickle

    class _Loader(pickle.Unpickler):
        def find_class(self, module, name):
            # notebook functions get this script's globals, as they had the notebook's
            if (module, name) == ("nbdist.protocol", "cell_namespace"):
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
        if isinstance(node, FUNCS):
            node.returns = None
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    arg.annotation = None
    return ast.unparse(tree) + "\n"


def write_export(captured: Captured, path: Path, np: int) -> list[Path]:
    """Write ``path`` (and its values next to it); see :meth:`Captured.export`."""
    import inspect

    source = captured.source
    tree = ast.parse(source)
    body = source.splitlines()
    futures: list[str] = []
    if captured.flags & CO_FUTURE_ANNOTATIONS:
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
        out.append(_without_annotations(inspect.getsource(RankShell)))
        out.append("def get_ipython():\n    return RankShell(globals())\n\n")
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

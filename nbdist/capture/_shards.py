"""Notebook tables that a cell reads only through ``nbdist.shard(name, ...)``.

Such a name is not shipped as it is (a Spark DataFrame cannot travel; a pandas one would be
copied whole to every rank): ``_ship`` sends the plan of its export instead
(``nbdist/data.py``), and the rank reads its rows of it (``nbdist/rank/shard.py``). A name the
cell uses any other way as well is shipped (or refused) as before.
"""

from __future__ import annotations

import ast


def shard_only(tree: ast.AST) -> set[str]:
    """The names whose every read in ``tree`` is the first argument (or ``source=``) of a call
    of ``shard``, ``nbdist.shard`` or ``<alias>.shard``."""
    as_source: set[int] = set()
    reads: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_shard(node.func):
            args = [node.args[0]] if node.args else []
            args += [k.value for k in node.keywords if k.arg == "source"]
            as_source.update(id(a) for a in args if isinstance(a, ast.Name))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads.setdefault(node.id, []).append(id(node))
    return {name for name, nodes in reads.items() if all(n in as_source for n in nodes)}


def _is_shard(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id == "shard"
    return isinstance(func, ast.Attribute) and func.attr == "shard"

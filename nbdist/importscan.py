"""Which modules a piece of code imports, read without running it: from a syntax tree or a
source text (``source_imports``), or from a code object's bytecode (``code_imports``).

The capture (the notebook's own modules a cell needs) and the launch (what a zygote imports
ahead, ``launch/payload.py``) ask the same question; this is the one answer. Absolute imports
only: a relative import names no module without its package. Pure, standard library only.
"""

from __future__ import annotations

import ast
import dis
import types
from collections.abc import Iterator
from typing import Any


def source_imports(tree: ast.AST | str) -> Iterator[str]:
    """Modules a syntax tree (or a source text: nothing where it does not parse) imports by
    absolute name."""
    if isinstance(tree, str):
        try:
            tree = ast.parse(tree)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def code_imports(code: types.CodeType) -> Iterator[str]:
    """Modules a code object, and the code nested in it, imports by absolute name."""
    consts: list[Any] = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_CONST", "LOAD_SMALL_INT"):  # the latter: Python 3.14
            consts.append(ins.argval)
        elif ins.opname == "IMPORT_NAME":
            # Compiled as LOAD_CONST level, LOAD_CONST fromlist, IMPORT_NAME name.
            if len(consts) >= 2 and consts[-2] == 0:
                yield str(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, classes, comprehensions
            yield from code_imports(const)

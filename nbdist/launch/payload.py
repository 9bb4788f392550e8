"""What a payload needs before it runs, read without running it: the modules it imports
(a backend imports them ahead, while the ranks meet) and the environment it sets first thing
(given to the ranks from the start, so those imports see it)."""

from __future__ import annotations

import ast
import types
from collections.abc import Mapping
from typing import Any

from nbdist.importscan import code_imports, source_imports


def payload_modules(payload: Mapping[str, Any]) -> tuple[str, ...]:
    """The modules a payload imports, as far as they can be told without running it.

    A backend may import them ahead, while the ranks are still being set up (the local
    backend's zygote does). Read from the function's bytecode, the cell's or script's source
    and the names the cell imports from the notebook; what is imported dynamically is missed,
    which only costs that head start. Relative imports are left out.
    """
    found: list[str] = []
    kind = payload.get("kind")
    if kind == "call":
        fn: Any = payload.get("fn")
        while not hasattr(fn, "__code__") and hasattr(fn, "func"):  # functools.partial
            fn = fn.func
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            found.extend(code_imports(code))
    elif kind == "cell":
        found.extend(module for _, module, _ in payload.get("imports", ()))
        found.extend(payload.get("submodules", ()))
        found.extend(source_imports(str(payload.get("source", ""))))
    elif kind == "script":
        try:
            with open(str(payload.get("path")), encoding="utf-8") as f:
                found.extend(source_imports(f.read()))
        except (OSError, UnicodeDecodeError):
            pass
    return tuple(dict.fromkeys(m for m in found if m and not m.startswith(".")))


def payload_env(payload: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables a cell sets first thing, before it runs or imports anything else.

    ``os.environ["KERAS_BACKEND"] = "jax"`` just before ``import keras`` is how Keras, and
    TensorFlow (``TF_USE_LEGACY_KERAS``, ``TF_CPP_MIN_LOG_LEVEL``) and JAX (``JAX_PLATFORMS``),
    are configured: they read it when they are imported. A rank forked from a zygote or taken
    warm has imported them already, under the kernel's environment (``import tensorflow`` even
    imports keras), so the cell's choice would be silently ignored. Given to the ranks from the
    start (a backend keys its zygotes and warm interpreters on their environment), those
    imports see it. Only string literals assigned to ``os.environ[...]`` in the cell's leading
    statements count, with nothing before them but imports of ``os``: setting those earlier
    changes nothing else the cell could see.
    """
    if payload.get("kind") != "cell":
        return {}
    try:
        tree = ast.parse(str(payload.get("source", "")))
    except (SyntaxError, ValueError):
        return {}
    env: dict[str, str] = {}
    environ = {"os.environ"}  # how the cell names os.environ so far
    for node in tree.body:
        if isinstance(node, ast.Import) and all(a.name == "os" for a in node.names):
            environ.update(f"{a.asname or 'os'}.environ" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and node.level == 0:
            environ.update(a.asname or a.name for a in node.names if a.name == "environ")
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(target := node.targets[0], ast.Subscript)
              and ast.unparse(target.value) in environ
              and isinstance(key := target.slice, ast.Constant) and isinstance(key.value, str)
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            env[key.value] = node.value.value
        else:
            break
    return env


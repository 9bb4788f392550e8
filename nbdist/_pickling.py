"""cloudpickle, keeping where shipped code came from.

cloudpickle 3.1.3 replaced every code object's ``co_filename`` with ``"<dynamic-code>"`` (to make
its streams deterministic). For nbdist that loses what users read first when a rank fails: the
file and line of their function in the rank's traceback (``File "train.py", line 12``, with the
source line where the rank can read it). nbdist does not need deterministic streams, so its
picklers put the real filename back. Everything else is cloudpickle's own reduction.

Both sides use it (the driver ships payloads and notebook values, a rank ships its values back);
rank-side modules import it where they pickle, as they import cloudpickle.
"""

from __future__ import annotations

import io
import types
from collections import ChainMap
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as impl

_DYNAMIC = "<dynamic-code>"


def _code_reduce(code: types.CodeType) -> Any:
    rebuild, args = impl._code_reduce(code)
    if code.co_filename != _DYNAMIC and _DYNAMIC in args:
        # co_filename is the first string argument of every CodeType signature cloudpickle
        # uses (before co_name and co_qualname); a version that keeps the filename has no
        # "<dynamic-code>" here and is left alone.
        at = args.index(_DYNAMIC)
        args = (*args[:at], code.co_filename, *args[at + 1 :])
    return rebuild, args


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """``cloudpickle.Pickler`` whose code objects keep their filename; subclass it."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping code filenames."""
    buf = io.BytesIO()
    Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()

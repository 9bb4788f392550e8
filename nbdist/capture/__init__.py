"""Cell source + the notebook's namespace → a self-contained payload, or a clear error.

What the cell uses from earlier cells travels in one of two ways: **by name** (modules, and
objects importable from a module, become imports run on the rank, never pickled) or **by
value** (notebook functions and classes, and plain values, in one cloudpickle stream). Which
names the cell takes from the notebook is decided by Python's scoping rules, along every path
through the cell. A needed value that cannot travel (a Spark session, a lock, an open file, a
CUDA tensor, ...) is refused before launch with a :class:`~nbdist.errors.CaptureError` naming
the variable, its type, the cell line that uses it and what to do instead. The package does
not import Spark, widgets, torch or launchers: such objects are recognised by the names of
their types. docs/capture.md is the user's side of it.

One job per module, in the order a cell goes through them:

- ``_api``: :func:`capture_cell` and what it returns (:class:`Captured`);
- ``_syntax``: the cell's lines, IPython's syntax, and the code a rank cannot run (magics,
  top-level ``await``/``yield``, relative imports), with their messages;
- ``_scope``: the scope analysis: which notebook names the cell reads, needed or optional;
- ``_ship``: what travels and how: imports by name, values in one cloudpickle stream;
- ``_local``: the notebook's own modules (not installed), found and read to travel by value;
- ``_refusals``: the values that cannot travel, recognised by type, with their messages;
- ``_export``: ``--show-source`` and ``--export``.
"""

from __future__ import annotations

from nbdist.capture._api import Captured, call_code, capture_cell
from nbdist.capture._ship import Import, Value
from nbdist.capture._syntax import RANK_MAGICS

__all__ = ["RANK_MAGICS", "Captured", "Import", "Value", "call_code", "capture_cell"]

# Values that pickle to more than ``%config DistMagics.large_value_mb`` (``nbdist.settings``)
# make capture warn (``CaptureWarning``): every rank receives a copy at start-up;
# ``capture_cell(warn_bytes=...)`` per call.

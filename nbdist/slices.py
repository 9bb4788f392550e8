"""``%dist_scatter`` and ``%dist_gather``: a notebook value cut into one slice per rank, and the
ranks' slices joined again in rank order.

Rank ``r`` of ``N`` gets items ``[r * n // N, (r + 1) * n // N)`` (the arithmetic of
``nbdist.shard``: slices that differ by at most one item). Lists, tuples, numpy arrays, torch
tensors (along their first dimension; a slice is copied, since pickling a view would send the
whole tensor's storage) and pandas DataFrames and Series (by row) can be cut and joined. The
types are recognised by name: nothing is imported to ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: What ``split`` cuts, by the value's type: (module root, type name) → how it is called.
SPLITTABLE = {
    ("builtins", "list"): "a list", ("builtins", "tuple"): "a tuple",
    ("numpy", "ndarray"): "a numpy array", ("torch", "Tensor"): "a torch tensor",
    ("pandas", "DataFrame"): "a pandas DataFrame", ("pandas", "Series"): "a pandas Series",
}


def kind(value: Any) -> str | None:
    """How :data:`SPLITTABLE` calls the value's type, or None if it cannot be cut."""
    for cls in type(value).__mro__:
        root = (getattr(cls, "__module__", "") or "").partition(".")[0]
        found = SPLITTABLE.get((root, cls.__name__))
        if found is not None:
            return found
    return None


def bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s items ``[start, stop)`` of ``n``."""
    return rank * n // world_size, (rank + 1) * n // world_size


def length(value: Any) -> int:
    """The number of items (rows) :func:`part` cuts from."""
    return int(value.shape[0]) if hasattr(value, "shape") else len(value)


def part(value: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s slice of ``value`` (a value :func:`kind` names), standing alone."""
    start, stop = bounds(length(value), rank, world_size)
    what = kind(value)
    if what == "a torch tensor":
        return value[start:stop].clone()
    if what in ("a pandas DataFrame", "a pandas Series"):
        return value.iloc[start:stop].copy()
    if what == "a numpy array":
        return value[start:stop].copy()
    return value[start:stop]


def join(parts: Sequence[Any]) -> tuple[Any, bool]:
    """The ranks' values in rank order joined into one, and True; or, when they are not all
    of one type that :func:`part` cuts, the list of them and False."""
    kinds = {kind(p) for p in parts}
    if len(kinds) != 1 or None in kinds or len({type(p) for p in parts}) != 1:
        return list(parts), False
    (what,) = kinds
    if what == "a list":
        return [item for p in parts for item in p], True
    if what == "a tuple":
        return tuple(item for p in parts for item in p), True
    if what == "a numpy array":
        import numpy as np

        return np.concatenate(parts), True
    if what == "a torch tensor":
        import torch

        return torch.cat(list(parts)), True
    import pandas as pd

    return pd.concat(list(parts)), True

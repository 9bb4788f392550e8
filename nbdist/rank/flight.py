"""The rank's flight recorder dump: torch's record of the collectives this rank ran.

torch keeps it when ``TORCH_FR_BUFFER_SIZE`` is above 0 (nbdist sets it in every rank:
``settings.flight_recorder``); the rank's runtime answers its supervisor's
``Frame.COLLECTIVES`` with :func:`dump` from a thread of its own, so a rank whose main thread
waits in a collective (which releases the GIL) still answers. The driver reads the dumps
(``nbdist.collectives``).
"""

from __future__ import annotations

import json
import sys

#: The largest dump sent (bytes of JSON); a larger one keeps its newest entries.
MAX_BYTES = 1 << 20


def dump() -> bytes:
    """The recorder's entries as torch's JSON (``_dump_fr_trace_json``), or ``b""`` where
    torch's distributed module was never imported, or has no recorder.

    NCCL keeps a recorder of its own (``_dump_nccl_trace_json``, on CUDA builds): its entries
    join the CPU recorder's (gloo's), so a job with both groups shows both."""
    if "torch.distributed" not in sys.modules:
        return b""  # never import torch here: a rank without it has no collectives
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception:
        return b""
    dumps = []
    # torch ≥ 2.8: private functions; the first on CPU and CUDA builds, the second with NCCL
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            dumps.append(bytes(fn()))
        except Exception:  # a recorder that failed (off, or NCCL never started): no answer
            continue
    data = _with_groups(_merge(dumps))
    if len(data) <= MAX_BYTES:
        return data
    try:
        whole = json.loads(data)
        entries = whole.get("entries") or []
        while entries and len(data) > MAX_BYTES:
            entries = entries[len(entries) // 4 or 1:]
            whole["entries"] = entries
            data = json.dumps(whole).encode()
    except (ValueError, TypeError, AttributeError, RecursionError):
        return b""
    return data


def _merge(dumps: list[bytes]) -> bytes:
    """One JSON dump of several recorders' (their entries together, oldest first)."""
    if len(dumps) <= 1:
        return dumps[0] if dumps else b""
    wholes = []
    for data in dumps:
        try:
            whole = json.loads(data)
        except (ValueError, TypeError, RecursionError):
            continue
        if isinstance(whole, dict) and isinstance(whole.get("entries", []), list):
            wholes.append(whole)
    if not wholes:
        return b""
    merged = dict(next((w for w in wholes if w.get("entries")), wholes[0]))
    merged["entries"] = sorted(
        (e for w in wholes for e in w.get("entries", [])),
        key=lambda e: e.get("time_created_ns", 0) if isinstance(e, dict) else 0)
    return json.dumps(merged).encode()


#: The key nbdist adds to the dump: each process group's name → its members' global ranks
#: (torch's own ``pg_config`` lists them for NCCL only).
GROUPS = "nbdist_groups"


def _with_groups(data: bytes) -> bytes:
    """``data`` with :data:`GROUPS` added, from ``torch.distributed``'s own bookkeeping."""
    if not data:
        return data
    try:
        from torch.distributed import distributed_c10d

        world = distributed_c10d._world
        groups = {str(name): sorted(int(r) for r in world.pg_group_ranks.get(pg, {}))
                  for pg, name in list(world.pg_names.items())}
        whole = json.loads(data)
        if not isinstance(whole, dict):
            return data
        whole[GROUPS] = {name: ranks for name, ranks in groups.items() if ranks}
        return json.dumps(whole).encode()
    except Exception:  # another torch's bookkeeping: the dump without the groups
        return data

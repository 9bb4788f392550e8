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
    torch's distributed module was never imported, or has no recorder."""
    if "torch.distributed" not in sys.modules:
        return b""  # never import torch here: a rank without it has no collectives
    try:
        from torch._C import _distributed_c10d as c10d

        # torch ≥ 2.8 (a private function, present on CPU and CUDA builds alike)
        data: bytes = c10d._dump_fr_trace_json()  # type: ignore[attr-defined]
    except Exception:  # an older torch without it, or a recorder that failed: no answer
        return b""
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

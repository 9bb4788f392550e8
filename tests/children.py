"""The table of children of a rank: notebook code in DataLoader workers, ``multiprocessing.Pool``,
``ProcessPoolExecutor`` and ``torch.multiprocessing``, for each start method.

The same code runs three ways: as a plain script (the reference: spawned children import the
script again as ``__mp_main__``, as under torchrun), and on nbdist's ranks, local and Spark,
where ``NOTEBOOK`` is an earlier cell (its class and function are shipped by value) and
``CELL`` the ``%%distributed`` cell (its own class and functions never left the rank).
Used by ``tests/test_children.py`` and ``tests/spark/test_children_spark.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

METHODS = ("fork", "spawn", "forkserver")

#: An earlier cell: a Dataset subclass and a function that reads a notebook global.
NOTEBOOK = textwrap.dedent("""\
    import torch.utils.data

    OFFSET = 100

    def square(i):
        return i * i + OFFSET

    class Squares(torch.utils.data.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return square(i)
    """)

#: The cell: a class and functions of its own, then every kind of child, per start method.
CELL = textwrap.dedent("""\
    import concurrent.futures
    import multiprocessing

    import torch.multiprocessing
    import torch.utils.data

    class Box:
        def __init__(self, v):
            self.v = v

    def boxed(i):
        return Box(square(i))

    def collate(batch):
        info = torch.utils.data.get_worker_info()
        return [info.id, [Box(int(x)) for x in batch]]

    def put(i, q):
        q.put([i, square(i), Squares(4)[i], boxed(i).v])

    def children(method):
        ctx = multiprocessing.get_context(method)
        loader = torch.utils.data.DataLoader(
            Squares(8), batch_size=2, num_workers=2, multiprocessing_context=method,
            collate_fn=collate)
        batches = [[worker, [b.v for b in boxes]] for worker, boxes in loader]
        with ctx.Pool(2) as pool:
            pooled = [b.v for b in pool.map(boxed, range(6))]
            through_lambda = pool.map(lambda i: Squares(6)[i] + 1, range(6))
            kept = all(type(b) is Box for b in pool.map(boxed, range(2)))
        with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
            executed = [b.v for b in ex.map(boxed, range(6))]
        q = ctx.SimpleQueue()
        torch.multiprocessing.start_processes(put, args=(q,), nprocs=2, start_method=method)
        spawned = sorted(q.get() for _ in range(2))
        return {"dataloader": batches, "pool": pooled, "pool_lambda": through_lambda,
                "pool_class_kept": kept, "executor": executed,
                "torch.multiprocessing": spawned}
    """)


def cell(methods: tuple[str, ...], np: int | None = 1, extra: str = "") -> str:
    """The ``%%distributed`` cell that returns ``{method: children(method)}`` as JSON."""
    head = f"%%distributed -np {np} --quiet\n" if np is not None else "%%distributed --quiet\n"
    return (head + extra + CELL + "import json\n"
            f"json.dumps({{m: children(m) for m in {list(methods)!r}}})\n")


def reference(tmp: Path, methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """What the same code gives as a plain script (``__main__`` guarded, as scripts must be)."""
    script = tmp / "children_reference.py"
    # A lambda in a script is not picklable by name: the script stands it in with a function
    # of its own (the notebook's version works because nbdist sends it by value).
    body = CELL.replace("lambda i: Squares(6)[i] + 1", "plus_one")
    script.write_text(
        NOTEBOOK + body + "\n\ndef plus_one(i):\n    return Squares(6)[i] + 1\n\n\n"
        "if __name__ == '__main__':\n    import json\n"
        f"    print(json.dumps({{m: children(m) for m in {list(methods)!r}}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBDIST")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=400, env=env, cwd=tmp)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def expected_by_hand() -> dict[str, Any]:
    """What every start method must give, worked out without running anything."""
    sq = [i * i + 100 for i in range(8)]
    return {
        "dataloader": [[k % 2, sq[2 * k:2 * k + 2]] for k in range(4)],
        "pool": sq[:6], "pool_lambda": [v + 1 for v in sq[:6]], "pool_class_kept": True,
        "executor": sq[:6],
        "torch.multiprocessing": [[i, sq[i], sq[i], sq[i]] for i in range(2)],
    }

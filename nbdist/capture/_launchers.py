"""Cell code that would start its own distributed processes on every rank: refused before launch.

PyTorch Lightning's ``Trainer(strategy="ddp_notebook")`` (and ``"ddp_fork"``) is how Lightning
trains from a notebook: the Trainer forks one process per device itself. Inside a
``%%distributed`` cell every rank is already one of the processes (nbdist set the torchrun
environment, which Lightning's ``strategy="ddp"`` uses as it is), so each rank forks a world of
its own on the same ``MASTER_PORT``: ``EADDRINUSE``, or a rank outside the world. The strategy
names are literal strings in the cell; one that comes from elsewhere is recognised in the rank's
traceback instead (``nbdist.hints``).
"""

from __future__ import annotations

import ast

from nbdist.capture._syntax import Lines
from nbdist.errors import CaptureError

#: Lightning's strategies that start the processes themselves by forking (its
#: ``_DDP_FORK_ALIASES``, with the ``find_unused_parameters`` variants).
FORKING_STRATEGIES = frozenset({
    "ddp_fork", "ddp_notebook", "ddp_fork_find_unused_parameters_false",
    "ddp_fork_find_unused_parameters_true", "ddp_notebook_find_unused_parameters_false",
    "ddp_notebook_find_unused_parameters_true",
})


def check(tree: ast.AST, lines: Lines) -> None:
    """Refuse ``strategy="ddp_notebook"`` (or another forking strategy) given to a call."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            value = kw.value
            if (kw.arg == "strategy" and isinstance(value, ast.Constant)
                    and isinstance(value.value, str) and value.value in FORKING_STRATEGIES):
                raise CaptureError(message(value.value, lines.where(kw.value.lineno)))


def message(strategy: str, where: str) -> str:
    """The refusal of a forking Lightning strategy, at ``where``."""
    plain = "ddp" + strategy.removeprefix("ddp_notebook").removeprefix("ddp_fork")
    return (
        f"{where}: strategy={strategy!r} cannot run inside %%distributed: Lightning then forks "
        f"its own processes on every rank, which collide on the rank's MASTER_PORT "
        f"(EADDRINUSE). Each rank already is one of the processes, with the torchrun "
        f"environment set: use strategy={plain!r}, with devices=N for `%%distributed -np N` "
        f"on one machine (Lightning checks devices × num_nodes against WORLD_SIZE)."
    )

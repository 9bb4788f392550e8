"""``nbdist.checkpoint_dir()``: where a rank keeps the checkpoints it resumes from.

A job that restarts (``--max-restarts``) tells its ranks one directory for all its attempts in
``NBDIST_CHECKPOINT_DIR``: the one given with ``--checkpoint-dir`` (or
``%config DistMagics.checkpoint_root``), else ``DEFAULT_ROOT`` under the notebook's working
directory, in a folder named after the notebook (or the function) and the job's run id. Under
``torchrun``, or in a job that set none, it is ``DEFAULT_ROOT/<TORCHELASTIC_RUN_ID>`` under the
working directory: the same on every rank of a host and across torchrun's restarts.

Imported on ranks: standard library only.
"""

from __future__ import annotations

import os
import re

#: The environment variable that carries the directory to the ranks.
ENV = "NBDIST_CHECKPOINT_DIR"
#: The folder under the working directory that holds the default directories.
DEFAULT_ROOT = "nbdist-checkpoints"

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def checkpoint_dir() -> str:
    """The directory this job keeps its checkpoints in, created if needed.

    The same path on every rank and every attempt of a job that restarts, so that an attempt
    resumes from what the last one saved (``TORCHELASTIC_RESTART_COUNT`` > 0). Choose a path
    every rank can reach with ``--checkpoint-dir`` (``nbdist.run(..., checkpoint_dir=...)``):
    on a cluster, shared storage (``/dbfs/...``, NFS); the default is under the working
    directory, which only ranks on the driver's machine share.

    Returns
    -------
    str
        An absolute path.
    """
    path = os.environ.get(ENV, "").strip()
    if not path:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "").strip() or "default"
        path = os.path.join(os.getcwd(), DEFAULT_ROOT, _UNSAFE.sub("_", run))
    os.makedirs(path, exist_ok=True)
    return path


def default_dir(label: str, run_id: str, root: str | None = None) -> str:
    """A job's directory when none was chosen: ``<root>/<notebook or label>-<run id>``.

    ``root`` defaults to ``DEFAULT_ROOT`` under the working directory. The notebook's name
    comes from ``JPY_SESSION_NAME``, which Jupyter sets in its kernels.
    """
    notebook = os.path.basename(os.environ.get("JPY_SESSION_NAME", "").strip())
    name = os.path.splitext(notebook)[0] or label or "job"
    base = root or os.path.join(os.getcwd(), DEFAULT_ROOT)
    return os.path.join(os.path.abspath(os.path.expanduser(base)),
                        f"{_UNSAFE.sub('_', name)}-{run_id}")

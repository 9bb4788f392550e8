"""On a rank: the notebook's own modules, shipped by value (``protocol.ShippedCode``), made
importable under their own names.

The files are written once per content under ``<tmp>/nbdist-code-<uid>/<digest>/`` (a new
directory is filled beside it and renamed into place, so ranks of one host that write it at
the same time never see half of it), and that directory goes first on ``sys.path`` and
``PYTHONPATH``: what the rank imports, a ``spawn`` child (multiprocessing passes ``sys.path``
on) and a subprocess (``PYTHONPATH``) find the notebook's version, not one the host may have
lying about. A directory is reused by every later run with the same files, and holds only
source: nothing is ever executed from it but by import.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile

from nbdist.protocol import ShippedCode


def code_root() -> str:
    """The directory under which this user's shipped code lives on this host."""
    return os.path.join(tempfile.gettempdir(), f"nbdist-code-{os.getuid()}")


def install(code: ShippedCode) -> str:
    """Write ``code``'s files (once per content) and put their directory first on the import
    path; returns the directory."""
    if not all(c in "0123456789abcdef" for c in code.digest) or not code.digest:
        raise ValueError(f"shipped code with a malformed digest {code.digest!r}")
    parent = code_root()
    target = os.path.join(parent, code.digest)
    if not os.path.isdir(target):
        os.makedirs(parent, mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".part-", dir=parent)
        try:
            for rel, data in code.files:
                path = os.path.join(tmp, *_parts(rel))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(target):  # not another rank of this host that won the rename
                raise
    if target not in sys.path:
        sys.path.insert(0, target)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = target + (os.pathsep + old if old else "")
        importlib.invalidate_caches()
    return target


def _parts(rel: str) -> list[str]:
    """The parts of a shipped file's relative path; nothing that could leave its directory."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or os.sep in p
                                             for p in parts):
        raise ValueError(f"shipped code with a bad path {rel!r}")
    return parts

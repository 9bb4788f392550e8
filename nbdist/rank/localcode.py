"""On a rank: the notebook's own modules, shipped by value (``protocol.ShippedCode``), made
importable under their own names.

The files are written once per content under ``<tmp>/nbdist-code-<uid>/<digest>/`` (a new
directory is filled beside it and renamed into place, so ranks of one host that write it at
the same time never see half of it), and that directory goes first on ``sys.path`` and
``PYTHONPATH``: what the rank imports, a ``spawn`` child (multiprocessing passes ``sys.path``
on) and a subprocess (``PYTHONPATH``) find the notebook's version, not one the host may have
lying about. A directory is reused by every later run with the same files, and holds only
source: nothing is ever executed from it but by import.

``nbdist-code-<uid>`` is a private folder (``nbdist.tmpdirs``: 0700, ours, not a link, checked
at every install): one another user made first is refused. A digest directory found there is
reused only after it is verified against the shipped files (the same files, byte for byte,
nothing else but ``__pycache__``); one that differs is moved aside and written anew, so the
ranks never import a file they were not sent.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import stat
import sys
import tempfile

from nbdist.protocol import ShippedCode, code_digest
from nbdist.tmpdirs import private_dir

#: How often a digest directory that another rank of this host replaces at the same time is
#: looked at again before giving up.
_TRIES = 5


def code_root() -> str:
    """The private directory under which this user's shipped code lives on this host, made if
    it is not there (``tmpdirs.private_dir``: refused if another user's)."""
    return private_dir(f"nbdist-code-{os.getuid()}")


def install(code: ShippedCode) -> str:
    """Write ``code``'s files (once per content; a directory found is verified first) and put
    their directory first on the import path; returns the directory."""
    if not all(c in "0123456789abcdef" for c in code.digest) or not code.digest:
        raise ValueError(f"shipped code with a malformed digest {code.digest!r}")
    expected = {"/".join(_parts(rel)): data for rel, data in code.files}
    if code_digest(code.files) != code.digest:
        raise ValueError(f"shipped code whose files do not match its digest {code.digest}")
    parent = code_root()
    target = os.path.join(parent, code.digest)
    for _ in range(_TRIES):
        if os.path.lexists(target):
            if _differs(target, expected) is None:
                break
            _discard(parent, target)
        _write(parent, target, expected)
    else:
        raise RuntimeError(f"the shipped code's directory {target} kept changing while it was "
                           f"verified: another process of this user writes in it")
    if target not in sys.path:
        sys.path.insert(0, target)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = target + (os.pathsep + old if old else "")
        importlib.invalidate_caches()
    return target


def _write(parent: str, target: str, expected: dict[str, bytes]) -> None:
    """Fill a new directory beside ``target`` and rename it into place; another rank of this
    host that won the rename is fine (its directory is verified next)."""
    tmp = tempfile.mkdtemp(prefix=".part-", dir=parent)
    try:
        for rel, data in expected.items():
            path = os.path.join(tmp, *rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.lexists(target):  # not another rank of this host that won the rename
            raise


def _discard(parent: str, target: str) -> None:
    """Move a directory that failed verification out of the way (one rename: a rank of this
    host doing the same at once finds it gone), then remove it."""
    aside = tempfile.mkdtemp(prefix=".bad-", dir=parent)
    try:
        os.rename(target, os.path.join(aside, "old"))
    except FileNotFoundError:
        pass  # another rank moved it first
    shutil.rmtree(aside, ignore_errors=True)


def _differs(target: str, expected: dict[str, bytes]) -> str | None:
    """What makes the directory ``target`` not exactly ``expected`` (relative path →
    content), or None: only those files, byte for byte, no links, and besides them only
    ``__pycache__`` folders of ``.pyc`` files (what importing them writes)."""
    if not stat.S_ISDIR(os.lstat(target).st_mode):
        return f"{target} is not a directory"
    found: set[str] = set()
    for folder, dirs, names in os.walk(target):
        rel_folder = os.path.relpath(folder, target)
        prefix = "" if rel_folder == "." else rel_folder.replace(os.sep, "/") + "/"
        for name in dirs:
            if os.path.islink(os.path.join(folder, name)):
                return f"{prefix}{name} is a link"
        cache = os.path.basename(folder) == "__pycache__"
        for name in names:
            path = os.path.join(folder, name)
            rel = prefix + name
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                return f"{rel} is not a regular file"
            if cache and name.endswith(".pyc"):
                continue
            data = expected.get(rel)
            if data is None:
                return f"{rel} was not shipped"
            if st.st_size != len(data) or _read(path) != data:
                return f"{rel} differs from the shipped file"
            found.add(rel)
    missing = sorted(set(expected) - found)
    return f"{missing[0]} is missing" if missing else None


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with contextlib.closing(os.fdopen(fd, "rb")) as f:
        return f.read()


def _parts(rel: str) -> list[str]:
    """The parts of a shipped file's relative path; nothing that could leave its directory."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or os.sep in p
                                             for p in parts):
        raise ValueError(f"shipped code with a bad path {rel!r}")
    return parts

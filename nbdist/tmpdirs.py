"""Folders of this user under a shared temporary folder (``$TMPDIR``, ``/tmp``): private, checked.

Another local user can create a name in ``/tmp`` before us, or swap what is there for a link.
Every folder nbdist keeps there (the executor zygotes' sockets, the shipped notebook modules,
the default log folders) is therefore made with :func:`private_dir`: per user (the uid in its
name), created mode 0700, and checked with ``os.lstat`` (:func:`check_private`) each time it is
used: a directory, not a symbolic link, owned by this user, mode 0700. One that fails is never
used: :class:`NotPrivateError` names it and what is wrong, and the fix (remove it).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

#: The mode every private folder is made with and must still have.
MODE = 0o700


class NotPrivateError(PermissionError):
    """A folder under a shared temporary folder that is not this user's private one."""


def check_private(path: str) -> None:
    """Raise :class:`NotPrivateError` unless ``path`` itself (not where a link points) is a
    directory owned by this user with mode 0700."""
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif stat.S_IMODE(st.st_mode) != MODE:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}, not {MODE:04o}"
    if problem is not None:
        raise NotPrivateError(
            f"{path} {problem}: nbdist keeps its files under the shared temporary folder only "
            f"in a private folder of this user, and does not use this one (another user may "
            f"control it). Remove it (or set TMPDIR to a folder of your own) and run again.")


def private_dir(name: str, base: str | None = None) -> str:
    """``<base>/<name>`` (``base``: the temporary folder), made mode 0700 if it is not there,
    checked (:func:`check_private`) either way; returns its path.

    ``name`` should hold the uid (``nbdist-code-1000``): one user's folder is never another's.
    """
    path = os.path.join(base or tempfile.gettempdir(), name)
    try:
        os.mkdir(path, MODE)
    except FileExistsError:
        pass
    else:
        # A umask may have taken bits away; the sticky temporary folder keeps others from
        # replacing what we just made before this.
        with contextlib.suppress(OSError):
            os.chmod(path, MODE)
    check_private(path)
    return path

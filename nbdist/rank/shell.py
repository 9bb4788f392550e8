"""``get_ipython()`` on a rank: ``!cmd``, ``x = !cmd`` and ``%pip`` through a shell.

Standard library only, imported inside its methods: ``%%distributed --export`` copies the class
into the scripts it writes (``capture/_export.py``).
"""

from __future__ import annotations

from typing import Any


class RankShell:
    """Stands in for ``get_ipython()`` on a rank: ``!cmd``, ``x = !cmd`` and ``%pip`` run
    there through a shell, with ``{expression}`` and ``$name`` expanded from the cell's
    variables as IPython does. ``%%distributed --export`` copies this class into the scripts it
    writes, so it uses only the standard library, imported inside its methods."""

    def __init__(self, ns: dict[str, Any] | None = None) -> None:
        self.ns = ns if ns is not None else {}

    @staticmethod
    def _expand(cmd: str, depth: int) -> str:
        import re
        import string
        import sys

        class Evaluating(string.Formatter):
            def get_field(self, field: str, args: Any, kwargs: Any) -> tuple[Any, str]:
                return eval(field, kwargs), field  # ``{x + 1}``, as IPython allows

        frame = sys._getframe(depth + 1)
        names = {**frame.f_globals, **frame.f_locals}
        try:
            cmd = Evaluating().vformat(cmd, (), names)
        except Exception:  # like IPython: a command that does not expand runs as written
            return cmd
        return re.sub(r"\$(\w+)", lambda m: str(names.get(m.group(1), m.group(0))), cmd)

    def _run(self, cmd: str, capture: bool) -> Any:
        import subprocess
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        if capture:  # as IPython's getoutput: stdout and stderr, split into lines
            out = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True).stdout
            return out.splitlines()
        self.ns["_exit_code"] = subprocess.call(cmd, shell=True)
        return None

    def system(self, cmd: str) -> None:
        self._run(self._expand(cmd, 1), capture=False)

    def getoutput(self, cmd: str, split: bool = True) -> Any:
        lines = self._run(self._expand(cmd, 1), capture=True)
        return lines if split else "\n".join(lines)

    def run_line_magic(self, name: str, line: str = "", _stack_depth: int = 1) -> Any:
        import shlex
        import sys

        line = self._expand(line, 1)
        if name == "pip":
            return self._run(f"{shlex.quote(sys.executable)} -m pip {line}", capture=False)
        if name in ("sx", "system"):
            return self._run(line, capture=True)
        if name == "matplotlib":
            # A rank draws with nbdist's backend (``nbdist.rank.rich``) whatever it asks: its
            # figures reach the notebook as inline ones do.
            return None
        raise RuntimeError(
            f"%{name} is an IPython magic and cannot run on a rank; run it in a normal cell"
        )

    def run_cell_magic(self, name: str, *args: object, **kw: object) -> None:
        raise RuntimeError(
            f"%%{name} is an IPython cell magic and cannot run on a rank; run it in a normal cell"
        )

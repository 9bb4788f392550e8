"""Every rank's stacks, folded: ``ranks 0–2, 4–7: all_reduce ← step ← <module> (cell line 41)``.

Each rank's supervisor answers a ``stacks`` request with what ``faulthandler`` wrote for the
rank's threads (``rank/runtime.py`` registers it on ``protocol.STACKS_SIGNAL``; the C handler
answers also while the rank is stuck in C code). This module turns those texts into groups of
ranks with the same stacks: nbdist's own frames and threads are left out, frames are shown as
Python shows a traceback (most recent call last), and the cell's frames carry the cell's own
line numbers (the payload is compiled with them, ``runtime._run_cell``). Pure functions, no
I/O: ``Job.stacks`` gathers, this groups and renders.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from nbdist.collectives import Collectives, analyse
from nbdist.collectives import rank_ranges as rank_ranges  # shown with the stacks

#: ``  File "path", line 12 in func``
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ ")
#: Where this nbdist is installed. nbdist's own frames are the files under the folder it is
#: installed in, known by that place and never by a folder's name (a user's package, or a clone
#: of this repository, may well sit in a folder named ``nbdist``). A rank's host may have it
#: elsewhere: its supervisor says where (``StacksEvent.package``).
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: Modules a thread of nbdist's waits in; a thread with nothing else is nbdist's own.
_PLUMBING = re.compile(r"[/\\](?:threading|queue|selectors|socket|subprocess)\.py$")
#: Where the rank's code runs: the thread whose bottom frames are these is the cell's.
_RUNTIME_ENTRY = ("_serve", "main")
SUMMARY_FRAMES = 3
#: Lines of one rank's native frames (py-spy) shown with its group.
NATIVE_LINES = 40


class StackFrame(NamedTuple):
    file: str
    line: int
    func: str

    @property
    def in_cell(self) -> bool:
        return self.file.startswith("<cell")

    def where(self) -> str:
        return f"cell line {self.line}" if self.in_cell else f"{self.file}:{self.line}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's Python frames, outermost first; ``cell``: the thread that runs the cell."""

    frames: tuple[StackFrame, ...]
    cell: bool = False

    def summary(self) -> str:
        """``all_reduce ← step ← <module> (cell line 41)``: the innermost calls, and where in
        the cell (or the innermost file and line) the thread is."""
        if not self.frames:
            return "no Python frame (in C code, or between cells)" if self.cell else "no frame"
        inner = list(reversed(self.frames))
        calls = " ← ".join(f.func for f in inner[:SUMMARY_FRAMES])
        if len(inner) > SUMMARY_FRAMES:
            calls += " ← …"
        at = next((f for f in inner if f.in_cell), inner[0])
        return f"{calls} ({at.where()})"


def _under(file: str, package: str) -> bool:
    """Is ``file`` (a path on the rank's host, either separator) inside folder ``package``?"""
    root = package.rstrip("/\\")
    return bool(root) and file.startswith(root) and file[len(root):len(root) + 1] in ("/", "\\")


def parse(text: str, package: str = PACKAGE_DIR) -> list[ThreadStack]:
    """``faulthandler``'s text for all threads → each thread's frames, nbdist's (the files
    under ``package``, where nbdist is installed on the rank's host) left out.

    A thread made only of nbdist's frames and the standard library's waiting (its channel,
    its output pacer) is not the user's and is dropped; the cell's thread keeps the frames
    above nbdist's runtime.
    """
    threads: list[list[StackFrame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
            continue
        hit = _FRAME.match(line)
        if hit and threads:
            threads[-1].append(StackFrame(hit["file"], int(hit["line"]), hit["func"]))
    out: list[ThreadStack] = []
    for frames in threads:
        ours = [f for f in frames if f.file == "<string>" or _under(f.file, package)]
        cell = any(f.func in _RUNTIME_ENTRY and f.file.endswith("runtime.py") for f in ours)
        kept = [f for f in frames if f not in ours]
        if ours and not cell and all(_PLUMBING.search(f.file) for f in kept):
            continue  # one of nbdist's own threads
        if cell and all(_PLUMBING.search(f.file) for f in kept):
            kept = []  # the runtime waiting for its next payload (a session between cells)
        out.append(ThreadStack(tuple(reversed(kept)), cell))
    # The cell's thread first, the others in a fixed order: equal ranks then compare equal.
    return sorted(out, key=lambda t: (not t.cell, t.frames))


@dataclass
class StackGroup:
    """Ranks whose threads have the same stacks."""

    ranks: list[int]
    threads: tuple[ThreadStack, ...]

    def summary(self) -> str:
        cell = next((t for t in self.threads if t.cell), None)
        if cell is not None:
            return cell.summary()
        return self.threads[0].summary() if self.threads else "no Python thread"


def group(dumps: Mapping[int, str],
          packages: Mapping[int, str] | None = None) -> list[StackGroup]:
    """Fold the ranks' dumps into groups of equal stacks, the most common group first.
    ``packages``: where nbdist is installed on each rank's host (this process's place for a
    rank left out)."""
    by_key: dict[tuple[ThreadStack, ...], list[int]] = {}
    for rank in sorted(dumps):
        package = (packages or {}).get(rank) or PACKAGE_DIR
        by_key.setdefault(tuple(parse(dumps[rank], package)), []).append(rank)
    groups = [StackGroup(ranks, key) for key, ranks in by_key.items()]
    return sorted(groups, key=lambda g: (-len(g.ranks), g.ranks[0]))


def _where(g: StackGroup) -> str:
    """Where a group's cell thread is: ``cell line 41``, ``train.py:41``; "" if unknown."""
    cell = next((t for t in g.threads if t.cell), None)
    if cell is None or not cell.frames:
        return ""
    inner = list(reversed(cell.frames))
    at = next((f for f in inner if f.in_cell), inner[0])
    return at.where() if at.in_cell else f"{os.path.basename(at.file)}:{at.line}"


@dataclass
class Stacks:
    """Every live rank's stacks, grouped (``%dist_stacks``, and a failed job's forensics)."""

    job_id: str
    groups: list[StackGroup] = field(default_factory=list)
    #: Ranks asked that gave no stacks: why, and their last lines.
    missing: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0  # how long gathering took
    #: Rank → its threads with their native (C) frames, as py-spy read them, where it is
    #: installed on the rank's host (``rank.supervisor.native_stacks``).
    native: dict[int, str] = field(default_factory=dict)
    #: Where the ranks stand in their collectives (their flight recorders lined up:
    #: ``nbdist.collectives``); empty when they ran none.
    collectives: Collectives = field(default_factory=lambda: Collectives(()))
    #: Where the ranks' raw flight recorder dumps were written, or why they were not.
    saved: str = ""

    @classmethod
    def from_dumps(cls, job_id: str, dumps: Mapping[int, str],
                   missing: Mapping[int, str] | None = None, seconds: float = 0.0,
                   native: Mapping[int, str] | None = None,
                   fr: Mapping[int, str] | None = None,
                   ranks: Iterable[int] | None = None,
                   packages: Mapping[int, str] | None = None) -> Stacks:
        """``fr``: rank → its flight recorder's dump; ``ranks``: every rank asked; ``packages``:
        where nbdist is installed on each rank's host."""
        groups = group(dumps, packages)
        where = {r: _where(g) for g in groups for r in g.ranks}
        every = sorted(set(ranks if ranks is not None else dumps) | set(missing or {}))
        coll = analyse(fr or {}, every, where) if fr else Collectives(())
        return cls(job_id, groups, dict(missing or {}), seconds, dict(native or {}), coll)

    def summary(self) -> str:
        """One line per group: ``ranks 0–2, 4–7: all_reduce ← step (cell line 41)``."""
        lines = [self.collectives.text()] if self.collectives else []
        lines += [f"{rank_ranges(g.ranks)}: {g.summary()}" for g in self.groups]
        lines += [f"rank {r}: {why.splitlines()[0] if why else 'no answer'}"
                  for r, why in sorted(self.missing.items())]
        return "\n".join(lines)

    def text(self) -> str:
        """Each group with its threads' frames (as a traceback: most recent call last), then
        the ranks that did not answer with their last lines."""
        out = [self.collectives.text()] if self.collectives else []
        if self.collectives and self.saved:
            out.append(f"  ({self.saved})")
        out.append(f"stacks of job {self.job_id} ({self.seconds:.2f} s):")
        for g in self.groups:
            out.append(f"{rank_ranges(g.ranks)}: {g.summary()}")
            for t in g.threads:
                out.append("  the cell's thread:" if t.cell else "  another thread:")
                out += [f"    File \"{f.file}\", line {f.line}, in {f.func}" for f in t.frames]
                if not t.frames:
                    out.append(f"    ({t.summary()})")
            shown = next((r for r in g.ranks if r in self.native), None)
            if shown is not None:  # one rank's stands for its group's: their stacks are equal
                out.append(f"  native frames of rank {shown} (py-spy, most recent call first):")
                lines = self.native[shown].splitlines()
                out += [f"    {line.strip()}" for line in lines[:NATIVE_LINES]]
                if len(lines) > NATIVE_LINES:
                    out.append(f"    ... {len(lines) - NATIVE_LINES} more lines")
        for r, why in sorted(self.missing.items()):
            out.append(f"rank {r}: " + why.replace("\n", "\n    "))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return f"<pre class='nbdist-stacks'>{html.escape(self.text())}</pre>"

"""Which collective, which rank: every rank's flight recorder lined up by sequence number.

torch's flight recorder (``TORCH_FR_BUFFER_SIZE`` entries, on by default in every rank:
``settings.flight_recorder``; dumped by ``rank/flight.py``) keeps each collective a process
group ran: its sequence number, op, sizes, dtypes and state. A rank's supervisor has the rank
dump it beside its stacks (``%dist_stacks``, a timeout's or cancel's forensics); this module
reads the ranks' JSON dumps and says in one line where the job stands::

    collectives: ranks 0, 2 wait in all_reduce #3 (1000 float32, gloo) since 12:03:05;
                 rank 1 never entered it (its last: all_reduce #2, completed) — rank 1 is in
                 train.py:41

and names a desync (``at #2: ranks 0, 2 call all_reduce, rank 1 calls broadcast``) and
mismatched sizes or dtypes at one sequence number. Pure functions, no I/O; a job whose ranks
ran no collective gives no line. A dump that cannot be read is left out (garbage never
raises).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The variable torch reads (``0`` turns the recorder off).
ENV = "TORCH_FR_BUFFER_SIZE"
#: The largest dump a rank sends (bytes of JSON); a larger one is cut to its newest entries.
MAX_DUMP_BYTES = 4 << 20
#: Mismatches named at most (the earliest first).
MAX_MISMATCHES = 3

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Int": "int32", "Long": "int64", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"}


def recorder_env(entries: int | None) -> dict[str, str]:
    """The environment that turns the recorder on with ``entries`` per rank (0: off)."""
    return {} if entries is None else {ENV: str(max(0, int(entries)))}


@dataclass(frozen=True)
class Call:
    """One collective of one rank, as its flight recorder kept it."""

    seq: int
    op: str  # "all_reduce"
    backend: str  # "gloo", "nccl"
    state: str  # "scheduled", "started", "completed"
    sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    created_ns: int
    group: str  # the process group's name ("0": the default group)

    @property
    def completed(self) -> bool:
        return self.state == "completed"

    def shape(self) -> str:
        """``1000 float32``, ``2×8 float32``, ``2 tensors`` — what the op moves."""
        if not self.sizes:
            return ""
        if len(self.sizes) > 1:
            return f"{len(self.sizes)} tensors of {_dtype(self.dtypes)}"
        return f"{'×'.join(map(str, self.sizes[0])) or 'scalar'} {_dtype(self.dtypes)}".strip()

    def label(self) -> str:
        return f"{self.op} #{self.seq}"


def _dtype(dtypes: Sequence[str]) -> str:
    names = sorted({_DTYPES.get(d, d.lower()) for d in dtypes})
    return "/".join(names)


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list):
        return ()
    out = []
    for s in value:
        if isinstance(s, list) and all(isinstance(n, int) for n in s):
            out.append(tuple(s))
    return tuple(out)


def parse(dump: str | bytes) -> list[Call]:
    """A rank's JSON dump (``_dump_fr_trace_json``) → its collectives, oldest first; ``[]``
    for garbage, an empty recorder or one without collectives (p2p ops are left out)."""
    try:
        data = json.loads(dump)
    except (ValueError, TypeError, RecursionError):
        return []
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return []
    calls: list[Call] = []
    for e in entries:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        seq, name = e.get("collective_seq_id"), e.get("profiling_name")
        if not isinstance(seq, int) or not isinstance(name, str) or seq <= 0:
            continue
        backend, _, op = name.rpartition(":")
        group = e.get("process_group")
        group_name = str(group[0]) if isinstance(group, list) and group else str(
            e.get("pg_id", "0"))
        dtypes = e.get("input_dtypes")
        created = e.get("time_created_ns")
        # gloo leaves its entries "scheduled" and marks them retired when they complete.
        state = "completed" if e.get("retired") is True else str(e.get("state", ""))
        calls.append(Call(
            seq=seq, op=op, backend=backend, state=state,
            sizes=_sizes(e.get("input_sizes")),
            dtypes=tuple(str(d) for d in dtypes) if isinstance(dtypes, list) else (),
            created_ns=created if isinstance(created, int) else 0, group=group_name))
    return calls


def members(dump: str | bytes) -> dict[str, tuple[int, ...]]:
    """The process groups' members (global ranks) that a rank's dump names (nbdist adds
    them: ``rank/flight.py``); ``{}`` where it names none."""
    try:
        groups = json.loads(dump).get("nbdist_groups")
    except (ValueError, TypeError, AttributeError, RecursionError):
        return {}
    if not isinstance(groups, dict):
        return {}
    return {str(g): tuple(r for r in ranks if isinstance(r, int))
            for g, ranks in groups.items() if isinstance(ranks, list)}


@dataclass(frozen=True)
class Collectives:
    """Where the ranks stand in their collectives: ``line`` says it (``""``: nothing to say)."""

    lines: tuple[str, ...]
    #: The ranks that never entered the collective the others wait in.
    missing: tuple[int, ...] = ()
    #: The sequence numbers where the ranks disagree (op, sizes or dtypes).
    desync: tuple[int, ...] = ()

    def text(self) -> str:
        if not self.lines:
            return ""
        return "collectives: " + "\n             ".join(self.lines)

    def __bool__(self) -> bool:
        return bool(self.lines)


def rank_ranges(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0–2, 4–7``."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        first, last = ordered[i], ordered[j]
        if last == first:
            spans.append(str(first))
        elif last == first + 1:
            spans.extend((str(first), str(last)))
        else:
            spans.append(f"{first}–{last}")
        i = j + 1
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


_ranks = rank_ranges


def _clock(ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ns / 1e9)) if ns > 0 else ""


def analyse(dumps: Mapping[int, str | bytes], ranks: Sequence[int] | None = None,
            where: Mapping[int, str] | None = None) -> Collectives:
    """Line the ranks' dumps up by sequence number (per process group) and say where they
    stand: the wavefront (the collective some ranks wait in), the ranks that never entered
    it, a desync (different ops at one number) and mismatched sizes or dtypes.

    ``ranks``: every rank of the job (a rank with no dump counts as one that entered
    nothing, when some other rank ran a collective); ``where``: rank → where its code is
    (``train.py:41``), said of a rank that never entered the collective.
    """
    by_rank = {r: parse(d) for r, d in dumps.items()}
    every = sorted(set(ranks if ranks is not None else by_rank) | set(by_rank))
    groups = sorted({c.group for calls in by_rank.values() for c in calls})
    member: dict[str, set[int]] = {}
    for d in dumps.values():
        for g, rs in members(d).items():
            member.setdefault(g, set()).update(rs)
    lines: list[str] = []
    missing: list[int] = []
    desync: list[int] = []
    for g in groups:
        seqs: dict[int, dict[int, Call]] = {
            r: {c.seq: c for c in calls if c.group == g} for r, calls in by_rank.items()}
        prefix = "" if len(groups) == 1 else f"group {g}: "
        bad = _mismatches(seqs)
        for seq, text in bad[:MAX_MISMATCHES]:
            lines.append(prefix + text)
            desync.append(seq)
        # A subgroup's wavefront is its members' (where a dump named them).
        wave = _wavefront({r: c for r, c in seqs.items() if r in member.get(g, every)},
                          [r for r in every if r in member.get(g, every)], where or {})
        if wave is not None:
            text, absent = wave
            lines.append(prefix + text)
            missing += absent
    return Collectives(tuple(lines), tuple(sorted(set(missing))), tuple(desync))


def _mismatches(seqs: Mapping[int, Mapping[int, Call]]) -> list[tuple[int, str]]:
    """The sequence numbers at which the ranks that recorded them disagree, in order."""
    numbers = sorted({s for calls in seqs.values() for s in calls})
    out: list[tuple[int, str]] = []
    for seq in numbers:
        here = {r: calls[seq] for r, calls in seqs.items() if seq in calls}
        if len(here) < 2:
            continue
        ops = _split(here, lambda c: c.op)
        if len(ops) > 1:
            parts = [f"{_ranks(rs)} call{'s' if len(rs) == 1 else ''} {op}" for op, rs in ops]
            out.append((seq, f"desync at #{seq}: " + ", ".join(parts)))
            continue
        shapes = _split(here, lambda c: c.shape())
        if len(shapes) > 1:
            op = next(iter(here.values())).op
            parts = [f"{_ranks(rs)} {shape or 'nothing'}" for shape, rs in shapes]
            out.append((seq, f"mismatch at {op} #{seq}: " + ", ".join(parts)))
    return out


def _split(here: Mapping[int, Call], key: Any) -> list[tuple[str, list[int]]]:
    """The ranks grouped by ``key`` of their call, the largest group first."""
    by: dict[str, list[int]] = {}
    for r in sorted(here):
        by.setdefault(key(here[r]), []).append(r)
    return sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def _describe(call: Call) -> str:
    """``all_reduce #3 (1000 float32, gloo)``."""
    what = ", ".join(x for x in (call.shape(), call.backend) if x)
    return call.label() + (f" ({what})" if what else "")


def _wavefront(seqs: Mapping[int, Mapping[int, Call]], every: Sequence[int],
               where: Mapping[int, str]) -> tuple[str, list[int]] | None:
    """The collective some ranks wait in and the ranks that never entered it, or None when
    nothing waits (every rank's last collective completed, or they all stand at one)."""
    last = {r: max(calls) for r, calls in seqs.items() if calls}
    if not last:
        return None
    # The collective the job waits in: the oldest one a rank entered and did not complete
    # (gloo marks its collectives completed too); else the newest any rank entered, when
    # not every rank entered it.
    pending = [(s, r) for r, calls in seqs.items() for s, c in calls.items()
               if not c.completed and c.state]
    top = max(last.values())
    head = min(s for s, _ in pending) if pending else top
    inside = sorted(r for r, calls in seqs.items() if head in calls)
    absent = sorted(r for r in every if last.get(r, 0) < head)
    waiting = sorted(r for r in inside if not seqs[r][head].completed)
    if not absent and not pending:
        return None  # every rank completed every collective it entered
    since = min((seqs[r][head].created_ns for r in waiting), default=0)
    if waiting:
        # Ranks at one number in different calls (a desync, a mismatch): each kind named.
        kinds = _split({r: seqs[r][head] for r in waiting}, _describe)
        parts = [f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} in {what}"
                 if i == 0 else f"{_ranks(rs)} in {what}" for i, (what, rs) in enumerate(kinds)]
        text = ", ".join(parts) + (f" since {_clock(since)}" if since else "")
    else:
        text = f"{_ranks(inside)} passed {_describe(seqs[inside[0]][head])}"
    if absent:
        text += f"; {_ranks(absent)} never entered it"
        lasts = [f"{'its' if len(absent) == 1 else f'rank {r}'} last: "
                 + (f"{seqs[r][last[r]].label()}, {seqs[r][last[r]].state or 'recorded'}"
                    if r in last else "no collective" if r in seqs
                    else "no record: it ended, or its recorder is off")
                 for r in absent]
        text += " (" + "; ".join(lasts) + ")"
        places = [f"rank {r} is in {where[r]}" for r in absent if where.get(r)]
        if places:
            text += " — " + ", ".join(places)
    return text, absent

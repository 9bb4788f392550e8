"""Where a launch's time goes: the marks of each rank, the phases between them, a Chrome trace.

A *mark* is a moment in a rank's launch, stamped with ``time.time()`` where it happens:

=============  ===========  =====================================================================
mark           clock        the moment
=============  ===========  =====================================================================
``submitted``  driver       the job was created in the notebook (one for the whole job)
``scheduled``  rank host    the rank's supervisor began: a local supervisor thread started, or
                            a Spark barrier task began on its executor
``preloaded``  rank host    local ranks: the zygote had imported the job's modules (the rank
                            is forked with them loaded); absent on Spark
``zygote``     rank host    Spark ranks: the task reached its executor's zygote and it had the
                            job's modules (connected while the rank met the others); absent when
                            the rank started fresh
``world``      rank host    the rendezvous answer (the world: peers, ports) arrived
``forked``     rank host    Spark ranks: the executor's zygote forked the rank
``spawned``    rank host    the rank's interpreter was obtained: forked from the zygote, taken
                            warm from the pool, or started fresh (``Popen`` returned)
``ready``      rank host    the interpreter runs nbdist's rank runtime (a warm one: when it
                            started, so this may come before ``world``)
``imports``    rank host    the cell was unpickled and its imports done: the user's code starts
``output``     rank host    the first output of the rank reached its supervisor
``end``        rank host    the user's code returned or raised
``result``     rank host    the supervisor holds the rank's pickled value (or its error)
``exit``       rank host    the rank's process exited
``delivered``  driver       the driver has the rank's outcome (Spark: all ranks' at once, when
                            the barrier stage's ``collect`` returns)
=============  ===========  =====================================================================

Marks of the rank's host and of the driver come from different clocks: on one machine they
agree, across hosts they differ by the hosts' clock skew (NTP keeps it to milliseconds; a host
without it can be seconds off). Each rank's marks are consistent among themselves.

A *phase* is the time between a mark and the one before it, named after what the rank waited
for (``PHASES``): the rank's marks sorted by time, so that a warm interpreter ready before the
rendezvous shows as such, with the driver's ``submitted`` first and ``delivered`` last (clamped
so that skew never makes a phase negative). Phases of a rank never overlap, and together they
cover its launch from ``submitted`` to ``delivered``: the critical path, not a profile.

Standard library only: the rank side imports the mark names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SUBMITTED = "submitted"
SCHEDULED = "scheduled"
PRELOADED = "preloaded"
ZYGOTE = "zygote"
WORLD = "world"
FORKED = "forked"
SPAWNED = "spawned"
READY = "ready"
IMPORTS = "imports"
OUTPUT = "output"
END = "end"
RESULT = "result"
EXIT = "exit"
DELIVERED = "delivered"

#: Every mark, in the order of a fresh launch (ties in time are broken by it).
MARKS = (SUBMITTED, SCHEDULED, PRELOADED, ZYGOTE, WORLD, FORKED, SPAWNED, READY, IMPORTS,
         OUTPUT, END, RESULT, EXIT, DELIVERED)
_ORDER = {m: i for i, m in enumerate(MARKS)}

#: The phase that ends at each mark: what the rank was waiting for until then.
PHASES = {
    SCHEDULED: "schedule",       # the backend started the rank's supervisor (Spark: its task)
    PRELOADED: "zygote imports",  # the zygote imported the job's modules
    ZYGOTE: "executor zygote",   # Spark: connect to the executor's zygote, its imports
    WORLD: "rendezvous",         # every rank said hello; the driver planned the world
    FORKED: "fork from executor zygote",  # Spark: the executor's zygote forked the rank
    SPAWNED: "spawn",            # fork / warm pool / Popen
    READY: "interpreter",        # Python started and imported nbdist's runtime
    IMPORTS: "imports",          # the cell unpickled, its imports done
    OUTPUT: "first output",      # the user's code until it printed
    END: "cell",                 # the user's code (after its first output, if any)
    RESULT: "result",            # the value pickled and sent to the supervisor
    EXIT: "exit",                # the rank's process ended
    DELIVERED: "deliver",        # the outcome reached the driver
}


@dataclass(frozen=True)
class Phase:
    """One phase of one rank: ``name`` from ``start`` to ``end`` (``time.time()`` seconds)."""

    rank: int
    name: str
    start: float
    end: float
    mark: str  # the mark that ends it

    @property
    def duration(self) -> float:
        return self.end - self.start


def clean(marks: Mapping[str, Any]) -> dict[str, float]:
    """The known marks with numeric times (what arrives on the wire is not trusted)."""
    return {k: float(v) for k, v in marks.items()
            if k in _ORDER and isinstance(v, (int, float)) and not isinstance(v, bool)}


def phases(rank: int, marks: Mapping[str, float]) -> list[Phase]:
    """The rank's phases, in order (see the module docstring); empty without two marks."""
    spawned, ready, world = marks.get(SPAWNED), marks.get(READY), marks.get(WORLD)
    if spawned is not None and ready is not None and ready < spawned \
            and (world is None or world <= ready):
        # A rank forked after the rendezvous runs (and stamps ``ready``) before its supervisor
        # hears the fork's pid and stamps ``spawned``: the fork is when the interpreter was
        # obtained. (A warm interpreter, ready before the rendezvous, keeps its order.)
        marks = {**marks, SPAWNED: ready}
    for before, after in ((OUTPUT, END), (RESULT, EXIT)):
        # The rank printed before its code ended and sent its value before it exited, but the
        # supervisor stamps what it reads when it reads it, in threads of their own: a batch
        # of output emitted after the rank's own end stamp, or the process seen gone before
        # its value was read (a fresh clone on a fast machine saw "exit" before "result").
        if before in marks and after in marks and marks[before] > marks[after]:
            marks = {**marks, before: marks[after]}
    host = sorted(((t, _ORDER[m], m) for m, t in marks.items()
                   if m not in (SUBMITTED, DELIVERED)))
    seq = [(t, m) for t, _, m in host]
    if SUBMITTED in marks:
        seq.insert(0, (marks[SUBMITTED], SUBMITTED))
    if DELIVERED in marks:
        seq.append((marks[DELIVERED], DELIVERED))
    out: list[Phase] = []
    if not seq:
        return out
    prev = seq[0][0]
    for t, m in seq[1:]:
        t = max(t, prev)  # clock skew between the driver and the rank's host
        out.append(Phase(rank, PHASES[m], prev, t, m))
        prev = t
    return out


def origin(marks: Iterable[Mapping[str, float]]) -> float | None:
    """The earliest mark of all ranks (the ``submitted`` of the job, usually)."""
    times = [t for m in marks for t in m.values()]
    return min(times) if times else None


def chrome_trace(ranks: Iterable[tuple[int, str, Mapping[str, float]]],
                 job: str = "") -> dict[str, Any]:
    """The launch as a Chrome trace (JSON trace event format): Perfetto, chrome://tracing.

    ``ranks``: ``(rank, host, marks)`` each. One process per host (``pid``), one thread per
    rank (``tid``, named ``rank N``), one complete event (``"ph": "X"``) per phase, in
    microseconds since the earliest mark; each mark also as an instant event (``"ph": "i"``)
    with its absolute time in ``args``.
    """
    ranks = list(ranks)
    t0 = origin(m for _, _, m in ranks) or 0.0
    hosts: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    for rank, host, marks in ranks:
        pid = hosts.get(host)
        if pid is None:
            pid = hosts[host] = len(hosts) + 1
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{host}" + (f" (job {job})" if job else "")}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": rank,
                       "args": {"sort_index": rank}})
        for p in phases(rank, marks):
            events.append({
                "ph": "X", "name": p.name, "cat": "launch", "pid": pid, "tid": rank,
                "ts": round((p.start - t0) * 1e6, 1), "dur": round(p.duration * 1e6, 1),
                "args": {"until": p.mark},
            })
        for m, t in sorted(marks.items(), key=lambda kv: (kv[1], _ORDER[kv[0]])):
            events.append({"ph": "i", "s": "t", "name": m, "cat": "mark", "pid": pid,
                           "tid": rank, "ts": round((t - t0) * 1e6, 1),
                           "args": {"time": t}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"job": job, "origin": t0,
                          "clock": "time.time() of each host; hosts may be skewed"}}

"""The output path that feeds the views: text chunks folded into lines, floods batched and
flushed, long lines cut, a stalled bar's latest count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

import nbdist
from nbdist import job as jobs
from nbdist import state
from nbdist.state import JobState
from nbdist.views.widget import Panel

from .helpers import Gate, out, run, wait_for


def test_text_chunks_fold_into_lines_partials_and_redraws() -> None:
    """Batched output splits into lines; unfinished text waits; \\r redraws only set the status."""
    job = JobState("j", "local", 1)
    job.apply(0, out("first\nsec"))
    r = job.ranks[0]
    assert [ln.text for ln in r.log] == ["first"] and r.status_line == "sec"
    job.apply(0, out("ond\r\n40%\r80%"))
    assert [ln.text for ln in r.log] == ["first", "second"] and r.status_line == "80%"
    job.apply(0, out("\rthird\n"))  # the redrawn line ends: it is logged, the status goes
    assert [ln.text for ln in r.log] == ["first", "second", "third"]
    assert r.status_line == "" and r.lines == 3
    job.apply(0, out("err line\n", s="e"))
    assert r.log[-1].stream == "e" and [ln.seq for ln in job.merged] == [1, 2, 3, 4]


def test_a_redrawn_line_is_logged_once_in_its_last_form(ip: Any, capsys: Any) -> None:
    """A rank redrawing ``\\rstep i/5`` (flushed, 0.3 s apart) then ending the line logs only
    ``step 5/5``; neither the text view nor the panel shows a stale redraw after it."""
    run(ip, "%%distributed -np 1\n"
            "import sys, time\n"
            "for i in range(1, 6):\n"
            "    sys.stdout.write(f'\\rstep {i}/5')\n"
            "    sys.stdout.flush()\n"
            "    time.sleep(0.3)  # longer than the supervisor waits to send a partial line\n"
            "print()\n")
    printed = capsys.readouterr().out
    job = jobs.get_job()
    assert job is not None and job.state.status == state.DONE
    r = job.state.ranks[0]
    assert [ln.text for ln in r.log] == ["step 5/5"] and r.status_line == ""
    steps = [line for line in printed.splitlines() if "step" in line]
    assert steps[-1] == "[rank 0] step 5/5", printed  # the text view: nothing stale after it
    assert all(line.count("step") == 1 for line in steps), printed
    panel = Panel(job.state)
    assert "step 5/5" in panel.panes[0].value and "step 4/5" not in panel.panes[0].value
    assert "step 5/5" in panel.rows[0].info.value


@pytest.mark.timeout(120)
def test_a_flood_arrives_whole_in_order_and_in_few_events(gate: Gate) -> None:
    """Two ranks printing 50,000 lines each as fast as they can: every line, in order, batched."""

    def flood(gate: Gate) -> int:
        gate.wait()
        for i in range(50_000):
            print("line", i)
        return 0

    job = nbdist.run(flood, gate, np=2)
    events_seen: list[int] = []
    apply = job.state.apply

    def counting(rank: int, event: Mapping[str, Any]) -> None:
        if event.get("t") == "out":
            events_seen.append(rank)
        apply(rank, event)

    job.state.apply = counting  # type: ignore[method-assign]
    wait_for(lambda: job.state.status == state.RUNNING, 60, "the ranks to run")
    gate.open()
    assert job.results == [0, 0]
    for r in job.state.ranks:  # the job ended only after the last lines were read
        assert r.lines == 50_000 and r.last_line == "line 49999"
        texts = [ln.text for ln in r.log]
        assert texts == [f"line {i}" for i in range(50_000 - len(texts), 50_000)]
    assert len(events_seen) < 100_000 / 20


@pytest.mark.timeout(120)
def test_a_flood_is_flushed_while_the_rank_still_runs(gate: Gate) -> None:
    """A rank that floods, then waits, has its whole flood shown without ending or flushing."""

    def flood_then_wait(gate: Gate) -> int:
        for i in range(100_000):
            print("line", i)
        gate.wait()
        return 0

    job = nbdist.run(flood_then_wait, gate, np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.lines == 100_000, 60, "the flood, while the rank waits")
        assert r.last_line == "line 99999" and not job.done()
    finally:
        gate.open()
    assert job.results == [0]


@pytest.mark.timeout(120)
def test_the_line_printed_before_a_crash_is_kept_after_a_flood() -> None:
    """Once a flood is over, a rank writes each line at once: the one before a SIGKILL is kept."""

    def flood_then_crash() -> None:
        import os
        import signal
        import sys
        import time

        for i in range(100_000):
            print("line", i)
        while not sys.stdout.line_buffering:  # the flood is over: lines are written at once
            time.sleep(0.01)
        print("last words")
        os.kill(os.getpid(), signal.SIGKILL)

    job = nbdist.run(flood_then_crash, np=1)
    with pytest.raises(nbdist.DistributedError) as info:
        job.result(timeout=100)
    assert "killed by SIGKILL" in info.value.failures[0]
    assert info.value.failures[0].rstrip().endswith("last words")
    assert job.state.ranks[0].last_line == "last words" and job.state.ranks[0].lines == 100_001


def test_long_lines_are_cut_and_unfinished_lines_show_up(gate: Gate) -> None:
    """An overlong line is cut with a note however it is written; a prompt shows up unfinished."""

    def talk(gate: Gate) -> None:
        import sys

        print("x" * 100_000)  # in one write
        for _ in range(10):  # in ten flushed pieces
            sys.stdout.write("y" * 10_000)
            sys.stdout.flush()
        print()
        sys.stdout.write("Epoch 1: ")
        sys.stdout.flush()
        gate.wait()
        print("ok")

    job = nbdist.run(talk, gate, np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.status_line == "Epoch 1: ", 60, "the unfinished line")
    finally:
        gate.open()
    job.result(timeout=60)
    keep = 16 * 1024
    assert [ln.text for ln in r.log] == [
        "x" * keep + f" [... {100_000 - keep} characters cut]",
        "y" * keep + f" [... {100_000 - keep} characters cut]",
        "Epoch 1: ok",
    ]


@pytest.mark.timeout(120)
def test_a_bar_that_stalls_shows_its_latest_count(gate: Gate) -> None:
    """Updates skipped by the rate limit are sent later, so a stalled loop shows its true count."""

    def stall(gate: Gate) -> None:
        import nbdist

        for i in nbdist.progress(range(1000), desc="fast"):
            if i == 537:  # right after a burst of updates the rate limit skipped
                gate.wait()

    job = nbdist.run(stall, gate, np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.bar is not None and r.progress[r.bar]["n"] == 537, 60,
                 "the count at the stall")
    finally:
        gate.open()
    job.result(timeout=60)
    assert r.bar is not None
    assert r.progress[r.bar]["n"] == 1000 and r.progress[r.bar]["desc"] == "fast"

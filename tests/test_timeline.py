"""The launch timeline (marks, phases, the Chrome trace, ``%dist_status JOB --timeline``) and the
resources each rank's supervisor samples, on real local ranks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist import resources, state, timeline
from nbdist.magics import parse_status
from nbdist.protocol import ResourcesEvent
from nbdist.views import status
from nbdist.views import timeline as timeline_view

from .helpers import running_job, wait_for

#: What every rank of a job that prints and returns goes through, in this order.
LAUNCH = ["schedule", "rendezvous", "spawn", "interpreter", "imports", "first output", "cell",
          "result", "exit", "deliver"]


def check_trace(trace: dict[str, Any], np: int, hosts: int = 1) -> dict[int, list[str]]:
    """Assert the trace's shape (a process per host, a thread per rank, phases back to back in
    time order); each rank's phase names."""
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert len(names) == hosts
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["pid"] in names and e["dur"] >= 0
            by_rank.setdefault(e["tid"], []).append(e)
    assert sorted(by_rank) == list(range(np))
    for xs in by_rank.values():
        for a, b in zip(xs, xs[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)  # back to back, in order (1 µs)
    return {rank: [e["name"] for e in xs] for rank, xs in by_rank.items()}


def in_order(names: list[str], wanted: list[str]) -> bool:
    """Whether ``wanted`` occurs in ``names`` in this order (others may come between)."""
    it = iter(names)
    return all(w in it for w in wanted)


@pytest.mark.timeout(10)
def test_what_the_supervisor_read_late_stays_before_what_it_caused() -> None:
    """A result read after the rank's exit was seen, and a first output emitted after the
    rank's own end stamp, keep their causal place, as zero-length phases."""
    marks = {"submitted": 100.0, "scheduled": 100.5, "world": 101.0, "spawned": 101.1,
             "ready": 101.2, "imports": 101.3, "end": 102.0, "output": 102.05,
             "exit": 102.2, "result": 102.25, "delivered": 102.3}
    ps = timeline.phases(0, marks)
    assert [p.name for p in ps] == ["schedule", "rendezvous", "spawn", "interpreter", "imports",
                                    "first output", "cell", "result", "exit", "deliver"]
    assert all(p.duration >= 0 for p in ps)
    by_name = {p.name: p for p in ps}
    assert by_name["cell"].duration == 0 and by_name["exit"].duration == 0
    assert by_name["first output"].end == 102.0 and by_name["result"].end == 102.2


@pytest.mark.timeout(10)
def test_phases_follow_the_marks_in_time_order_and_skew_never_makes_one_negative() -> None:
    """A warm interpreter ready before the rendezvous comes first, and a driver clock behind
    the rank's host gives a zero-length phase, not a negative one."""
    marks = {"submitted": 100.0, "scheduled": 100.5, "ready": 100.6, "world": 101.0,
             "spawned": 101.1, "imports": 101.3, "end": 102.0, "result": 102.1,
             "exit": 102.2, "delivered": 102.15}
    ps = timeline.phases(3, marks)
    assert [p.name for p in ps] == ["schedule", "interpreter", "rendezvous", "spawn", "imports",
                                    "cell", "result", "exit", "deliver"]
    assert all(p.duration >= 0 and p.rank == 3 for p in ps)
    assert ps[-1].duration == 0.0 and ps[0].start == 100.0 and ps[-1].end == 102.2
    assert all(a.end == b.start for a, b in zip(ps, ps[1:], strict=False))
    assert timeline.clean({"world": 1, "bogus": 2.0, "end": "x", "exit": True}) == {"world": 1.0}


@pytest.mark.timeout(10)
def test_a_rank_forked_after_the_rendezvous_is_spawned_when_it_is_ready() -> None:
    """A forked rank stamps ``ready`` before its supervisor hears the fork: spawn, then the
    interpreter, never the other way round (the order a busy machine produced)."""
    marks = {"submitted": 100.0, "scheduled": 100.5, "world": 101.0, "ready": 101.2,
             "spawned": 101.25, "imports": 101.3, "end": 102.0, "result": 102.1, "exit": 102.2,
             "delivered": 102.3}
    ps = timeline.phases(0, marks)
    assert [p.name for p in ps] == ["schedule", "rendezvous", "spawn", "interpreter", "imports",
                                    "cell", "result", "exit", "deliver"]
    assert [p.duration for p in ps][3] == 0.0  # the fork and its first stamp: one moment
    assert ps[2].end == 101.2 and all(p.duration >= 0 for p in ps)


@pytest.mark.timeout(10)
def test_resources_from_the_wire_keep_only_what_has_the_right_type() -> None:
    """A ``res`` event with fields of the wrong type shows what is valid, and no GPU part
    without GPU fields."""
    r = resources.Resources.from_event(
        {"cpu": 187.4, "rss": 1.5e9, "gpus": [{"id": 0, "util": 93, "mem": 3.15e10,
                                               "total": 8.5e10}, "junk"]}, at=1.0)
    assert r.text() == "CPU 187% · RSS 1.5 GB · GPU0 93% 31.5/85.0 GB"
    bare = resources.Resources.from_event({"cpu": "lots", "rss": 812e6, "gpus": None}, at=1.0)
    assert bare.text() == "RSS 812 MB" and bare.gpus == ()


@pytest.mark.timeout(30)
def test_sampler_counts_the_cpu_and_memory_of_the_whole_process_tree() -> None:
    """A process whose child burns a core and holds 200 MB is measured with its child."""
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'b = bytearray(200 * 1024 * 1024)\\nwhile True: pass'])")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        sampler = resources.Sampler(lambda: proc.pid, (), lambda e: None)
        first = sampler.sample()
        assert "cpu" not in first  # a CPU share needs an interval
        samples: list[ResourcesEvent] = []

        def busy() -> bool:
            time.sleep(0.5)  # the interval the share is measured over
            samples.append(sampler.sample())
            # The parent only waits (0 %): any share is the child's. A core busy elsewhere
            # leaves the child less than a whole one, so the bar is low.
            return samples[-1].get("rss", 0) > 200e6 and samples[-1].get("cpu", 0) > 10

        wait_for(busy, 20, "the child's memory and CPU in a sample")
        assert "gpus" not in samples[-1]  # no devices asked for: no GPU fields
        # A device asked for: its fields where NVML has it; where NVML is not there (no
        # pynvml, or no driver), no GPU fields either, and no error.
        gpus = resources._Gpus(("0",))
        if gpus.handles:  # an NVIDIA GPU and its driver: its fields are there
            assert "gpus" in sampler.sample(gpus)
        else:
            assert "gpus" not in sampler.sample(gpus)
        gpus.close()
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):  # before it is orphaned
            child.kill()
        proc.kill()
        proc.wait()


@pytest.mark.timeout(30)
def test_memory_now_counts_the_descendants_of_the_last_sample_without_looking_for_new_ones(
) -> None:
    """``rss_now`` (a session cell's end) measures the rank and the children the last sample
    found, still running, and finds no new ones itself: those wait for the next sample."""
    holder = "b = b'x' * (100 * 1024 * 1024)\nimport time\ntime.sleep(600)"
    code = ("import subprocess, sys; "
            f"p = subprocess.Popen([sys.executable, '-c', {holder!r}]); "
            "sys.stdin.readline(); p.kill(); p.wait(); sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        sampler = resources.Sampler(lambda: proc.pid, (), lambda e: None)
        # The parent's interpreter and the child's with its 105 MB: above 112 MB once written.
        wait_for(lambda: sampler.sample().get("rss", 0) > 112e6, 20, "the child in a sample")
        assert (sampler.rss_now() or 0) > 112e6  # the child, without a new sample
        proc.stdin.write(b"\n")  # the child is killed: no longer counted
        proc.stdin.flush()
        wait_for(lambda: (sampler.rss_now() or 0) < 100e6, 20, "the child gone from rss_now")
        fresh = resources.Sampler(lambda: proc.pid, (), lambda e: None)
        assert fresh.rss_now() == pytest.approx(psutil.Process(proc.pid).memory_info().rss,
                                                rel=0.5)  # no sample yet: the rank alone
        assert resources.Sampler(lambda: None, (), lambda e: None).rss_now() is None
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
        proc.stdin.close()


@pytest.mark.timeout(30)
def test_a_sample_of_the_guardian_never_counts_the_rank_twice() -> None:
    """A sample taken while the sampled process was still the rank's guardian counted the rank
    among its children; the rank's memory after a cell then counts only the rank (and what a
    sample of the rank itself found), not its own memory plus the rank again."""
    holder = "b = b'x' * (100 * 1024 * 1024)\nimport sys\nsys.stdin.read()"
    code = ("import subprocess, sys; "  # the guardian: it waits on its one child, the rank
            f"subprocess.run([sys.executable, '-c', {holder!r}])")
    guardian = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        pid: list[int] = [guardian.pid]  # what the sampler measures: the guardian, at first
        sampler = resources.Sampler(lambda: pid[0], (), lambda e: None)
        wait_for(lambda: sampler.sample().get("rss", 0) > 112e6, 20, "the rank in a sample")
        rank = psutil.Process(guardian.pid).children()[0]
        pid[0] = rank.pid  # the rank said which process it is ("ready")
        # The tree passes 112 MB while the rank still fills its bytes, page by page.
        wait_for(lambda: rank.memory_info().rss > 100e6, 20, "the rank to hold its 100 MB")
        own = rank.memory_info().rss  # as the rank reads it after its cell
        assert (sampler.rss_with(own) or 0) < 1.5 * own  # before: own + the rank again
        sampler.sample()  # a sample of the rank itself: its children (none) count
        assert sampler.rss_with(own) == own
    finally:
        for child in psutil.Process(guardian.pid).children(recursive=True):
            child.kill()
        guardian.kill()
        guardian.wait()
        assert guardian.stdin is not None
        guardian.stdin.close()


def test_a_rank_reads_its_own_memory_as_psutil_does() -> None:
    """A session rank's own resident memory, sent with its names after a cell, is what psutil
    reads from outside (the supervisor adds the children's)."""
    from nbdist.rank import runtime

    own = runtime._own_rss()
    assert own is not None
    assert own == pytest.approx(psutil.Process().memory_info().rss, rel=0.2)


@pytest.mark.timeout(10)
def test_status_options_are_parsed_with_errors_that_name_the_fix(tmp_path: Path) -> None:
    """``%dist_status`` takes a job, ``--timeline``, ``--trace PATH`` and ``--ranks SPEC``; bad
    ones say why."""
    assert parse_status("")[:4] == (None, False, None, None)
    assert parse_status(f"j3 --timeline --trace {tmp_path}/t.json")[:4] == (
        "j3", True, f"{tmp_path}/t.json", None)
    assert parse_status("--trace=x.json j3")[:4] == ("j3", False, "x.json", None)
    assert parse_status("j3 --ranks 8-15,failed")[:4] == ("j3", False, None, "8-15,failed")
    for line, words in [("j1 --trace", "takes the path"), ("--timeline", "need a job"),
                        ("j1 --ranks", "takes the ranks"), ("--ranks all", "need a job"),
                        ("j1 --gantt", "unknown option '--gantt'"), ("j1 j2", "one job"),
                        (f"j1 --trace {tmp_path}/no/t.json", "no folder")]:
        with pytest.raises(UsageError, match=words):
            parse_status(line)


@pytest.mark.timeout(30)
def test_a_trace_is_written_only_to_a_regular_file_beside_and_renamed(tmp_path: Path) -> None:
    """``--trace PATH`` never opens nor follows PATH: a FIFO nobody reads, a folder, a device, a
    symbolic link or a file in /proc is a UsageError naming the path and why (before: the
    kernel blocked for ever, a raw OSError, the link's target overwritten); a regular file is
    replaced whole, with nothing left beside it."""
    import os

    job = running_job(2)
    fifo, folder, target, link = (tmp_path / n for n in ("fifo", "dir", "target", "link"))
    os.mkfifo(fifo)
    folder.mkdir()
    target.write_text("keep me")
    link.symlink_to(target)
    bad = [(fifo, "it is a named pipe"), (folder, "it is a folder"),
           (link, "it is a symbolic link"), (Path("/dev/null"), "it is a device")]
    for path, why in bad:
        with pytest.raises(UsageError, match=re.escape(f"--trace {path}: {why}")):
            parse_status(f"j1 --trace {path}")
        # Made so after the magic checked it: still refused, and nothing is opened.
        with pytest.raises(timeline_view.TraceTargetError, match=why):
            timeline_view.export_trace(job, str(path))
    assert target.read_text() == "keep me" and link.is_symlink()
    with pytest.raises(timeline_view.TraceTargetError, match="cannot write a file in /proc/"):
        timeline_view.export_trace(job, "/proc/self/status")
    if os.getuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(timeline_view.TraceTargetError,
                           match=re.escape(f"cannot write a file in {locked}")):
            timeline_view.export_trace(job, str(locked / "t.json"))

    path = tmp_path / "t.json"
    path.write_text("old")
    before = path.stat().st_ino
    assert timeline_view.export_trace(job, str(path)).startswith(f"wrote {path}: ")
    assert path.stat().st_ino != before, "written in place, not renamed over"
    assert json.loads(path.read_text())["otherData"]["job"] == job.id
    left = {p.name for p in tmp_path.iterdir()} - {"locked"}
    assert left == {"dir", "fifo", "link", "t.json", "target"}, "something left beside it"


def _busy(release: str) -> int:
    import os
    import time

    print(f"rank {os.environ['RANK']} starts", flush=True)
    held = bytearray(150 * 1024 * 1024)  # noqa: F841  (resident while the rank runs)
    while not os.path.exists(release):  # spin until the test has seen the samples it needs
        time.sleep(0)
    return int(os.environ["RANK"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_ranks_report_resources_and_a_timeline_whose_trace_opens(
        tmp_path: Path, ip: Any) -> None:
    """Local ranks show their CPU and memory while they run; the job's timeline has every
    phase in order per rank, as a table, bars and a valid Chrome trace."""
    release = tmp_path / "release"
    job = nbdist.run(_busy, str(release), np=2, backend="local")
    # A spinning rank's share of a loaded machine's cores may be small, but it is not nothing;
    # the ranks spin until both samples are seen, however late they come.
    try:
        wait_for(lambda: all(r.resources is not None and (r.resources.cpu or 0) > 5
                             and (r.resources.rss or 0) > 150e6 for r in job.state.ranks), 90,
                 "both ranks' CPU and memory samples")
    finally:
        release.touch()
    r0 = job.state.ranks[0]
    assert r0.resources is not None and r0.resources.gpus == ()  # no GPU here: no GPU fields
    row = status.ranks_table(job.state)
    assert "CPU " in row and "RSS " in row
    assert job.result(timeout=90) == 0

    report = timeline_view.TimelineReport(job.state)
    text = repr(report)
    assert "rank 0 |" in text and "rank 1 |" in text and "median per rank: " in text
    assert "nbdist-timeline-bar" in report._repr_html_()
    path = tmp_path / "launch.json"
    print(timeline_view.export_trace(job.state, str(path)))
    names = check_trace(json.loads(path.read_text()), np=2)
    for rank in (0, 1):
        assert in_order(names[rank], LAUNCH), names[rank]
        marks = job.state.ranks[rank].marks
        assert marks["scheduled"] < marks["world"] < marks["imports"] < marks["end"] \
            <= marks["result"] <= marks["delivered"]

    # The same through the magic.
    ip.run_line_magic("dist_status", f"{job.id} --timeline --trace {tmp_path}/magic.json")
    check_trace(json.loads((tmp_path / "magic.json").read_text()), np=2)
    (tmp_path / "dir").mkdir()
    with pytest.raises(UsageError, match="it is a folder"):
        ip.run_line_magic("dist_status", f"{job.id} --trace {tmp_path}/dir")
    assert state.DONE == job.state.status

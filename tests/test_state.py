"""The driver's job model: pure, bounded, fed by events."""

from __future__ import annotations

import pytest

from nbdist import state
from nbdist.state import JobState

from .helpers import cluster_job


def out(*segs: tuple[str, str], s: str = "o") -> dict[str, object]:
    """An output event as a supervisor sends it: segments (text, end) joined into one text."""
    return {"t": "out", "s": s, "text": "".join(text + end for text, end in segs)}


def test_lines_progress_metrics_and_states_are_folded_in() -> None:
    """Output, progress, metrics and state events land on the right rank."""
    job = JobState("j1", "local", 2)
    job.apply(1, out(("hello", "\n")))
    job.apply(1, {"t": "progress", "id": 1, "n": 5, "total": 10, "desc": "epoch"})
    job.apply(1, {"t": "metrics", "values": {"loss": 0.5}})
    job.apply(1, {"t": "state", "state": "starting", "pid": 42, "host": "h"})
    r = job.ranks[1]
    assert r.last_line == "hello" and r.progress[1]["n"] == 5 and r.metrics == {"loss": 0.5}
    assert r.status == state.STARTING and r.pid == 42 and job.status == state.RUNNING
    assert job.ranks[0].lines == 0


def test_carriage_returns_update_the_status_line_only() -> None:
    """A \\r-terminated segment is a redraw: it is shown as the status, not logged."""
    job = JobState("j", "local", 1)
    job.apply(0, out(("10%", "\r"), ("20%", "\r")))
    assert job.ranks[0].status_line == "20%" and job.ranks[0].lines == 0


def test_a_line_redrawn_in_flushed_pieces_keeps_only_its_last_form() -> None:
    """``\\rstep 1/5`` ... ``\\rstep 5/5`` flushed one by one, then a newline: one log line."""
    job = JobState("j", "local", 1)
    r = job.ranks[0]
    for i in range(1, 6):  # as the supervisor forwards them: the \r, then the unfinished text
        job.apply(0, out(("", "\r")))
        job.apply(0, out((f"step {i}/5", "")))
        assert r.status_line == f"step {i}/5" and r.lines == 0
    job.apply(0, out(("", "\n")))
    assert [ln.text for ln in r.log] == ["step 5/5"]
    assert r.status_line == ""  # no stale redraw after the final line


def test_a_redraw_on_another_stream_survives_a_line() -> None:
    """A bar redrawn on stderr stays the status while stdout prints whole lines."""
    job = JobState("j", "local", 1)
    r = job.ranks[0]
    job.apply(0, out(("", "\r"), ("50%", ""), s="e"))
    job.apply(0, {"t": "out", "s": "o", "text": "loss 0.3\n"})
    job.apply(0, out(("log", "\n")))
    assert r.status_line == "50%" and [ln.text for ln in r.log] == ["loss 0.3", "log"]
    job.apply(0, {"t": "out", "s": "e", "text": "\r100%\n"})
    assert r.status_line == "" and r.last_line == "100%"


def test_partial_lines_are_joined_and_closed_at_the_end() -> None:
    """Text flushed before its newline is shown at once and joined with what follows."""
    job = JobState("j", "local", 1)
    job.apply(0, out(("Epoch 1: ", "")))
    assert job.ranks[0].status_line == "Epoch 1: "
    job.apply(0, out(("ok", "\n"), ("tail", "")))
    assert [ln.text for ln in job.ranks[0].log] == ["Epoch 1: ok"]
    job.finish(state.DONE)
    assert [ln.text for ln in job.ranks[0].log] == ["Epoch 1: ok", "tail"]


def test_memory_is_bounded_and_drops_are_counted() -> None:
    """A flood keeps only the last lines, and says how many it no longer holds."""
    job = JobState("j", "local", 1)
    n = state.MERGED_LINES + 500
    job.apply(0, out(*[(str(i), "\n") for i in range(n)]))
    r = job.ranks[0]
    assert len(r.log) == state.LOG_LINES and r.dropped == n - state.LOG_LINES
    lines, skipped = job.lines_since(0)
    assert skipped == 500 and lines[-1].text == str(n - 1) and len(lines) == state.MERGED_LINES


def test_bad_events_are_ignored() -> None:
    """Events for unknown ranks or of unknown shape change nothing."""
    job = JobState("j", "local", 1)
    job.apply(5, out(("x", "\n")))
    job.apply(0, {"t": "out", "text": ["not a text", 1]})
    job.apply(0, {"t": "metrics", "values": "nope"})
    assert job.ranks[0].lines == 0 and job.ranks[0].metrics == {}


def test_a_write_folded_at_once_equals_its_events_folded_one_by_one() -> None:
    """``apply_many`` leaves the state as ``apply`` of each event in turn would."""
    write: list[dict[str, object]] = [
        out(("a", "\n"), ("b", "\r"), ("c", "")), {"t": "hb"},
             {"t": "progress", "id": 1, "n": 3, "total": 9, "postfix": {"acc": 0.5}},
             {"t": "metrics", "values": {"loss": 0.25}, "step": 3},
             {"t": "res", "cpu": 150.0, "rss": 2000, "peak": 3000},
             {"t": "state", "state": "running"}, out(("d", "\n"))]
    one, many = JobState("j", "local", 2), JobState("j", "local", 2)
    for event in write:
        one.apply(1, event)
    many.apply_many(1, write)
    many.apply_many(7, write)  # an unknown rank: nothing
    a, b = one.ranks[1], many.ranks[1]
    assert [ln.text for ln in b.log] == [ln.text for ln in a.log] == ["a", "cd"]
    assert (b.status_line, b.progress, b.metrics, b.peak_rss, b.status) == \
        (a.status_line, a.progress, a.metrics, a.peak_rss, a.status)
    assert b.resources is not None and b.resources.cpu == 150.0 and many.version == one.version
    assert many.series.points("loss", 1)[-1].value == 0.25 and many.ranks[0].lines == 0


def test_an_event_that_raises_keeps_no_other_event_of_its_write_out() -> None:
    """The events after one whose fold raises still land; the error is raised afterwards."""

    class Broken(dict[str, object]):
        def get(self, key: str, default: object = None) -> object:
            raise RuntimeError("a field of a type no check foresaw")

    job = JobState("j", "local", 1)
    with pytest.raises(RuntimeError, match="no check foresaw"):
        job.apply_many(0, [out(("a", "\n")), Broken(), out(("b", "\n"))])
    assert [ln.text for ln in job.ranks[0].log] == ["a", "b"]


def test_the_metrics_of_a_write_reach_the_sink_when_another_of_its_events_raises() -> None:
    """Rank 0's metrics that folded go to the metrics sink (MLflow) even when another event of
    the same write raised (before: none of the write's did), and the error is still raised."""

    class Broken(dict[str, object]):
        def get(self, key: str, default: object = None) -> object:
            raise RuntimeError("a field of a type no check foresaw")

    job = state.ElasticState("j", "local", 1, max_restarts=1)
    sunk: list[dict[str, object]] = []
    job.metrics_sink = sunk.append
    with pytest.raises(RuntimeError, match="no check foresaw"):
        job.apply_many(0, [{"t": "metrics", "values": {"loss": 0.5}}, Broken(),
                           {"t": "metrics", "values": {"loss": 0.25}}])
    assert sunk == [{"loss": 0.5}, {"loss": 0.25}]
    job.apply(0, {"t": "metrics", "values": {"acc": 1.0}})  # one at a time, as before
    assert sunk[-1] == {"acc": 1.0}


def test_every_event_and_heartbeat_marks_the_rank_as_seen() -> None:
    """last_seen moves with any event, a heartbeat included, which changes nothing else."""
    job = JobState("j", "local", 1)
    assert job.ranks[0].last_seen is None
    job.apply(0, {"t": "hb"})
    seen = job.ranks[0].last_seen
    assert seen is not None and job.ranks[0].lines == 0 and job.ranks[0].status == state.PENDING
    job.apply(0, out(("x", "\n")))
    assert job.ranks[0].last_seen is not None and job.ranks[0].last_seen >= seen


def test_a_rank_not_heard_of_for_three_heartbeats_is_silent() -> None:
    """Starting or running ranks go silent after SILENT_AFTER_S without events; others never."""
    job = JobState("j", "local", 4)
    for r in (0, 1, 2):
        job.apply(r, {"t": "state", "state": "starting", "pid": 1, "host": "h"})
    job.apply(1, {"t": "state", "state": "running"})
    job.set_rank(2, state.DONE, 0)
    later = max(r.last_seen or 0 for r in job.ranks) + state.SILENT_AFTER_S
    assert state.SILENT_AFTER_S == 3 * state.HEARTBEAT_S
    assert job.silent_ranks(now=later - 1) == []
    assert job.silent_ranks(now=later) == [0, 1]  # rank 2 ended, rank 3 never connected
    job.apply(1, {"t": "hb"})
    assert job.silent_ranks(now=later) == [0]
    assert not job.ranks[3].silent(now=later + 1000)


def test_rank_states_only_move_forward() -> None:
    """A 'starting' arriving after 'running' (sent by two threads) leaves the rank running."""
    job = JobState("j", "local", 1)
    job.apply(0, {"t": "state", "state": "running"})
    job.apply(0, {"t": "state", "state": "starting", "pid": 42, "host": "h"})
    r = job.ranks[0]
    assert r.status == state.RUNNING and r.pid == 42 and r.started is not None
    job.apply(0, {"t": "state", "state": "done", "exit": 0})
    job.apply(0, {"t": "state", "state": "running"})
    assert r.status == state.DONE and r.exit_code == 0


def test_the_summary_counts_states_spreads_progress_and_finds_the_ranks_worth_a_look() -> None:
    """64 ranks: states, the slowest/median/fastest rank, outliers, failed and silent first."""
    s = cluster_job().summary()
    assert (s.running, s.failed, s.done, s.starting) == (63, 1, 0, 0)
    assert s.silent == (50,) and s.failed_ranks == (40,)
    assert s.slowest == (5, 0.01) and s.fastest == (39, 0.89) and s.reporting == 64
    assert s.outliers == (5,)  # far behind the median; the failed rank is not "running"
    assert s.attention == (40, 50, 5)
    assert [g.name for g in s.hosts] == [f"node-{i}" for i in range(8)]
    node5 = s.hosts[5]
    assert node5.ranks == tuple(range(40, 48)) and node5.failed == 1 and node5.running == 7
    assert s.hosts[0].slowest == (5, 0.01)


def test_progress_spread_without_outliers_and_ranks_before_their_hello() -> None:
    """Ranks close together have no outliers; a rank that has not said hello is on host '?'."""
    job = JobState("j", "local", 4)
    for r in range(3):
        job.apply(r, {"t": "hello", "host": "a"})
        job.apply(r, {"t": "state", "state": "running"})
        job.apply(r, {"t": "progress", "id": 1, "n": 40 + r, "total": 100})
    s = job.summary()
    assert s.outliers == () and s.median == 0.41 and s.starting == 1
    assert [(g.name, g.ranks) for g in s.hosts] == [("a", (0, 1, 2)), ("?", (3,))]
    assert state.fraction({"n": 3, "total": None}) is None


def test_a_rank_filter_takes_ranks_ranges_states_and_hosts_and_names_what_it_cannot() -> None:
    """``select_ranks``: '3', '8-10', 'failed', 'silent', 'outliers', 'host=node-2' or
    'node-2', 'all'; a bad part raises an error that lists what would work."""
    job = cluster_job()
    assert state.select_ranks("3, 8-10", job.ranks) == [3, 8, 9, 10]
    assert state.select_ranks("failed silent outliers", job.ranks) == [5, 40, 50]
    assert state.select_ranks("host=node-2", job.ranks) == list(range(16, 24))
    assert state.select_ranks("node-7,0", job.ranks) == [0, *range(56, 64)]
    assert state.select_ranks("all", job.ranks) == state.select_ranks("", job.ranks) \
        == list(range(64))
    assert state.select_ranks("done", job.ranks) == []
    for spec, words in [("64", "ranks 0-63"), ("9-3", "ranks 0-63"),
                        ("host=node-9", "no rank runs on host 'node-9'"),
                        ("nodes", "'nodes' is not a rank, a range")]:
        with pytest.raises(ValueError, match=words):
            state.select_ranks(spec, job.ranks)

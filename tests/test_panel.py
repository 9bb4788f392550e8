"""The views: the widget panel, the text view, %dist_status / %dist_cancel and --bg.

Widgets here live in a plain IPython shell (no frontend): their values are what a frontend
would be sent, and ``Widget._send`` is counted to check that updates are coalesced. The same
panel through a real kernel and a real browser is in test_kernel_live.py and tests/browser/.
"""

from __future__ import annotations

import io
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as w
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist import events, state
from nbdist import job as jobs
from nbdist.state import JobState
from nbdist.views import status
from nbdist.views.text import TextView
from nbdist.views.widget import LOG_VIEW_LINES, Panel, _Static

from .helpers import rank_processes, run, wait_for


def out(text: str, s: str = "o") -> dict[str, object]:
    return {"t": "out", "s": s, "text": text}


def running_job(np: int = 2) -> JobState:
    job = JobState("j77", "local", np)
    for r in range(np):
        job.apply(r, {"t": "hello", "host": "node-a", "gpus": []})
        job.apply(r, {"t": "state", "state": "starting", "pid": 1000 + r, "host": "node-a"})
        job.apply(r, {"t": "state", "state": "running"})
    return job


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every widget update message sent, as (model id, state)."""
    log: list[tuple[str, dict[str, Any]]] = []
    original = w.Widget._send

    def counting(self: w.Widget, msg: dict[str, Any], buffers: Any = None) -> None:
        if msg.get("method") == "update":
            log.append((self.model_id, msg["state"]))
        original(self, msg, buffers)

    monkeypatch.setattr(w.Widget, "_send", counting)
    return log


def test_rows_show_state_progress_metrics_and_last_line() -> None:
    """Each rank's row carries its state, host, bar fraction, n/total, rate, metrics, last line."""
    job = running_job()
    job.apply(1, {"t": "progress", "id": 3, "n": 25, "total": 100, "desc": "epoch", "rate": 5.0})
    job.apply(1, {"t": "metrics", "values": {"loss": 0.123456}})
    job.apply(1, out("step 25 done\n"))
    panel = Panel(job)
    row = panel.rows[1]
    assert "rank 1" in row.label.value and "running" in row.label.value
    assert "node-a" in row.label.value
    assert row.bar.value == pytest.approx(0.25)
    assert "epoch: 25/100" in row.info.value and "5 it/s" in row.info.value
    assert "ETA 0:15" in row.info.value
    assert "loss=0.1235" in row.info.value and "step 25 done" in row.info.value
    assert panel.rows[0].bar.value == 0.0
    assert "nbdist-rank-1" in row.box._dom_classes
    assert "nbdist job j77" in panel.header.value and "2 running" in panel.header.value


def test_output_is_escaped_in_every_pane() -> None:
    """Rank output is shown as text: HTML a rank prints never reaches the page as markup."""
    job = running_job()
    job.apply(0, out("<img src=x onerror=alert(1)>\n"))
    panel = Panel(job)
    rank0, merged = panel.panes[0].value, panel.panes[-1].value
    for html_ in (rank0, merged, panel.rows[0].info.value):
        assert "<img" not in html_ and "&lt;img src=x" in html_
    assert "[0] &lt;img" in merged


def test_renders_are_coalesced_and_unchanged_state_sends_nothing(sent: list[Any]) -> None:
    """Thousands of events between two renders cost one update per widget, and none if idle."""
    job = running_job()
    panel = Panel(job)
    sent.clear()
    for i in range(5000):
        job.apply(i % 2, {"t": "progress", "id": 1, "n": i, "total": 5000})
        job.apply(i % 2, out(f"line {i}\n"))
    assert panel.render() == len(sent)  # what the flusher paces itself by
    per_widget: dict[str, int] = {}
    for model_id, _ in sent:
        per_widget[model_id] = per_widget.get(model_id, 0) + 1
    assert per_widget and max(per_widget.values()) == 1
    assert panel.rows[1].bar.value == pytest.approx(4999 / 5000)
    before, renders = len(sent), panel.renders
    panel.render()
    assert panel.renders == renders and len(sent) == before


def test_log_panes_are_bounded_and_say_what_they_leave_out() -> None:
    """A pane shows the last LOG_VIEW_LINES lines and counts the earlier ones it does not show."""
    job = running_job(1)
    job.apply(0, out("".join(f"line {i}\n" for i in range(LOG_VIEW_LINES + 50))))
    panel = Panel(job)
    pane = panel.panes[0].value
    assert "50 earlier lines not shown" in pane
    assert f"line {LOG_VIEW_LINES + 49}" in pane and "line 49\n" not in pane


def test_final_state_is_styled_and_the_static_summary_is_readable() -> None:
    """When the job ends the bars and panel show success/failure and a static summary exists."""
    job = running_job()
    job.apply(0, {"t": "progress", "id": 1, "n": 10, "total": 10})
    job.apply(1, out("Traceback: boom\n"))
    job.set_rank(0, state.DONE, 0)
    job.set_rank(1, state.FAILED, 1)
    job.finish(state.FAILED, "rank 1 of 2 failed: ValueError: boom")
    panel = Panel(job)
    panel.close()
    assert panel.rows[0].bar.bar_style == "success" and panel.rows[0].bar.value == 1.0
    assert panel.rows[1].bar.bar_style == "danger"
    assert "nbdist-final-failed" in panel.widget._dom_classes
    assert "failed ranks: 1" in panel.header.value and "ValueError: boom" in panel.header.value
    static = _Static(job)
    assert "failed ranks: 1" in static._repr_html_()
    text = repr(static)
    assert "[nbdist] job j77: failed" in text and "[rank 1] Traceback: boom" in text


def test_large_jobs_collapse_into_a_summary_with_the_ranks_worth_seeing() -> None:
    """64 ranks: a summary, rows for rank 0, failed, silent and slowest ranks, a rank picker."""
    job = running_job(64)
    for r in range(64):
        job.apply(r, {"t": "progress", "id": 1, "n": 50 + (r % 40), "total": 100})
    job.apply(5, {"t": "progress", "id": 1, "n": 1, "total": 100})
    job.apply(7, out("rank seven speaks\n"))
    job.set_rank(40, state.FAILED, 1)
    job.ranks[50].last_seen = time.time() - state.SILENT_AFTER_S - 1
    panel = Panel(job)
    assert panel.collapsed and len(panel.rows) == 16
    assert {0, 40, 50, 5} <= set(panel.shown)
    assert "64 ranks" in panel.summary.value and "median" in panel.summary.value
    assert panel.picker is not None and len(panel.panes) == 2
    panel.picker.value = 7
    assert "rank seven speaks" in panel.panes[0].value


def test_the_flusher_renders_live_and_ends_with_the_job() -> None:
    """The panel's thread picks up events as they come and stops once the job is final."""
    job = running_job()
    panel = Panel(job)
    panel.start()
    job.apply(0, {"t": "progress", "id": 1, "n": 3, "total": 4})
    wait_for(lambda: panel.rows[0].bar.value == 0.75, 10, "the bar to move")
    assert panel.running
    job.set_rank(0, state.DONE, 0)
    job.set_rank(1, state.DONE, 0)
    job.finish(state.DONE)
    wait_for(lambda: not panel.running, 10, "the flusher to end")
    assert "nbdist-final-done" in panel.widget._dom_classes
    panel.close()  # a second, explicit close changes nothing
    assert panel.widget._dom_classes.count("nbdist-final-done") == 1


def test_text_view_prints_lines_progress_and_a_summary() -> None:
    """The text view labels lines by rank, prints progress as a line, and ends with a summary."""
    job = running_job()
    buf = io.StringIO()
    view = TextView(job, buf)
    job.apply(1, out("hello from one\n"))
    job.apply(0, {"t": "progress", "id": 1, "n": 2, "total": 8, "desc": "train"})
    view.update()
    job.set_rank(0, state.DONE, 0)
    job.set_rank(1, state.FAILED, 3)
    job.finish(state.FAILED, "rank 1 failed")
    view.close()
    text = buf.getvalue()
    assert "[rank 1] hello from one" in text and "[rank 0] train: 2/8" in text
    assert text.rstrip().endswith("failed ranks: 1")


def test_status_reports_render_as_text_and_html() -> None:
    """%dist_status's reports have a plain-text form and an escaped HTML form."""
    from nbdist.launch import Capacity

    job = running_job()
    job.apply(1, out("<script>x</script>\n"))
    report = status.JobsReport([job], [("local", Capacity(2, 0, "this machine"))], rejected=3)
    text = repr(report)
    assert "j77" in text and "capacity (local): 2 ranks at once, 0 GPUs" in text
    assert "3 connections rejected" in text and "result ready" in text
    assert "<table" in report._repr_html_() and "j77" in report._repr_html_()
    ranks = status.RanksReport(job)
    assert "1001" in repr(ranks) and "<script>" in repr(ranks)
    assert "<script>" not in ranks._repr_html_() and "&lt;script&gt;" in ranks._repr_html_()


def _html_rows(markup: str) -> list[dict[str, str]]:
    """The rows of the first HTML table in ``markup``, as {column header: cell text}."""
    from html.parser import HTMLParser

    class Table(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell: list[str] | None = None

        def handle_starttag(self, tag: str, attrs: Any) -> None:
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self.cell = []

        def handle_endtag(self, tag: str) -> None:
            if tag in ("td", "th") and self.cell is not None:
                self.rows[-1].append("".join(self.cell))
                self.cell = None

        def handle_data(self, data: str) -> None:
            if self.cell is not None:
                self.cell.append(data)

    table = Table()
    table.feed(markup)
    header, *rows = table.rows
    return [dict(zip(header, row, strict=True)) for row in rows]


def test_rank_details_as_html_put_each_value_in_its_own_column() -> None:
    """%dist_status JOB as HTML: progress under "progress", log lines under "last lines"."""
    job = running_job()
    job.apply(1, {"t": "progress", "id": 1, "n": 3, "total": 8, "desc": "train"})
    job.apply(1, out("first line\nsecond line\n"))
    rows = _html_rows(status.RanksReport(job)._repr_html_())
    assert [row["rank"] for row in rows] == ["0", "1"]
    assert rows[1]["state"] == "running" and rows[1]["host"] == "node-a"
    assert rows[1]["pid"] == "1001" and rows[1]["gpu"] == "-"
    assert rows[1]["progress"] == "train: 3/8"
    assert rows[1]["last lines"] == "first line\nsecond line"
    assert rows[0]["progress"] == "" and rows[0]["last lines"] == ""


def test_silent_ranks_show_in_the_panel_the_text_view_and_status() -> None:
    """A running rank not heard of for three heartbeats is flagged everywhere, until it talks."""
    job = running_job(3)
    panel = Panel(job)
    buf = io.StringIO()
    view = TextView(job, buf)
    view.update()
    assert "silent" not in panel.rows[1].label.value
    job.ranks[1].last_seen = time.time() - state.SILENT_AFTER_S - 1  # as if time had passed
    panel.render()  # no event came: the silence alone re-renders the row
    assert "silent" in panel.rows[1].label.value and "silent since" in panel.rows[1].info.value
    assert "silent" not in panel.rows[0].label.value and "1 silent: 1" in panel.header.value
    view.update()
    assert "[rank 1] silent since" in buf.getvalue()
    jobs_text = repr(status.JobsReport([job], []))
    assert "running (1 silent)" in jobs_text
    ranks = status.RanksReport(job)
    row = next(line for line in repr(ranks).splitlines() if line.startswith("1 "))
    assert row.split()[1] == "silent" and "silent ranks: 1: nothing heard" in repr(ranks)
    assert "%dist_cancel j77" in repr(ranks) and "silent ranks: 1" in ranks._repr_html_()
    job.apply(1, {"t": "hb"})
    panel.render()
    view.update()
    assert "silent" not in panel.rows[1].label.value
    assert "[rank 1] heard from again" in buf.getvalue()
    assert "silent" not in repr(status.RanksReport(job))


# -- through the magics -------------------------------------------------------------------------
@pytest.fixture
def panel_view(ip: Any) -> Any:
    """Make %%distributed show the panel in the test shell (which has no widget frontend)."""
    ip.run_line_magic("config", "DistMagics.view = 'panel'")
    yield ip
    ip.run_line_magic("config", "DistMagics.view = 'auto'")


def test_terminal_shell_gets_the_text_view(ip: Any, capsys: Any) -> None:
    """Without a widget frontend, 'auto' chooses the text view."""
    run(ip, "%%distributed -np 2\nprint('plain text please')")
    printed = capsys.readouterr().out
    assert "[rank 0] plain text please" in printed and "live panel" not in printed


@pytest.mark.timeout(120)
def test_panel_view_runs_a_tqdm_cell_to_a_styled_end(panel_view: Any, capsys: Any) -> None:
    """With the panel chosen, a tqdm loop ends as full green bars and a static summary."""
    value = run(panel_view, "%%distributed -np 2\nfrom tqdm import tqdm\n"
                            "for i in tqdm(range(20), desc='steps'):\n    pass\n'finished'")
    assert value == "finished"
    printed = capsys.readouterr().out
    assert "live panel of job" in printed and "[rank 0]" not in printed  # not the text view
    assert "[nbdist] job" in printed and ": done in" in printed  # the static summary
    job = jobs.get_job()
    assert job is not None and job.state.state == state.DONE
    for r in job.state.ranks:
        bar = r.progress[r.bar] if r.bar is not None else None
        assert bar is not None and bar["n"] == 20 and bar["desc"] == "steps"


@pytest.mark.timeout(120)
def test_bg_returns_a_job_at_once_and_keeps_rendering(panel_view: Any, tmp_path: Path) -> None:
    """--bg returns the job while it runs; other cells run; the panel ends when the job does."""
    gate = tmp_path / "gate"
    job = run(panel_view, f"%%distributed -np 2 --bg\nimport os, time\n"
                          f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
                          f"'released'")
    assert isinstance(job, jobs.Job) and not job.done()
    assert run(panel_view, "6 * 7") == 42
    panels = [t for t in threading.enumerate() if t.name == f"nbdist-panel-{job.id}"]
    assert len(panels) == 1 and panels[0].is_alive()
    gate.touch()
    assert job.result(timeout=60) == "released"
    panels[0].join(timeout=30)
    assert not panels[0].is_alive()


@pytest.mark.timeout(120)
def test_bg_in_a_terminal_prints_from_a_thread_until_the_job_ends(ip: Any, capsys: Any) -> None:
    """--bg with the text view prints the ranks' lines and the summary from its own thread."""
    job = run(ip, "%%distributed -np 2 --bg\nprint('from the background')\n7")
    assert isinstance(job, jobs.Job)
    assert job.result(timeout=60) == 7
    views = [t for t in threading.enumerate() if t.name == f"nbdist-text-{job.id}"]
    for t in views:
        t.join(timeout=30)
    printed = capsys.readouterr().out
    assert "[rank 1] from the background" in printed
    assert f"[nbdist] job {job.id}: done" in printed


def test_bg_with_o_is_a_usage_error(ip: Any) -> None:
    """-o waits for the values, --bg does not: together they are refused with the fix."""
    with pytest.raises(UsageError, match="use the returned job's .results"):
        run(ip, "%%distributed -np 2 --bg -o values\n1")


@pytest.mark.timeout(120)
def test_dist_cancel_stops_a_background_job_and_says_who(ip: Any, capsys: Any) -> None:
    """%dist_cancel JOB stops every rank of a --bg job and names the ranks it stopped."""
    job = run(ip, "%%distributed -np 2 --bg --quiet\nimport time\nprint('up', flush=True)\n"
                  "time.sleep(600)")
    wait_for(lambda: all(r.last_line == "up" for r in job.state.ranks), 60, "both ranks up")
    capsys.readouterr()
    run(ip, f"%dist_cancel {job.id}")
    said = capsys.readouterr().out
    assert f"job {job.id} cancelled: ranks 0, 1 stopped" in said
    assert job.state.state == state.CANCELLED
    assert {r.state for r in job.state.ranks} == {state.CANCELLED}
    wait_for(lambda: not rank_processes(), 10, "the ranks to exit")
    with pytest.raises(nbdist.DistributedError, match="cancelled"):
        job.result()
    run(ip, f"%dist_cancel {job.id}")
    assert "already ended (cancelled)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no job 'j0'"):
        run(ip, "%dist_cancel j0")


@pytest.mark.timeout(120)
def test_strangers_on_the_event_channel_are_rejected_and_the_job_goes_on(
    ip: Any, tmp_path: Path, capsys: Any
) -> None:
    """Garbage and a wrong secret during a job are refused and counted; the job still succeeds."""
    gate = tmp_path / "gate"

    def wait_gate(gate: str) -> str:
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.01)
        return "fine"

    job = nbdist.run(wait_gate, str(gate), np=2)
    wait_for(lambda: job.state.state == state.RUNNING, 60, "the job to run")
    server = events.shared_server("127.0.0.1")
    before = server.rejected
    for attempt in (b"not json at all\n", None):
        with socket.create_connection(server.address, timeout=10) as sock:
            reader = sock.makefile("rb")
            nonce = __import__("json").loads(reader.readline())["nonce"]
            if attempt is None:  # a well-formed hello for this job, signed with another secret
                mac = events.sign(events.new_secret(), nonce, job.id, 0)
                attempt = events.encode({"t": "hello", "job": job.id, "rank": 0, "mac": mac})
            sock.sendall(attempt)
            assert reader.read() == b""  # the server hung up
            reader.close()
    wait_for(lambda: server.rejected == before + 2, 10, "two rejections")
    gate.touch()
    assert job.results == ["fine", "fine"]
    run(ip, "%dist_status")
    assert "connections rejected" in capsys.readouterr().out


# -- the output path that feeds the views -------------------------------------------------------
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
    assert job is not None and job.state.state == state.DONE
    r = job.state.ranks[0]
    assert [ln.text for ln in r.log] == ["step 5/5"] and r.status_line == ""
    steps = [line for line in printed.splitlines() if "step" in line]
    assert steps[-1] == "[rank 0] step 5/5", printed  # the text view: nothing stale after it
    assert all(line.count("step") == 1 for line in steps), printed
    panel = Panel(job.state)
    assert "step 5/5" in panel.panes[0].value and "step 4/5" not in panel.panes[0].value
    assert "step 5/5" in panel.rows[0].info.value


@pytest.mark.timeout(120)
def test_a_flood_arrives_whole_in_order_and_in_few_events(tmp_path: Path) -> None:
    """Two ranks printing 50,000 lines each as fast as they can: every line, in order, batched."""
    gate = tmp_path / "gate"

    def flood(gate: str) -> int:
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.01)
        for i in range(50_000):
            print("line", i)
        return 0

    job = nbdist.run(flood, str(gate), np=2)
    events_seen: list[int] = []
    apply = job.state.apply

    def counting(rank: int, event: dict[str, Any]) -> None:
        if event.get("t") == "out":
            events_seen.append(rank)
        apply(rank, event)

    job.state.apply = counting  # type: ignore[method-assign]
    wait_for(lambda: job.state.state == state.RUNNING, 60, "the ranks to run")
    gate.touch()
    assert job.results == [0, 0]
    for r in job.state.ranks:  # the job ended only after the last lines were read
        assert r.lines == 50_000 and r.last_line == "line 49999"
        texts = [ln.text for ln in r.log]
        assert texts == [f"line {i}" for i in range(50_000 - len(texts), 50_000)]
    assert len(events_seen) < 100_000 / 20


@pytest.mark.timeout(120)
def test_a_flood_is_flushed_while_the_rank_still_runs(tmp_path: Path) -> None:
    """A rank that floods, then waits, has its whole flood shown without ending or flushing."""
    gate = tmp_path / "gate"

    def flood_then_wait(gate: str) -> int:
        import os
        import time

        for i in range(100_000):
            print("line", i)
        while not os.path.exists(gate):
            time.sleep(0.01)
        return 0

    job = nbdist.run(flood_then_wait, str(gate), np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.lines == 100_000, 60, "the flood, while the rank waits")
        assert r.last_line == "line 99999" and not job.done()
    finally:
        gate.touch()
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


def test_long_lines_are_cut_and_unfinished_lines_show_up(tmp_path: Path) -> None:
    """An overlong line is cut with a note however it is written; a prompt shows up unfinished."""
    gate = tmp_path / "gate"

    def talk(gate: str) -> None:
        import os
        import sys
        import time

        print("x" * 100_000)  # in one write
        for _ in range(10):  # in ten flushed pieces
            sys.stdout.write("y" * 10_000)
            sys.stdout.flush()
        print()
        sys.stdout.write("Epoch 1: ")
        sys.stdout.flush()
        while not os.path.exists(gate):
            time.sleep(0.01)
        print("ok")

    job = nbdist.run(talk, str(gate), np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.status_line == "Epoch 1: ", 60, "the unfinished line")
    finally:
        gate.touch()
    job.result(timeout=60)
    keep = 16 * 1024
    assert [ln.text for ln in r.log] == [
        "x" * keep + f" [... {100_000 - keep} characters cut]",
        "y" * keep + f" [... {100_000 - keep} characters cut]",
        "Epoch 1: ok",
    ]


@pytest.mark.timeout(120)
def test_a_bar_that_stalls_shows_its_latest_count(tmp_path: Path) -> None:
    """Updates skipped by the rate limit are sent later, so a stalled loop shows its true count."""
    gate = tmp_path / "gate"

    def stall(gate: str) -> None:
        import os
        import time

        import nbdist

        for i in nbdist.progress(range(1000), desc="fast"):
            if i == 537:  # right after a burst of updates the rate limit skipped
                while not os.path.exists(gate):
                    time.sleep(0.01)

    job = nbdist.run(stall, str(gate), np=1)
    r = job.state.ranks[0]
    try:
        wait_for(lambda: r.bar is not None and r.progress[r.bar]["n"] == 537, 60,
                 "the count at the stall")
    finally:
        gate.touch()
    job.result(timeout=60)
    assert r.progress[r.bar]["n"] == 1000 and r.progress[r.bar]["desc"] == "fast"

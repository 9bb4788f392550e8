"""The widget panel: rows, escaping, coalesced renders, bounded panes, the final style, the
summary of a large job, the flusher thread.

Widgets here live in a plain IPython shell (no frontend): their values are what a frontend
would be sent, and ``Widget._send`` is counted to check that updates are coalesced. The same
panel through a real kernel and a real browser is in test_kernel_live.py and tests/browser/;
the panel chosen by ``%%distributed`` is in test_view_magics.py.
"""

from __future__ import annotations

import time
from typing import Any

import ipywidgets as w
import pytest

from nbdist import state
from nbdist.views.widget import LOG_VIEW_LINES, Panel, _Static, title

from .helpers import cluster_job, out, running_job, wait_for


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
    assert "CPU" not in row.info.value  # no sample yet: nothing shown
    job.apply(1, {"t": "res", "cpu": 187.5, "rss": 1_250_000_000,
                  "gpus": [{"id": "0", "util": 93, "mem": 31_500_000_000,
                            "total": 85_000_000_000}]})
    panel.render()
    row = panel.rows[1]
    assert "CPU 188% · RSS 1.2 GB · GPU0 93% 31.5/85.0 GB" in row.info.value
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
    # Idle: no row, pane or bar is sent again; only the header's elapsed time, when a second
    # went by between the two renders (a busy machine: py313's leg once).
    assert panel.renders == renders
    assert {model_id for model_id, _ in sent[before:]} <= {panel.header.model_id}


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


def test_a_large_job_groups_every_rank_by_host_closed_and_leads_with_the_ranks_worth_a_look(
) -> None:
    """64 ranks on 8 hosts: the rows start with failed, silent and lagging ranks; the host
    groups start closed, their titles carry states and progress, the final render fills each."""
    job = cluster_job()
    panel = Panel(job)
    assert panel.shown[:4] == [40, 50, 5, 0] and len(panel.shown) == 16
    assert "slowest rank 5 at 1%" in panel.summary.value
    assert "behind the rest: 5" in panel.summary.value
    assert panel.groups.selected_index is None and panel.hosts.selected_index is None
    assert len(panel.hosts.children) == 8
    assert title(panel.hosts, 5).startswith("node-5 · ranks 40-47 · 7 running, 1 failed")
    job.finish(state.FAILED, "rank 40 failed")
    panel.close()
    tables = [child.value for child in panel.hosts.children]
    assert all(t.count("<tr>") == 8 for t in tables)
    assert "rank 47" in tables[5] and "failed" in tables[5]


def test_the_rank_filter_lists_the_ranks_it_names_and_says_what_it_cannot_read() -> None:
    """Typing in the filter lists the matching ranks; a bad filter shows why, in red."""
    job = cluster_job()
    panel = Panel(job)
    panel.filter.value = "failed, node-7"
    listed = panel.filtered.value
    assert listed.count("<tr>") == 9 and "rank 40" in listed and "rank 63" in listed
    panel.filter.value = "node-99"
    assert "is not a rank" in panel.filtered.value and "#c62828" in panel.filtered.value
    panel.filter.value = ""
    assert panel.filtered.value == ""

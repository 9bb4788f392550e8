"""The text views: the rank-labelled text view, %dist_status's reports (text and HTML), and
silent ranks as the panel, the text view and %dist_status show them."""

from __future__ import annotations

import io
import time
from typing import Any

import pytest

from nbdist import state
from nbdist.views import status
from nbdist.views.text import TextView
from nbdist.views.widget import Panel

from .helpers import cluster_job, out, running_job


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


def test_status_of_a_large_job_is_a_summary_hosts_and_the_ranks_worth_a_look() -> None:
    """``%dist_status JOB`` of 64 ranks: a summary line, a row per host and 4 ranks, not a wall
    of 64 rows; ``--ranks`` lists the ranks it names (all of them with ``all``)."""
    job = cluster_job()
    text = status.ranks_table(job)
    assert "64 ranks on 8 hosts: 63 running, 1 failed (1 silent)" in text
    assert "node-7  56-63" in text and "--ranks all" in text
    listed = [line.split()[0] for line in text.split("ranks worth a look:")[1].splitlines()[2:]
              if line.split() and line.split()[0].isdigit()]
    assert listed == ["40", "50", "5", "0"]
    assert len(text.splitlines()) < 25
    every = status.ranks_table(job, "all")
    assert all(f"\n{r} " in every for r in range(64))
    assert status.ranks_table(job, "host=node-1").count("node-1 ") == 8
    html_report = status.RanksReport(job)._repr_html_()
    assert "ranks worth a look" in html_report and html_report.count("<tr>") == 1 + 8 + 1 + 4
    with pytest.raises(ValueError, match="is not a rank"):
        status.RanksReport(job, "bogus")


def test_what_a_large_job_leaves_in_the_notebook_does_not_grow_with_its_ranks() -> None:
    """From 64 to 256 ranks the static summary grows by a row per host (24 more), not per rank,
    and lists no more ranks one by one."""
    sizes = {}
    for np in (64, 256):
        job = cluster_job(np)
        job.finish(state.FAILED, "rank 40 failed")
        sizes[np] = len(status.summary_html(job)) + len(status.summary_text(job))
    assert (sizes[256] - sizes[64]) / 24 < 400, sizes


def test_the_text_view_of_a_large_job_prints_a_summary_line_not_a_line_per_rank() -> None:
    """64 ranks: one summary line and one line for the ranks that fall silent, as ranges."""
    job = cluster_job()
    buf = io.StringIO()
    view = TextView(job, buf)
    view.update()
    text = buf.getvalue()
    assert text.count("[nbdist] 64 ranks on 8 hosts") == 1
    assert "silent since now: ranks 50" in text
    assert "[rank" not in text  # no status line per rank
    view.close()


def test_the_text_view_prints_every_note_even_one_replaced_between_its_ticks() -> None:
    """An attempt of a job that restarts can start and end between two ticks of the view (a
    busy machine): its note is printed all the same; a capacity wait's countdown is printed at
    a slower pace, its newest value."""
    job = state.ElasticState("j1", "local", 2, max_restarts=1)
    buf = io.StringIO()
    view = TextView(job, buf)
    job.begin(1, "j2", "")
    view.update()
    job.set_note("waiting for 2 slots, 0 free")
    job.set_note("waiting for 2 slots, 1 free")
    job.begin(2, "j3", "attempt 1 ended: rank 1 of 2 failed")
    job.set_note("done on attempt 2 of 2")
    view.update()
    view.close()
    text = buf.getvalue()
    assert "[nbdist] attempt 1 of 2\n" in text
    assert "[nbdist] waiting for 2 slots, 0 free" in text
    assert "[nbdist] waiting for 2 slots, 1 free" not in text  # a countdown, superseded
    assert "[nbdist] attempt 2 of 2 · attempt 1 ended: rank 1 of 2 failed" in text
    assert "[nbdist] done on attempt 2 of 2" in text

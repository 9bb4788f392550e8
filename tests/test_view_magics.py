"""The views through the magics: which view %%distributed picks, --bg, %dist_cancel, and
%dist_status after strangers knocked on the event channel."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist import channel, events, state
from nbdist import job as jobs

from .helpers import Gate, rank_processes, run, wait_for


@pytest.fixture
def panel_view(ip: Any) -> Any:
    """Make %%distributed show the panel in the test shell (which has no widget frontend)."""
    ip.run_line_magic("config", "DistMagics.view = 'panel'")
    yield ip
    ip.run_line_magic("config", "DistMagics.view = 'auto'")


@pytest.mark.slow
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
    assert job is not None and job.state.status == state.DONE
    for r in job.state.ranks:
        bar = r.progress[r.bar] if r.bar is not None else None
        assert bar is not None and bar["n"] == 20 and bar["desc"] == "steps"


@pytest.mark.timeout(120)
def test_bg_returns_a_job_at_once_and_keeps_rendering(panel_view: Any, gate: Gate) -> None:
    """--bg returns the job while it runs; other cells run; the panel ends when the job does."""
    job = run(panel_view, f"%%distributed -np 2 --bg\n{gate.code()}\n'released'")
    assert isinstance(job, jobs.Job) and not job.done()
    assert run(panel_view, "6 * 7") == 42
    panels = [t for t in threading.enumerate() if t.name == f"nbdist-panel-{job.id}"]
    assert len(panels) == 1 and panels[0].is_alive()
    gate.open()
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
    assert job.state.status == state.CANCELLED
    assert {r.status for r in job.state.ranks} == {state.CANCELLED}
    wait_for(lambda: not rank_processes(), 10, "the ranks to exit")
    with pytest.raises(nbdist.DistributedError, match="cancelled"):
        job.result()
    run(ip, f"%dist_cancel {job.id}")
    assert "already ended (cancelled)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no job 'j0'"):
        run(ip, "%dist_cancel j0")


@pytest.mark.timeout(120)
def test_strangers_on_the_event_channel_are_rejected_and_the_job_goes_on(
    ip: Any, gate: Gate, capsys: Any
) -> None:
    """Garbage and a wrong secret during a job are refused and counted; the job still succeeds."""

    def wait_gate(gate: Gate) -> str:
        gate.wait()
        return "fine"

    job = nbdist.run(wait_gate, gate, np=2)
    wait_for(lambda: job.state.status == state.RUNNING, 60, "the job to run")
    server = events.shared_server("127.0.0.1")
    before = server.rejected
    for attempt in (b"not json at all\n", None):
        with socket.create_connection(server.address, timeout=10) as sock:
            reader = sock.makefile("rb")
            nonce = __import__("json").loads(reader.readline())["nonce"]
            if attempt is None:  # a well-formed hello for this job, signed with another secret
                mac = channel.sign(channel.new_secret(), nonce, job.id, 0)
                attempt = channel.encode({"t": "hello", "job": job.id, "rank": 0, "mac": mac})
            sock.sendall(attempt)
            assert reader.read() == b""  # the server hung up
            reader.close()
    wait_for(lambda: server.rejected == before + 2, 10, "two rejections")
    gate.open()
    assert job.results == ["fine", "fine"]
    run(ip, "%dist_status")
    assert "connections rejected" in capsys.readouterr().out

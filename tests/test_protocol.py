"""The launch contract travels as plain fields where nbdist may be missing (a Spark task's
closure and its rows): ``RankOutcome`` and ``LaunchRequest`` come back whole from their fields,
and the driver keeps only the fields it knows."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle

import pytest

from nbdist.protocol import Frame, FrameWriter, LaunchRequest, RankOutcome, RankStatus, read_frame
from nbdist.rank import reporting


def test_an_outcome_comes_back_whole_from_its_fields_with_the_status_as_a_word() -> None:
    """Every RankOutcome field travels, the status as its word (a str, not a RankStatus)."""
    outcome = RankOutcome(3, RankStatus.FAILED, error={"type": "E", "message": "m",
                                                       "traceback": "t"}, exit_code=-9,
                          tail=["last"], lost_host="10.0.0.4")
    fields = outcome.fields()
    assert list(fields) == [f.name for f in dataclasses.fields(RankOutcome)]
    assert type(fields["status"]) is str and fields["status"] == "failed"
    assert RankOutcome.from_fields(3, fields) == outcome


def test_the_driver_drops_fields_it_does_not_know_and_reads_the_status_word() -> None:
    """Fields of another nbdist are dropped; a status word becomes a RankStatus; the row's
    rank is the partition's, whatever the fields say."""
    sent = {"rank": 7, "status": "failed", "error": {"type": "ImportError", "message": "m",
                                                      "traceback": ""}, "from_the_future": 1}
    outcome = RankOutcome.from_fields(2, sent)
    assert outcome.rank == 2 and outcome.status is RankStatus.FAILED
    assert outcome.error == sent["error"] and outcome.tail == []
    assert RankOutcome.from_fields(3, {}).status is RankStatus.FAILED


def test_a_launch_request_is_plain_fields_that_rebuild_it() -> None:
    """A LaunchRequest's fields pickle without nbdist's classes and rebuild the request."""
    request = LaunchRequest(job_id="j1", np=2, secret="s", driver=("h", 1), payload=b"p",
                            gpu=False, env={"A": "1"}, modules=("torch",), session=True,
                            heartbeat_timeout=60.0)
    fields = request.fields()
    assert b"nbdist" not in pickle.dumps(fields)
    assert LaunchRequest(**fields) == request


def test_frames_held_go_in_one_write_and_a_fork_meanwhile_sends_them_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames sent while held reach the pipe only at release (or before a fork, so that a
    forked child, which writes each frame at once, never sends them a second time)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    out = os.fdopen(w, "wb")
    chan = FrameWriter(out)
    monkeypatch.setattr(reporting, "channel", chan)

    def send(name: str) -> None:
        chan.send(Frame.EVENT, json.dumps({"t": name}).encode())

    with os.fdopen(r, "rb") as reader:
        chan.hold()
        send("a")
        assert reader.read() is None  # nothing written yet
        send("b")
        reporting.before_fork()
        pid = os.fork()
        if pid == 0:  # the child: its frame goes at once
            try:
                reporting.after_fork_in_child()
                send("child")
            finally:
                os._exit(0)
        reporting.after_fork_in_parent()
        assert os.waitpid(pid, 0)[1] == 0
        send("c")
        chan.release()
        data = reader.read()
        out.close()
    got = []
    with io.BytesIO(data) as f:
        while (frame := read_frame(f)) is not None:
            got.append(json.loads(frame[1])["t"])
    assert got == ["a", "b", "child", "c"]


FORK_WITH_THE_SUPERVISOR_GONE = """
import os
from nbdist.protocol import FrameWriter
from nbdist.rank import reporting, runtime, streams

r, w = os.pipe()
chan = reporting.channel = FrameWriter(os.fdopen(w, "wb"))
os.close(r)  # the supervisor is gone: a write to the pipe is a broken pipe
runtime._guard_forks(streams.Pacer())
chan.hold()
chan.event({"t": "names", "names": []})  # held in the buffer
pid = os.fork()
if pid == 0:
    if not chan.lock.acquire(timeout=10):
        os._exit(3)
    chan.lock.release()
    chan.event({"t": "child"})  # to nowhere, without raising
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0, "the child's channel stayed locked"
free = chan.lock.acquire(timeout=10) and reporting.Bar._lock.acquire(timeout=10)
print("free" if free else "held")
"""


def test_a_fork_after_the_supervisor_is_gone_leaves_the_channel_unlocked() -> None:
    """A rank that forks while its frames are held and its control pipe is broken (its
    supervisor gone) drops those frames, and the fork leaves the channel's and the bars' locks
    free (before: the broken pipe skipped the fork hooks' other halves and both stayed held,
    hanging every later send)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FORK_WITH_THE_SUPERVISOR_GONE],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "free"), done.stderr
    assert "Exception ignored" not in done.stderr  # no fork hook raised

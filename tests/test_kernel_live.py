"""The panel through a real Jupyter kernel, headless: the widget messages a frontend receives.

A kernel is started with jupyter_client, runs ``%%distributed -np 2`` with a tqdm loop that
also floods its output, and the test reads IOPub like a frontend would. The ranks wait on a
gate file half-way, so "while the cell is still running" is a fact, not a race.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbdist.views.widget import RATE_HZ

from .helpers import Gate

ROOT = Path(__file__).resolve().parent.parent
STEPS = 60
GATE_AT = 30
FIRST_AT = 10


@pytest.fixture
def kernel() -> Iterator[Any]:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def execute(kc: Any, code: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Run ``code`` and return its IOPub messages up to idle; fail on an error."""
    msg_id = kc.execute(code)
    msgs = []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msgs.append(msg)
        if msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return msgs


class Frontend:
    """What a widget frontend would know: the models and every update, time-stamped."""

    def __init__(self) -> None:
        self.models: dict[str, dict[str, Any]] = {}
        self.updates: list[tuple[float, str, dict[str, Any]]] = []
        self.streams: list[str] = []
        self.idle = False

    def feed(self, msg: dict[str, Any], msg_id: str) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open":
            self.models[content["comm_id"]] = dict(content["data"]["state"])
        elif kind == "comm_msg" and content["data"].get("method") == "update":
            state = content["data"]["state"]
            self.models.setdefault(content["comm_id"], {}).update(state)
            self.updates.append((time.monotonic(), content["comm_id"], state))
        elif kind == "stream":
            self.streams.append(content["text"])
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif (kind == "status" and content["execution_state"] == "idle"
              and msg["parent_header"].get("msg_id") == msg_id):
            self.idle = True

    def bar_of_rank(self, rank: int) -> str | None:
        """The FloatProgress model of a rank's row (rows carry the class nbdist-rank-N)."""
        for model in self.models.values():
            if f"nbdist-rank-{rank}" in model.get("_dom_classes", ()):
                for child in model.get("children", ()):
                    cid = child.removeprefix("IPY_MODEL_")
                    if self.models.get(cid, {}).get("_model_name") == "FloatProgressModel":
                        return cid
        return None

    def values(self, model_id: str) -> list[float]:
        return [s["value"] for _, mid, s in self.updates if mid == model_id and "value" in s]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_widget_updates_stream_live_and_are_coalesced(kernel: Any, gate: Gate) -> None:
    """While the cell runs, each rank's bar advances in update messages, at most ~10 per second."""
    execute(kernel, "%load_ext nbdist")
    first_gate = Gate(gate.path + "-first")  # the ranks wait at step FIRST_AT, then at GATE_AT
    cell = f"""%%distributed -np 2
import os, time
from tqdm import tqdm
for step in tqdm(range({STEPS}), desc="train", mininterval=0):
    for k in range(200):
        print("step", step, "line", k)
    if step == {FIRST_AT}:
{first_gate.code("        ")}
    if step == {GATE_AT}:
{gate.code("        ")}
    time.sleep(0.02)
"done"
"""
    msg_id = kernel.execute(cell)
    fe = Frontend()
    deadline = time.monotonic() + 180

    def pump() -> None:
        try:
            msg = kernel.get_iopub_msg(timeout=1)
        except queue.Empty:
            return
        fe.feed(msg, msg_id)

    def at(step: int) -> bool:
        bars = [fe.bar_of_rank(r) for r in (0, 1)]
        return all(b is not None and max(fe.values(b), default=0) >= step / STEPS
                   for b in bars)

    # The panel shows each bar at the first gate, then (the ranks let through) at the second:
    # two values at least, however the renders fall on a slow machine.
    for step, opened in ((FIRST_AT, first_gate), (GATE_AT, None)):
        while not at(step):
            assert not fe.idle, "the cell ended before its ranks reached the gate"
            assert time.monotonic() < deadline, f"the bars never reached step {step}: " + repr(
                [fe.values(fe.bar_of_rank(r) or "") for r in (0, 1)])
            pump()
        if opened is not None:
            opened.open()
    before_gate = {r: fe.values(fe.bar_of_rank(r) or "") for r in (0, 1)}
    gate.open()
    while not fe.idle:
        assert time.monotonic() < deadline, "the cell did not end"
        pump()

    # Live: each bar moved through several values while the ranks were still working.
    for rank, seen in before_gate.items():
        assert len(set(seen)) >= 2 and seen == sorted(seen), (rank, seen)
        assert 0 < seen[-1] < 1
    for rank in (0, 1):
        bar = fe.bar_of_rank(rank) or ""
        assert fe.models[bar]["value"] == 1.0 and fe.models[bar]["bar_style"] == "success"

    # Coalesced: no widget got more than one update per flusher tick (plus the final push),
    # although the ranks sent thousands of events.
    first, last = fe.updates[0][0], fe.updates[-1][0]
    per_widget: dict[str, int] = {}
    for _, mid, _ in fe.updates:
        per_widget[mid] = per_widget.get(mid, 0) + 1
    bound = RATE_HZ * (last - first) * 1.2 + 3
    assert max(per_widget.values()) <= bound, (max(per_widget.values()), bound)
    assert not any("IOPub message rate exceeded" in s for s in fe.streams)
    shown = execute(kernel, "import json, nbdist.job\nj = nbdist.job.get_job()\n"
                            "print(json.dumps([sum(r.lines for r in j.state.ranks), "
                            "j.state.status]))")
    text = "".join(m["content"]["text"] for m in shown if m["msg_type"] == "stream")
    lines, final = json.loads(text)
    assert final == "done" and lines == 2 * (STEPS * 200)
    assert len(fe.updates) * 10 < lines  # far fewer messages than what the ranks printed

"""Rich output from the ranks in a real Jupyter kernel: HTML, PNG and matplotlib figures reach
the cell's messages (a job, a ``--bg`` job, a session cell), the text view shows their text form,
a huge image is bounded, and ``--targets`` runs a session cell on some ranks."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest

from .test_kernel_live import execute, kernel  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: A cell whose ranks each show HTML, a PNG, a figure with plt.show() and one left open (and
#: ``%matplotlib inline``, which a rank accepts).
DRAWS = """%%distributed -np -2
%matplotlib inline
import os
import matplotlib.pyplot as plt
from IPython.display import HTML, Image, display
rank = os.environ["RANK"]
display(HTML(f"<b>html from {rank}</b>"))
display(Image(data=PNG, format="png"))
plt.plot([1, 2, 3])
plt.title(f"shown by {rank}")
plt.show()
plt.figure()
plt.plot([3, 2, 1])
rank
"""

#: The smallest valid PNG (1x1, grey).
PNG_HEX = ("89504e470d0a1a0a0000000d4948445200000001000000010800000000"
           "3a7e9b550000000a49444154789c6360000000020001e221bc330000000049454e44ae426082")


def _displays(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["content"] for m in msgs if m["msg_type"] == "display_data"]


def _stdout(msgs: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


def _pane_outputs(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every output the panel's rank panes (Output widgets) were given."""
    found: list[dict[str, Any]] = []
    for m in msgs:
        if m["msg_type"] in ("comm_open", "comm_msg"):
            state = m["content"]["data"].get("state") or {}
            found += state.get("outputs") or []
    return found


def test_html_png_and_figures_reach_the_cell(kernel: Any) -> None:  # noqa: F811
    """Rank 0's HTML, PNG and both figures show below the panel; rank 1's in its pane only."""
    pytest.importorskip("matplotlib")
    execute(kernel, f"%load_ext nbdist\nPNG = bytes.fromhex({PNG_HEX!r})")
    msgs = execute(kernel, DRAWS, timeout=120)
    below = _displays(msgs)
    ranks = [d["metadata"].get("nbdist", {}).get("rank") for d in below]
    shown = [d for d, r in zip(below, ranks, strict=True) if r is not None]
    assert {r for r in ranks if r is not None} == {0}
    assert [sorted(d["data"]) for d in shown] == [
        ["text/html", "text/plain"], ["image/png", "text/plain"],
        ["image/png", "text/plain"], ["image/png", "text/plain"]]
    assert shown[0]["data"]["text/html"] == "<b>html from 0</b>"
    assert shown[0]["data"]["text/plain"].startswith("[rank 0] ")
    assert shown[2]["data"]["text/plain"].startswith("[rank 0] <Figure size")
    panes = _pane_outputs(msgs)
    assert any(o["data"].get("text/html") == "<b>html from 1</b>" for o in panes)
    assert any("image/png" in o["data"] and o["metadata"]["nbdist"]["rank"] == 1 for o in panes)
    result = [m for m in msgs if m["msg_type"] == "execute_result"]
    assert result and result[0]["content"]["data"]["text/plain"] == "'0'"


def test_a_bg_job_displays_in_the_cell_that_started_it(kernel: Any, tmp_path: Path) -> None:  # noqa: F811
    """A ``--bg`` job's display lands in the cell that started it, not the one running then."""
    gate = tmp_path / "gate"
    execute(kernel, "%load_ext nbdist")
    started = kernel.execute(
        "%%distributed -np -2 --bg\nimport os, time\nfrom IPython.display import HTML, display\n"
        f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)\n"
        "display(HTML(f\"<i>late from {os.environ['RANK']}</i>\"))\n"
        "HTML('<u>value</u>')\n")
    later = kernel.execute(f"job = _\nopen({str(gate)!r}, 'w').close()\njob.wait(60)")
    deadline = time.monotonic() + 90
    found: list[dict[str, Any]] = []
    while not found:
        assert time.monotonic() < deadline, "the --bg job's display never reached the notebook"
        try:
            msg = kernel.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["msg_type"] == "display_data" and "late from" in json.dumps(msg["content"]):
            found.append(msg)
    assert "late from 0" in json.dumps(found[0]["content"])
    assert found[0]["parent_header"]["msg_id"] == started != later
    # The --bg job's value keeps its rich form.
    value = execute(kernel, "job.result()")
    result = [m["content"]["data"] for m in value if m["msg_type"] == "execute_result"]
    assert result and result[0]["text/html"] == "<u>value</u>"


def test_text_view_and_a_huge_image(kernel: Any) -> None:  # noqa: F811
    """The text view prints a display's text form by rank; a 50 MB image is left out, said."""
    execute(kernel, "%load_ext nbdist\n%config DistMagics.view = 'text'")
    msgs = execute(kernel, (
        "%%distributed -np -2\nimport os\nfrom IPython.display import HTML, Image, display\n"
        "display(HTML('<b>x</b>'))\n"
        "if os.environ['RANK'] == '1':\n"
        "    big = b'\\x89PNG\\r\\n\\x1a\\n' + os.urandom(50_000_000)\n"
        "    display(Image(data=big, format='png'))\n"
    ), timeout=180)
    out = _stdout(msgs)
    assert "[rank 0] <IPython.core.display.HTML object>" in out
    assert "[rank 1] <IPython.core.display.HTML object>" in out
    assert "[rank 1] [nbdist: this display's image/png" in out and "over the limit" in out
    assert not any("image/png" in d["data"] for d in _displays(msgs))


def test_session_cells_display_and_run_on_targets(kernel: Any) -> None:  # noqa: F811
    """A session cell shows rank 0's HTML; ``--targets`` runs on those ranks only, ``-o`` gets
    their values in rank order, and the others' variables stay as they were."""
    execute(kernel, "%load_ext nbdist")
    execute(kernel, "%dist_session start -np -3", timeout=120)
    msgs = execute(kernel, "%%distributed\nimport os\nfrom IPython.display import HTML, display\n"
                           "x = int(os.environ['RANK'])\ndisplay(HTML(f'<b>s{x}</b>'))\n"
                           "HTML('<u>cell value</u>')")
    assert any(d["data"].get("text/html") == "<b>s0</b>" for d in _displays(msgs))
    result = [m["content"]["data"] for m in msgs if m["msg_type"] == "execute_result"]
    assert result and result[0]["text/html"] == "<u>cell value</u>"
    execute(kernel, "%%distributed --targets 0,2 -o vals\nx = x * 10 + 1\nx")
    assert _stdout(execute(kernel, "print(vals)")).strip() == "[1, 21]"
    execute(kernel, "%%distributed -o every\nx")
    assert _stdout(execute(kernel, "print(every)")).strip() == "[1, 1, 21]"
    one = execute(kernel, "%%distributed --targets 1-1\nx + 100")
    result = [m["content"]["data"] for m in one if m["msg_type"] == "execute_result"]
    assert result and result[0]["text/plain"] == "101"
    bad = kernel.execute("%%distributed --targets 7\nx", stop_on_error=False)
    reply = kernel.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != bad:
        reply = kernel.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "error"
    assert "--targets 7" in reply["content"]["evalue"] and "ranks 0-2" in reply["content"]["evalue"]
    execute(kernel, "%dist_session stop")

"""Rich output on a rank, without a kernel: the mime bundle, its bound, the state that keeps it."""

from __future__ import annotations

import base64
import sys
from typing import Any

import pytest

from nbdist import run
from nbdist.protocol import MAX_DISPLAY_BYTES
from nbdist.rank import rich
from nbdist.rank.shell import RankShell
from nbdist.state import DISPLAYS_KEPT, JobState


class _Rich:
    def _repr_html_(self) -> str:
        return "<b>rich</b>"

    def _repr_png_(self) -> bytes:
        return b"\x89PNG fake"

    def _repr_latex_(self) -> tuple[str, dict[str, Any]]:
        return "$x$", {"note": 1}

    def __repr__(self) -> str:
        return "Rich()"


class _Bundle:
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/markdown": "**md**", "application/json": {"a": [1, 2]}}


class _Broken:
    def _repr_html_(self) -> str:
        raise ValueError("no html today")


def test_bundle_from_repr_methods_without_ipython(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without IPython, ``_repr_*_`` methods make the bundle; binary data goes as base64."""
    monkeypatch.delitem(sys.modules, "IPython.core.formatters", raising=False)
    data, metadata = rich.mime_bundle(_Rich())
    assert data["text/html"] == "<b>rich</b>"
    assert data["text/plain"] == "Rich()"
    assert data["text/latex"] == "$x$" and metadata["text/latex"] == {"note": 1}
    encoded = rich._encoded(data)
    assert base64.b64decode(encoded["image/png"]) == b"\x89PNG fake"
    data, _ = rich.mime_bundle(_Bundle())
    assert data["text/markdown"] == "**md**" and data["application/json"] == {"a": [1, 2]}
    assert rich.mime_bundle(_Rich(), include=["text/html"])[0].keys() == {"text/html",
                                                                          "text/plain"}


def test_a_repr_that_raises_is_left_out_and_said(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``_repr_html_`` that raises leaves the text form, and says why on stderr."""
    monkeypatch.delitem(sys.modules, "IPython.core.formatters", raising=False)
    data, _ = rich.mime_bundle(_Broken())
    assert set(data) == {"text/plain"}
    assert "no html today" in capsys.readouterr().err


def test_bound_leaves_out_the_largest_and_says_so() -> None:
    """A bundle over the limit loses its largest representation; its text form says so."""
    data = {"text/plain": "<Image>", "image/png": "A" * (MAX_DISPLAY_BYTES + 10),
            "text/html": "<img>"}
    bounded, note = rich.bound(data)
    assert "image/png" not in bounded and bounded["text/html"] == "<img>"
    assert "over the limit" in note and "image/png" in note
    assert bounded["text/plain"].startswith("<Image>\n[nbdist:")
    small, none = rich.bound({"text/plain": "x"})
    assert small == {"text/plain": "x"} and none == ""


def test_state_keeps_displays_bounded_and_logs_their_text() -> None:
    """The state keeps a rank's displays (at most ``DISPLAYS_KEPT``) and logs their text form."""
    job = JobState("j", "local", 2)
    job.apply(1, {"t": "display", "data": {"text/plain": "<Figure>", "image/png": "AAAA"},
                  "metadata": {}, "size": 12})
    job.apply(1, {"t": "display", "data": "not a dict"})
    assert [(d.rank, d.text) for d in job.displays] == [(1, "<Figure>")]
    assert [line.text for line in job.ranks[1].log] == ["<Figure>"]
    for i in range(DISPLAYS_KEPT + 5):
        job.apply(0, {"t": "display", "data": {"text/html": f"<i>{i}</i>"}, "size": 10})
    assert len(job.displays) == DISPLAYS_KEPT and job.displays_seen == DISPLAYS_KEPT + 6
    assert job.displays[-1].text == "[text/html]"
    assert [d.seq for d in job.displays_since(job.displays_seen - 2, rank=0)] == [
        job.displays_seen - 1, job.displays_seen]


def test_matplotlib_magic_runs_on_a_rank() -> None:
    """``%matplotlib inline`` on a rank does nothing: its figures reach the notebook anyway."""
    assert RankShell().run_line_magic("matplotlib", "inline") is None


def _draws() -> int:
    import os

    import matplotlib.pyplot as plt
    from IPython.display import HTML, display

    display(HTML(f"<b>from {os.environ['RANK']}</b>"))
    plt.plot([1, 2, 3])
    plt.show()
    plt.figure()
    plt.plot([3, 2, 1])  # left open: sent at the end, as the inline backend does
    return int(plt.get_fignums() != [])


def test_a_job_sends_html_and_figures_from_every_rank() -> None:
    """A job's ranks send HTML, ``plt.show()``'s figure and the figure left open, in order."""
    pytest.importorskip("matplotlib")
    job = run(_draws, np=2, backend="local")
    assert job.results == [1, 1]
    for rank in (0, 1):
        mine = [d for d in job.state.displays if d.rank == rank]
        assert [sorted(d.data) for d in mine] == [
            ["text/html", "text/plain"], ["image/png", "text/plain"], ["image/png", "text/plain"]]
        assert mine[0].data["text/html"] == f"<b>from {rank}</b>"
        png = base64.b64decode(mine[1].data["image/png"])
        assert png.startswith(b"\x89PNG") and mine[1].text.startswith("<Figure size")


def test_display_imports_no_ipython_and_patches_it_once_imported() -> None:
    """A rank's ``display`` imports no IPython; once the cell imports IPython, its ``display``
    is nbdist's (the names ``from IPython.display import display`` binds included)."""
    code = (
        "import sys\n"
        "from nbdist.rank import rich\n"
        "rich.install()\n"
        "class Obj:\n"
        "    def _repr_html_(self):\n"
        "        return '<b>x</b>'\n"
        "rich.display(Obj())\n"
        "assert not any(m.split('.')[0] == 'IPython' for m in sys.modules), 'IPython imported'\n"
        "from IPython.display import display\n"
        "import IPython.core.display_functions as functions\n"
        "assert display is rich.display and functions.display is rich.display\n"
        "print('ok')\n")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()  # outside a rank: its text form, printed
    assert printed[0].startswith("<__main__.Obj object at") and printed[1:] == ["ok"]


def test_the_panel_shows_a_display_that_came_before_it_was_shown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's display that reached the state before the panel was shown (a fast session
    cell) still goes below the panel; rank 1's goes to its pane only."""
    pytest.importorskip("ipywidgets")
    import IPython.display as ipd

    from nbdist.views.widget import Panel

    shown: list[tuple[Any, dict[str, Any]]] = []

    class Handle:
        def update(self, obj: Any) -> None:
            pass

    def display(*objs: Any, **kwargs: Any) -> Any:
        shown.extend((obj, kwargs) for obj in objs)
        return Handle() if kwargs.get("display_id") else None

    monkeypatch.setattr(ipd, "display", display)
    job = JobState("j", "local", 2)
    job.apply(0, {"t": "display", "data": {"text/html": "<b>0</b>", "text/plain": "h"}})
    job.apply(1, {"t": "display", "data": {"text/html": "<b>1</b>", "text/plain": "h"}})
    panel = Panel(job)  # renders once before ``show``, as the magics do
    panel.show()
    job.finish("done")
    panel.close()
    below = [obj for obj, kw in shown if kw.get("raw")]
    assert below == [{"text/html": "<b>0</b>", "text/plain": "[rank 0] h"}]
    assert [o["data"]["text/html"] for o in panel.figures[1].outputs] == ["<b>1</b>"]

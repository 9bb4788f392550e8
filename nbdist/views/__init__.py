"""Views render a job's state; they never change it. There is always a text view.

A job's live view, whichever it is, is chosen here (``live_view``) and used through one
protocol (``LiveView``): the magics know no view class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from nbdist.state import JobState


class LiveView(Protocol):
    """A job's live view, as the magics use it.

    ``ticks``: True when the view is rendered by the thread that waits for the job (``update``
    about ten times a second: the text view, whose prints belong to the cell's output); False
    when it renders from a thread of its own once ``start``ed (the panel). ``start`` always
    works (``--bg``: the view follows the job after the cell returns); ``close`` renders the
    final state, once.
    """

    ticks: bool

    def start(self) -> None: ...

    def update(self) -> None: ...

    def close(self) -> None: ...


def live_view(job: JobState, mode: str) -> LiveView:
    """The live view for ``job``: ``"text"`` (rank-labelled lines) or ``"panel"`` (the widget
    panel, displayed at once)."""
    if mode == "text":
        from nbdist.views.text import TextView

        return TextView(job)
    from nbdist.views.widget import Panel

    panel = Panel(job)
    panel.show()
    return panel

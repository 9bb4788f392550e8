"""matplotlib's backend on a rank (``MPLBACKEND=module://nbdist.rank.mpl_backend``): Agg, which
draws without a display, and a ``show`` that sends the open figures to the notebook as PNG
(``nbdist.rank.rich``), then closes them, as the inline backend does in a kernel.

Imported by matplotlib only, once a cell on a rank draws.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from nbdist.rank import rich


class FigureManager(FigureManagerBase):
    def show(self) -> None:
        """``fig.show()``: this figure to the notebook (it stays open)."""
        rich.publish(*rich.figure_bundle(self.canvas.figure))


class FigureCanvas(FigureCanvasAgg):
    manager_class = FigureManager


def show(*args: Any, **kwargs: Any) -> None:
    """``plt.show()``: every open figure to the notebook, then closed."""
    rich.show_figures(close=True)

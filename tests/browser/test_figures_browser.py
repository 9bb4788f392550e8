"""A rank's matplotlib figure in a real browser: JupyterLab and Debian's Chromium (Playwright).

The screenshot ``test-artifacts/figures.png`` (the panel with rank 1's tab open, its figure
in it) is docs/monitoring-figures.png.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from .test_panel_browser import ARTIFACTS, CHROMIUM, lab, new_page, open_lab  # noqa: F401 - lab is a fixture

pytestmark = [pytest.mark.browser, pytest.mark.slow]

_CELL = """%%distributed -np 2
import os
import matplotlib.pyplot as plt
rank = int(os.environ["RANK"])
losses = [2.0 / (1 + step / (5 + 5 * rank)) for step in range(60)]
fig, ax = plt.subplots(figsize=(4, 2.6))
ax.plot(losses, color=f"C{rank}")
ax.set_title(f"loss on rank {rank}")
ax.set_xlabel("step")
plt.show()
"""


def _notebook() -> dict[str, Any]:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                   "source": src} for src in ["%load_ext nbdist", _CELL]],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@pytest.mark.timeout(300)
def test_a_ranks_figure_shows_in_its_pane_and_rank_zeros_below(
        lab: tuple[str, Path]) -> None:  # noqa: F811
    """In JupyterLab, rank 1's figure is an image in its tab of the panel, and rank 0's figure
    an image below the panel; screenshot."""
    pytest.importorskip("matplotlib")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    url, root = lab
    (root / "panel.ipynb").write_text(json.dumps(_notebook()))
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser, page = new_page(p)
        try:
            open_lab(page, url)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")
            page.keyboard.press("Shift+Enter")
            cell = page.locator(".jp-Notebook .jp-Cell").nth(1)
            sync_api.expect(cell.locator(".jp-InputPrompt")).to_have_text(
                re.compile(r"\[2\]"), timeout=120_000)
            # rank 0's figure below the panel: an output of the cell, outside the panel
            below = cell.locator(
                ".jp-Cell-outputArea > .jp-OutputArea-child:not(:has(.nbdist-panel)) img")
            sync_api.expect(below).to_have_count(1, timeout=30_000)
            cell.locator(".lm-TabBar-tab", has_text="rank 1").first.click()
            pane = page.locator(".nbdist-displays-1 img")
            sync_api.expect(pane).to_be_visible(timeout=30_000)
            size = pane.evaluate("img => [img.naturalWidth, img.naturalHeight]")
            cell.locator(".nbdist-panel").screenshot(path=str(ARTIFACTS / "figures.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "figures-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert size[0] > 100 and size[1] > 100, size

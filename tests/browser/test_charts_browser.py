"""The panel's metric charts in a real browser: JupyterLab and Debian's Chromium (Playwright).

Screenshots go to ``test-artifacts/charts-live.png`` (while the cell runs) and
``test-artifacts/charts.png`` (the static summary after it); docs/monitoring-charts.png is the
first one.
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


def _notebook(gate: Path) -> dict[str, Any]:
    # The ranks report until the test opens the gate, so the chart is seen growing while the
    # cell runs however slow the machine is.
    cell = f"""%%distributed -np 2
import math, os, time
import nbdist
rank = int(os.environ["RANK"])
step = 0
while not os.path.exists({str(gate)!r}) and step < 3000:
    step += 1
    nbdist.report(loss=2 * math.exp(-step / 40) + 0.1 * rank + 0.02 * math.sin(step),
                  accuracy=1 - math.exp(-step / 30) - 0.05 * rank)
    time.sleep(0.05)
step
"""
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                   "source": src} for src in ["%load_ext nbdist", cell]],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


# The number of points of rank 0's loss line in the live chart, and whether the cell runs.
_SAMPLE = """() => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[1];
  const prompt = cell ? cell.querySelector('.jp-InputPrompt').textContent : '';
  const line = document.querySelector(
    ".nbdist-charts .nbdist-chart[data-metric='loss'] polyline.nbdist-r0");
  const other = document.querySelector(
    ".nbdist-charts .nbdist-chart[data-metric='loss'] polyline.nbdist-r1");
  const count = el => el ? el.getAttribute('points').trim().split(/\\s+/).length : 0;
  return {running: prompt.includes('*'), r0: count(line), r1: count(other)};
}"""


@pytest.mark.timeout(300)
def test_the_chart_line_grows_while_the_cell_runs(lab: tuple[str, Path],  # noqa: F811
                                                   tmp_path: Path) -> None:
    """In JupyterLab, rank 0's loss line gains points while the cell runs, rank 1 has its
    own line, and the static summary keeps the curves after the cell; screenshots."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    url, root = lab
    gate = tmp_path / "gate"
    (root / "panel.ipynb").write_text(json.dumps(_notebook(gate)))
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser, page = new_page(p)
        try:
            open_lab(page, url)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")
            page.keyboard.press("Shift+Enter")
            page.wait_for_function(f"() => {{ const s = ({_SAMPLE})(); "
                                   f"return s.running && s.r0 >= 3 && s.r1 >= 3; }}",
                                   timeout=120_000)
            first = page.evaluate(_SAMPLE)
            page.wait_for_function(f"() => {{ const s = ({_SAMPLE})(); "
                                   f"return s.running && s.r0 >= {first['r0'] + 5}; }}",
                                   timeout=120_000)
            second = page.evaluate(_SAMPLE)
            page.locator(".nbdist-panel").first.screenshot(
                path=str(ARTIFACTS / "charts-live.png"))
            gate.touch()
            prompt = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-InputPrompt")
            sync_api.expect(prompt).to_have_text(re.compile(r"\[2\]"), timeout=120_000)
            static = page.locator("details:has(> summary:text('metrics'))")
            sync_api.expect(static.locator("svg").first).to_be_visible(timeout=30_000)
            static_lines = static.locator("polyline.nbdist-r1").count()
            static.first.screenshot(path=str(ARTIFACTS / "charts.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "charts-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert first["running"] and second["running"]
    assert second["r0"] > first["r0"] >= 3, (first, second)
    assert static_lines >= 2  # a loss line and an accuracy line of rank 1 in the summary

"""The panel in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

Needs ``jupyterlab`` and ``playwright`` (the Python package; ``playwright install`` is never
run) and ``/usr/bin/chromium`` (``apt-get install -y chromium``). A screenshot of the panel is
saved to ``test-artifacts/panel.png``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
STEPS = 40
GATE_AT = 20

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _notebook(gate: Path) -> dict[str, Any]:
    # mininterval=0: tqdm skips redraws within 0.1 s of the last one, so a rank that blocks at
    # the gate right after a skipped count would show the count before it, as in a terminal.
    cell = f"""%%distributed -np 2
import os, time
import nbdist
from tqdm import tqdm
rank = int(os.environ["RANK"])
for step in tqdm(range({STEPS}), desc="train", mininterval=0):
    loss = 1.0 / (step + 1) + rank / 10
    print(f"step {{step}} loss {{loss:.3f}}")
    nbdist.report(loss=loss)
    if step == {GATE_AT}:
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.01)
    time.sleep(0.05)
f"rank {{rank}} finished"
"""
    cells = ["%load_ext nbdist", cell]
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                   "source": src} for src in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A JupyterLab server of its own: its own JUPYTER_* directories, a token, 127.0.0.1."""
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab (the dev extra has it)")
    root = tmp_path / "root"
    root.mkdir()
    token = secrets.token_hex(16)
    env = {**os.environ}
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_SETTINGS_DIR",
                 "JUPYTERLAB_WORKSPACES_DIR", "IPYTHONDIR"):
        env[name] = str(tmp_path / name.lower())
    # No "news" pop-up over the panel in the screenshot (and no request to the internet).
    news = tmp_path / "jupyterlab_settings_dir" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    log = open(tmp_path / "lab.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--ServerApp.open_browser=False"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
    )
    try:
        url = ""

        def started() -> bool:
            nonlocal url
            assert server.poll() is None, (tmp_path / "lab.log").read_text()
            found = re.search(r"http://127\.0\.0\.1:(\d+)/", (tmp_path / "lab.log").read_text())
            if found and found.group(1) != "0":
                url = f"http://127.0.0.1:{found.group(1)}"
                try:
                    urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                except OSError:
                    return False
                return True
            return False

        wait_for(started, 120, "JupyterLab to start")
        yield f"{url}/lab/tree/panel.ipynb?token={token}&reset", root
    finally:
        server.send_signal(signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


_OBSERVER = """() => {
  window.__nbdist = [];
  const sample = () => {
    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[1];
    const prompt = cell ? cell.querySelector('.jp-InputPrompt').textContent : '';
    for (const rank of [0, 1]) {
      const bar = document.querySelector(`.nbdist-rank-${rank} .progress-bar`);
      if (bar) window.__nbdist.push(
        {rank, width: parseFloat(bar.style.width) || 0, running: prompt.includes('*')});
    }
  };
  new MutationObserver(sample).observe(document.body,
    {subtree: true, attributes: true, attributeFilter: ['style'], childList: true});
}"""

_HALFWAY = f"""() => [0, 1].every(rank => (window.__nbdist || []).some(
  s => s.rank === rank && s.running && s.width >= {100 * GATE_AT / STEPS - 0.01}))"""


@pytest.mark.timeout(300)
def test_each_rank_bar_advances_in_the_page_before_the_cell_ends(
    lab: tuple[str, Path], tmp_path: Path
) -> None:
    """In JupyterLab, both ranks' bars move while the cell runs, then end green; screenshot."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    url, root = lab
    gate = tmp_path / "gate"
    (root / "panel.ipynb").write_text(json.dumps(_notebook(gate)))
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(url)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=120_000)
            page.evaluate(_OBSERVER)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")  # %load_ext nbdist, then on to the next cell
            page.keyboard.press("Shift+Enter")  # the distributed cell
            page.wait_for_function(_HALFWAY, timeout=120_000)
            samples = page.evaluate("() => window.__nbdist")
            page.locator(".nbdist-panel").first.screenshot(path=str(ARTIFACTS / "panel-live.png"))
            gate.touch()
            prompt = page.locator(".jp-Notebook .jp-Cell").nth(1).locator(".jp-InputPrompt")
            sync_api.expect(prompt).to_have_text(re.compile(r"\[2\]"), timeout=120_000)
            panel = page.locator(".nbdist-panel").first
            for rank in (0, 1):
                bar = page.locator(f".nbdist-rank-{rank} .progress-bar-success")
                sync_api.expect(bar).to_have_count(1, timeout=30_000)
            panel.screenshot(path=str(ARTIFACTS / "panel.png"))
            page.screenshot(path=str(ARTIFACTS / "panel-page.png"), full_page=True)
            output = page.locator(".jp-Notebook .jp-Cell").nth(1).inner_text()
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "panel-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    for rank in (0, 1):
        live = sorted({s["width"] for s in samples if s["rank"] == rank and s["running"]})
        assert len([x for x in live if 0 < x < 100]) >= 2, (rank, live)
    assert "'rank 0 finished'" in output and "done" in output

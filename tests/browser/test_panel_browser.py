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

from ..helpers import Gate, wait_for

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
STEPS = 40
GATE_AT = 20

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def new_page(p: Any) -> tuple[Any, Any]:
    """Debian's Chromium (``CHROMIUM``), headless, and a page of the tests' size in it."""
    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                args=["--no-sandbox", "--disable-gpu"])
    return browser, browser.new_page(viewport={"width": 1400, "height": 1000})


def open_lab(page: Any, url: str) -> None:
    """JupyterLab at ``url`` (a notebook) in ``page``, once its cells show and its kernel is
    idle."""
    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.get_by_text(re.compile(r"\| Idle")).first.wait_for(timeout=120_000)


def _notebook(gate: Gate) -> dict[str, Any]:
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
{gate.code("        ")}
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

        wait_for(started, 240, "JupyterLab to start")  # minutes beside three xdist workers
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
    lab: tuple[str, Path], gate: Gate
) -> None:
    """In JupyterLab, both ranks' bars move while the cell runs, then end green; screenshot."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    url, root = lab
    (root / "panel.ipynb").write_text(json.dumps(_notebook(gate)))
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser, page = new_page(p)
        try:
            open_lab(page, url)
            page.evaluate(_OBSERVER)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")  # %load_ext nbdist, then on to the next cell
            page.keyboard.press("Shift+Enter")  # the distributed cell
            page.wait_for_function(_HALFWAY, timeout=120_000)
            samples = page.evaluate("() => window.__nbdist")
            page.locator(".nbdist-panel").first.screenshot(path=str(ARTIFACTS / "panel-live.png"))
            gate.open()
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


# -- many ranks: simulated states fed to real panels in a real page ------------------------------
_SIMULATE = """import threading, time
from nbdist.state import JobState
from nbdist.views.widget import Panel

def simulate(np, gate, ticks=40):
    # A job of np ranks, 8 to a host, fed as ranks feed it: bars, lines, a failed rank.
    job = JobState(f"sim{np}", "spark", np)
    for r in range(np):
        host = f"node-{r // 8}"
        job.apply(r, {"t": "hello", "host": host, "gpus": [str(r % 8)]})
        job.apply(r, {"t": "state", "state": "starting", "pid": 1000 + r, "host": host})
        job.apply(r, {"t": "state", "state": "running"})
    panel = Panel(job)
    panel.show()
    panel.start()
    def feed():
        for tick in range(1, ticks + 1):
            for r in range(np):
                n = 1 if r == 5 else min(100, 2 * tick + r % 7)
                job.apply(r, {"t": "progress", "id": 1, "n": n, "total": 100, "desc": "train"})
                job.apply(r, {"t": "out", "s": "o", "text": f"step {tick} rank {r}\\n"})
            if tick == 3:
                job.set_rank(40, "failed", 1)
            time.sleep(0.05)
        while not os.path.exists(gate):
            time.sleep(0.05)
        for r in range(np):
            job.set_rank(r, "done", 0)
        job.finish("failed", "rank 40 failed")
    threading.Thread(target=feed, daemon=True).start()
    return panel
"""

#: Samples the page while the panels update: DOM nodes under each panel, mutation batches
#: (updates applied), and the gaps between animation frames (what a user feels as jank).
_SAMPLER = """() => {
  const s = window.__scale = {frames: [], updates: 0, running: true};
  let last = performance.now();
  const frame = (now) => { s.frames.push(now - last); last = now;
                           if (s.running) requestAnimationFrame(frame); };
  requestAnimationFrame(frame);
  new MutationObserver(() => { s.updates += 1; }).observe(document.body,
    {subtree: true, attributes: true, childList: true, characterData: true});
}"""


def _scale_notebook(gates: dict[int, Path]) -> dict[str, Any]:
    cells = ["%load_ext nbdist", "import os\n" + _SIMULATE]
    cells += [f"panel{np} = simulate({np}, {str(gate)!r})" for np, gate in gates.items()]
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                   "source": src} for src in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@pytest.mark.timeout(420)
def test_panels_of_64_and_256_ranks_stay_small_and_readable_in_the_page(
    lab: tuple[str, Path], tmp_path: Path
) -> None:
    """In JupyterLab, panels of 64 and 256 simulated ranks show a summary line, the failed
    rank first, every rank by host in closed groups and a working rank filter; their DOM and
    the saved notebook stay small (figures in test-artifacts/panel-scale.json)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    url, root = lab
    gates = {64: tmp_path / "gate64", 256: tmp_path / "gate256"}
    notebook = root / "panel.ipynb"
    notebook.write_text(json.dumps(_scale_notebook(gates)))
    ARTIFACTS.mkdir(exist_ok=True)
    figures: dict[str, Any] = {}
    with sync_api.sync_playwright() as p:
        browser, page = new_page(p)
        try:
            open_lab(page, url)
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
            page.keyboard.press("Shift+Enter")  # %load_ext nbdist
            page.keyboard.press("Shift+Enter")  # the helper
            for index, np in enumerate(gates, start=2):  # one panel at a time
                page.evaluate(_SAMPLER)
                # The filter of the panel before had the focus: select this cell first.
                page.locator(".jp-Notebook .jp-Cell").nth(index).locator(
                    ".jp-InputPrompt").click()
                page.keyboard.press("Escape")
                page.keyboard.press("Shift+Enter")
                panel = page.locator(f".nbdist-job-sim{np}")
                sync_api.expect(panel.locator(".nbdist-summary")).to_contain_text(
                    f"{np} ranks on {np // 8} hosts", timeout=120_000)
                sync_api.expect(panel.locator(".nbdist-summary")).to_contain_text(
                    "failed: 40", timeout=60_000)
                # The rows lead with the failed rank, then the one far behind.
                sync_api.expect(panel.locator(".nbdist-row").first).to_contain_text(
                    "rank 40", timeout=60_000)
                sync_api.expect(panel.locator(".nbdist-row").nth(1)).to_contain_text(
                    re.compile(r"rank 5\b"))
                live = page.evaluate(f"""() => {{ const s = window.__scale; s.running = false;
                  const f = s.frames.slice(1).sort((a, b) => a - b);
                  return {{updates: s.updates, frames: f.length,
                    frame_p50_ms: f[Math.floor(f.length / 2)] || 0,
                    frame_p95_ms: f[Math.floor(f.length * 0.95)] || 0,
                    frame_max_ms: f[f.length - 1] || 0,
                    dom_nodes: document.querySelector('.nbdist-job-sim{np}')
                      .querySelectorAll('*').length}}; }}""")
                # Every rank is in its host's group, closed until opened.
                groups = panel.locator(".nbdist-hosts .nbdist-host")
                sync_api.expect(groups).to_have_count(np // 8, timeout=60_000)
                panel.locator(".nbdist-groups .lm-AccordionPanel-title, "
                              ".nbdist-groups .jupyter-widget-Collapse-header").first.click()
                panel.locator(".nbdist-filter input").fill("failed")
                panel.locator(".nbdist-filter input").press("Enter")
                sync_api.expect(panel.locator(".nbdist-filtered")).to_contain_text(
                    "rank 40", timeout=60_000)
                gates[np].touch()
                sync_api.expect(panel).to_have_class(re.compile("nbdist-final-failed"),
                                                     timeout=120_000)
                figures[str(np)] = live
            page.screenshot(path=str(ARTIFACTS / "panel-scale.png"), full_page=True)
            page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt").click()
            page.keyboard.press("Escape")
            page.keyboard.press("Control+s")
            wait_for(lambda: "nbdist-summary-static" in notebook.read_text(), 60,
                     "the notebook saved with the panels' static summaries")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "panel-scale-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    figures["notebook_bytes"] = notebook.stat().st_size
    (ARTIFACTS / "panel-scale.json").write_text(json.dumps(figures, indent=2))
    assert figures["notebook_bytes"] < 200_000, figures
    # The page holds every rank once (a row in its host's table), not a widget per rank.
    assert figures["256"]["dom_nodes"] < 4 * figures["64"]["dom_nodes"], figures

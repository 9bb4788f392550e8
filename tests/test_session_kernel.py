"""A session through a real Jupyter kernel: the stop button, the live panel, kernel shutdown."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

from .helpers import GONE_WITHIN_S
from .test_kernel_live import ROOT, Frontend, execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _stdout(msgs: list[dict[str, Any]]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


def _rank_pids(kc: Any) -> list[int]:
    """The session's rank pids, once the kernel's state has every one (each comes with its
    rank's first event, which may follow the start's return on a busy machine)."""
    deadline = time.monotonic() + 30
    while True:
        shown = execute(kc, "import json, nbdist.session as s\n"
                            "print(json.dumps([r.pid for r in s.current().state.ranks]))")
        pids = json.loads(_stdout(shown))
        if None not in pids:
            return [int(p) for p in pids]
        assert time.monotonic() < deadline, f"the ranks' pids never all came: {pids}"
        time.sleep(0.1)


def test_stop_button_panel_and_shutdown(tmp_path: Path) -> None:
    """Interrupting a session cell keeps the session; its panel is live; shutdown ends ranks."""
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    pids: list[int] = []
    try:
        execute(kc, "%load_ext nbdist")
        execute(kc, "%dist_session start -np -2")
        execute(kc, "%%distributed\nsteps = 0")
        pids = _rank_pids(kc)
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)

        # The panel of a session cell shows each rank's bar advancing while the cell runs.
        gate = tmp_path / "gate"
        # stop_on_error=False: else the kernel may abort the requests that follow the error
        # (ipykernel's stop_on_error), the cells below, and they run nothing.
        msg_id = kc.execute(
            "%%distributed\nimport os, time\nfrom tqdm import tqdm\n"
            "for i in tqdm(range(1000000), mininterval=0):\n"
            "    steps += 1\n"
            f"    if i == 20 and not os.path.exists({str(gate)!r}):\n"
            "        open(" + repr(str(gate)) + ", 'w').close()\n"
            "    time.sleep(0.01)\n", stop_on_error=False,
        )
        fe = Frontend()
        deadline = time.monotonic() + 60
        while not (gate.exists() and all(
                len(set(fe.values(fe.bar_of_rank(r) or ""))) >= 2 for r in (0, 1))):
            assert time.monotonic() < deadline, "the session cell's bars never moved"
            try:
                fe.feed(kc.get_iopub_msg(timeout=1), msg_id)
            except queue.Empty:
                pass
            except AssertionError:
                raise
        assert not fe.idle

        # The stop button: KeyboardInterrupt on the ranks, the cell fails, the session stays.
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error"
        assert "interrupted" in "\n".join(reply["content"]["traceback"])
        assert "still running" in "\n".join(reply["content"]["traceback"])
        execute(kc, "%%distributed -o flags\nsteps > 20")
        assert _stdout(execute(kc, "print(flags)")).strip() == "[True, True]"
        assert _rank_pids(kc) == pids  # the same interpreters
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    # Kernel shutdown: the session's ranks go with the kernel.
    deadline = time.monotonic() + GONE_WITHIN_S
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in pids):
        assert time.monotonic() < deadline, f"ranks {pids} outlived the kernel"
        time.sleep(0.05)


def test_second_stop_tears_the_session_down() -> None:
    """A rank that swallows KeyboardInterrupt: a second stop ends the session at once."""
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        execute(kc, "%load_ext nbdist\n%config DistMagics.view = 'text'")
        execute(kc, "%dist_session start -np -2")
        pids = _rank_pids(kc)
        msg_id = kc.execute("%%distributed\nimport time\nprint('started', flush=True)\n"
                            "while True:\n    try:\n"
                            "        time.sleep(0.01)\n    except KeyboardInterrupt:\n"
                            "        print('ignored', flush=True)\n", stop_on_error=False)
        deadline = time.monotonic() + 30
        seen = ""

        def wait_output(text: str, count: int) -> None:
            nonlocal seen
            while seen.count(text) < count:
                assert time.monotonic() < deadline, f"no {text!r} from the ranks: {seen!r}"
                try:
                    msg = kc.get_iopub_msg(timeout=1)
                except queue.Empty:
                    continue
                if msg["msg_type"] == "stream":
                    seen += msg["content"]["text"]

        wait_output("started", 2)
        km.interrupt_kernel()
        wait_output("ignored", 2)  # the first stop reached both ranks, which ignored it
        started = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=30)
        assert time.monotonic() - started < GONE_WITHIN_S
        assert "interrupted twice" in "\n".join(reply["content"]["traceback"])
        status = "".join(m["content"]["data"]["text/plain"] for m in execute(kc, "%dist_session")
                         if m["msg_type"] == "execute_result")
        assert "broken: interrupted twice" in status
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() !=
                       psutil.STATUS_ZOMBIE for p in pids)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)

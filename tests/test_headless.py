"""A notebook run without stdin (nbclient, papermill: ``allow_stdin=False``) through a real
kernel: a rank's ``breakpoint()`` and ``%dist_debug`` answer ``c`` and say so, and neither
leaves a job or the session running (issue 36, HARDENING.md rule 10)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from .test_kernel_live import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def kc() -> Iterator[Any]:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def headless(kc: Any, code: str, timeout: float = 60) -> tuple[str, str | None, str]:
    """Run ``code`` as nbclient does (no stdin): its stdout, its result, its error text."""
    msg_id = kc.execute(code, allow_stdin=False, stop_on_error=False)
    out: list[str] = []
    result = None
    error = ""
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "execute_result":
            result = msg["content"]["data"]["text/plain"]
        elif kind == "error":
            error = "\n".join(msg["content"]["traceback"])
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out), result, error


def test_a_breakpoint_without_stdin_continues_and_says_so(kc: Any) -> None:
    """``breakpoint()`` on rank 1 with no stdin answers ``c``: the cell ends with its value
    long before its timeout, and the output says why the rank went on."""
    headless(kc, "%load_ext nbdist")
    out, result, error = headless(
        kc, "%%distributed -np 2 --quiet --timeout 120\nimport os\n"
            "x = int(os.environ['RANK'])\nif x == 1:\n    breakpoint()\nx", timeout=150)
    assert not error and result == "0", (out, error)
    assert "[rank 1] no input box to ask (no stdin): answered c (continue)" in out, out


def test_dist_debug_without_stdin_continues_and_the_session_goes_on(kc: Any) -> None:
    """``%dist_debug`` with no stdin answers ``c`` and says so; the session's next cell runs
    and its variables are still there."""
    headless(kc, "%load_ext nbdist")
    _, _, error = headless(kc, "%dist_session start -np -2")
    assert not error, error
    # The variable is set by a cell of its own: a rank's failure interrupts the cell on the
    # others, also before it ran there (a loaded machine starts rank 0 later).
    _, _, error = headless(kc, "%%distributed\nkept = 5")
    assert not error, error
    _, _, error = headless(kc, "%%distributed\nimport os\n"
                               "if os.environ['RANK'] == '1':\n    raise ValueError('boom')")
    assert "boom" in error
    out, _, error = headless(kc, "%dist_debug")
    assert not error, error
    assert "no input box to ask (no stdin): answered c (continue)" in out, out
    out, result, error = headless(kc, "%%distributed -o seen\nkept * 2")
    assert not error and result == "10", (out, error)
    headless(kc, "%dist_session stop")

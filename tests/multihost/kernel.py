"""The notebook of the multi-host tests: a real IPython kernel on the driver's host.

The kernel runs inside the driver's network namespace (``ip netns exec``, its own host name),
started by jupyter_client from a kernel spec written for it. Its channels are ZeroMQ ``ipc``
sockets, files in a folder both namespaces see, so the test talks to it the way a notebook
front end does without any address of the test's own namespace on the simulated network.
The stop button is jupyter_client's ``interrupt_kernel`` (SIGINT to the kernel).
"""

from __future__ import annotations

import json
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "nbdist-multihost"


@dataclass
class Reply:
    """What a cell did, as a front end sees it."""

    msg_id: str
    stdout: str = ""
    stderr: str = ""
    error: str | None = None  # the traceback, colours stripped, when the cell raised
    ename: str | None = None
    value: str | None = None  # the execute_result's text/plain
    seconds: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)


def _plain(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class Kernel:
    """A kernel started in ``prefix`` (a command prefix that runs it on the driver's host)."""

    def __init__(self, prefix: list[str], workdir: Path, env: dict[str, str]) -> None:
        specs = workdir / "kernels"
        (specs / KERNEL).mkdir(parents=True)
        (specs / KERNEL / "kernel.json").write_text(json.dumps({
            "argv": [*prefix, sys.executable, "-m", "ipykernel_launcher", "-f",
                     "{connection_file}"],
            "display_name": "nbdist multi-host driver", "language": "python",
            "interrupt_mode": "signal",
        }))
        (workdir / "ipc").mkdir()
        self.km = KernelManager(
            kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs)]),
            transport="ipc", ip=str(workdir / "ipc" / "k"),
            connection_file=str(workdir / "kernel.json"),
        )
        self.km.start_kernel(env=env, cwd=str(ROOT))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        provisioner: Any = self.km.provisioner
        return int(provisioner.process.pid)

    def start(self, code: str) -> str:
        """Send a cell; returns its message id (see :meth:`collect`). With
        ``stop_on_error=False``: a test sends its next cell as soon as one failed, and
        ipykernel aborts the requests that arrive while it handles a cell's error."""
        return str(self.kc.execute(code, stop_on_error=False))

    def collect(
        self, msg_id: str, timeout: float = 120,
        until: Callable[[Reply], bool] | None = None,
    ) -> Reply:
        """Read the cell's output until it is idle (or ``until`` holds), within ``timeout``."""
        reply = Reply(msg_id)
        started = time.monotonic()
        deadline = started + timeout
        while True:
            if until is not None and until(reply):
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"cell {msg_id} still running after {timeout:g} s; it printed:\n"
                    f"{reply.stdout[-3000:]}\n{reply.stderr[-2000:]}"
                )
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            reply.messages.append(msg)
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    reply.stdout += content["text"]
                else:
                    reply.stderr += content["text"]
            elif kind == "error":
                reply.ename = content["ename"]
                reply.error = _plain("\n".join(content["traceback"]))
                print(f"--- the cell raised:\n{reply.error}")  # shown when a test fails
            elif kind == "execute_result":
                reply.value = content["data"].get("text/plain")
            elif kind == "status" and content["execution_state"] == "idle":
                reply.seconds = time.monotonic() - started
                return reply

    def execute(self, code: str, timeout: float = 120) -> Reply:
        """Run a cell to its end; fail the test if it raised."""
        reply = self.collect(self.start(code), timeout)
        if reply.error is not None:
            raise AssertionError(f"the cell raised:\n{reply.error}\n--- stdout:\n{reply.stdout}")
        return reply

    def fails(self, code: str, timeout: float = 120) -> Reply:
        """Run a cell that must raise; its reply."""
        reply = self.collect(self.start(code), timeout)
        assert reply.error is not None, f"the cell did not raise; it printed:\n{reply.stdout}"
        return reply

    def value(self, expression: str, timeout: float = 120) -> Any:
        """An expression evaluated in the kernel, as JSON."""
        out = self.execute(f"import json as _j\nprint(_j.dumps({expression}))", timeout).stdout
        return json.loads(out.strip().splitlines()[-1])

    def interrupt(self) -> None:
        """The stop button."""
        self.km.interrupt_kernel()

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)

"""``%dist_stacks`` looks before it signals (issue 36, HARDENING.md rule 8): no rank dies of it,
and a rank sleeping in C is not woken early."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import nbdist
from nbdist.rank import signals

from .helpers import Gate, wait_for


@contextlib.contextmanager
def _child(code: str) -> Iterator[int]:
    """A Python process that ran ``code`` up to its last line (it says so first), then runs
    that line; its pid."""
    *head, last = code.splitlines()
    script = "\n".join([*head, "print('ok', flush=True)", last])
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ok\n"
            yield proc.pid
        finally:
            proc.kill()


def test_hazard_reads_the_dispositions_of_a_process() -> None:
    """A process whose SIGUSR2 is at its default action, ignored or blocked everywhere is
    named as such; one that catches it and waits for a lock (restarted after the handler)
    is safe, and one in ``sleep()`` called from C (cut short) is not."""
    wait = "import time\ntime.sleep(60)"
    cases = {
        f"import signal\n{wait}": "default action",
        f"import signal\nsignal.signal(signal.SIGUSR2, signal.SIG_IGN)\n{wait}":
            "ignores SIGUSR2",
        "import signal\nsignal.signal(signal.SIGUSR2, lambda *a: None)\n"
        f"signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])\n{wait}": "blocks SIGUSR2",
    }
    for code, said in cases.items():
        with _child(code) as pid:
            assert said in signals.hazard(pid), code
    caught = "import ctypes, signal, threading\nsignal.signal(signal.SIGUSR2, lambda *a: None)\n"
    with _child(caught + "lock = threading.Lock()\nlock.acquire()\nlock.acquire()") as pid:
        wait_for(lambda: signals.hazard(pid) == "", 30, "the lock's wait to be seen as safe")
    with _child(caught + "ctypes.CDLL(None).sleep(60)") as pid:
        wait_for(lambda: "waits in clock_nanosleep(), which SIGUSR2 would cut short"
                 in signals.hazard(pid), 30, "the sleep in C to be seen")


def _reset_then_wait(gate: Gate, ready: Gate) -> int:
    import os
    import signal

    if os.environ["RANK"] == "1":
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # as a library might
        ready.open()
    gate.wait()
    return int(os.environ["RANK"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stacks_do_not_kill_a_rank_whose_sigusr2_was_reset(tmp_path: os.PathLike[str]) -> None:
    """A rank that reset SIGUSR2 to its default action still shows its stacks (its own thread
    writes them) and lives on: the job ends with every rank's value."""
    gate, ready = Gate(os.path.join(tmp_path, "gate")), Gate(os.path.join(tmp_path, "ready"))
    job = nbdist.run(_reset_then_wait, gate, ready, np=2, backend="local", gpu=False, timeout=100)
    try:
        ready.wait()
        got = job.stacks(10)
        assert not got.missing, got.text()
        assert sorted(r for g in got.groups for r in g.ranks) == [0, 1], got.text()
        assert "_reset_then_wait" in got.text() and "wait" in got.text(), got.text()
    finally:
        gate.open()
    assert job.result(timeout=60) == 0 and job.results == [0, 1]


def _sleep_in_c(ready: Gate) -> int:
    import ctypes

    ready.open()
    return int(ctypes.CDLL(None).sleep(6))  # the seconds left when it was woken early


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stacks_do_not_cut_short_a_sleep_in_c(tmp_path: os.PathLike[str]) -> None:
    """A rank in ``libc.sleep`` shows its stacks and sleeps its full time (sleep returns 0)."""
    ready = Gate(os.path.join(tmp_path, "ready"))
    job = nbdist.run(_sleep_in_c, ready, np=1, backend="local", gpu=False, timeout=100)
    ready.wait()
    pid = None

    def asleep() -> bool:
        nonlocal pid
        pid = job.state.ranks[0].pid
        return pid is not None and "sleep()" in signals.hazard(pid)

    wait_for(asleep, 30, "the rank to be in its sleep")
    got = job.stacks(10)
    assert "_sleep_in_c" in got.text(), got.text()
    assert job.result(timeout=60) == 0

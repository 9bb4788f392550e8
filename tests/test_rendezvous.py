"""The rank supervisor's rendezvous without the event channel (through the backend's gather)."""

from __future__ import annotations

import threading

import pytest

from nbdist.protocol import HelloEvent
from nbdist.rank.supervisor import RankSpec, Supervisor

pytestmark = pytest.mark.timeout(60)


class _LateWorld(threading.Event):
    """A world event whose first wait times out just as the gather thread finishes.

    It reproduces, without timing luck, the moment that failed a Spark fault test about once
    in 25 runs: the supervisor's 0.1 s wait expires, then the gather sets the world and
    ``_gathered`` before the supervisor looks at ``_gathered``.
    """

    def __init__(self, gathered: threading.Event) -> None:
        super().__init__()
        self._gathered = gathered
        self._first = True

    def wait(self, timeout: float | None = None) -> bool:
        if self._first:
            self._first = False
            assert self._gathered.wait(30), "the gather thread never finished"
            return False
        return super().wait(timeout)


def _hellos(hello: HelloEvent) -> list[HelloEvent]:
    return [{**hello, "rank": r, "host": "127.0.0.1"} for r in range(2)]


def test_a_world_gathered_as_the_wait_times_out_is_taken() -> None:
    """A fallback rendezvous that succeeds just as a wait times out gives the rank its world."""
    spec = RankSpec(rank=1, world_size=2, job_id="j", secret="s", driver=("127.0.0.1", 1),
                    payload=b"")
    sup = Supervisor(spec, gather=_hellos)
    sup._world = _LateWorld(sup._gathered)
    hello = {"host": "127.0.0.1", "cpus": 1, "gpus": [], "port": 29500}
    thread = threading.Thread(target=sup._world_without_channel, args=(_hellos, hello))
    thread.start()
    try:
        assert sup._wait_world(), sup._gather_error
    finally:
        thread.join(30)
    assert sup._world_env["RANK"] == "1" and sup._world_env["WORLD_SIZE"] == "2"


def test_a_failed_fallback_rendezvous_is_reported() -> None:
    """A gather that raises ends the wait at once, with the backend's error kept for the note."""
    spec = RankSpec(rank=0, world_size=2, job_id="j", secret="s", driver=("127.0.0.1", 1),
                    payload=b"")

    def broken(hello: HelloEvent) -> list[HelloEvent]:
        raise RuntimeError("barrier aborted")

    sup = Supervisor(spec, gather=broken)
    sup._world_without_channel(broken, {"host": "127.0.0.1"})
    assert not sup._wait_world()
    assert sup._gather_error == "RuntimeError: barrier aborted"

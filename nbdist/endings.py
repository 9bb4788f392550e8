"""The words of a job's end: the error each verdict of its life (``lifecycle.End``) gives,
built from how its ranks ended, and what output never reached the notebook. Pure: the job
(``job.Job``) hands in what it gathered.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nbdist import blame, lifecycle
from nbdist.errors import DistributedError, Reason
from nbdist.protocol import RankOutcome, RankStatus

if TYPE_CHECKING:
    from nbdist.events import DriverAddress
    from nbdist.state import RankState


def failure_error(job_id: str, np: int, failed: list[RankOutcome],
              outcomes: dict[int, RankOutcome], first_failure: int | None) -> DistributedError:
    # The cause, not its consequences: a rank killed by a signal, or whose error is not a
    # collective's lost peer, over the first one heard (on a busy machine a peer's
    # "Connection closed by peer" can reach the driver first; without the channel nothing
    # is heard and Spark hands the outcomes over in rank order).
    root = blame.root_cause(failed, first_failure)
    ordered = sorted(failed, key=lambda o: (o.rank != root, o.rank))
    first = ordered[0]
    what = (
        f"{first.error.get('type')}: {first.error.get('message')}"
        if first.error else first.describe().splitlines()[0]
    )
    others = [o.rank for o in ordered[1:]]
    lost = next((o for o in ordered if o.lost_host is not None), None)
    if lost is not None and lost.lost_host is not None:
        # Not "rank 2 failed ... nbdist stopped 1, 3": the host went, with all its ranks.
        gone = sorted(o.rank for o in ordered if o.lost_host == lost.lost_host)
        why = str(lost.error.get("message", "")) if lost.error is not None else ""
        why = why.removeprefix(f"its Spark executor on {lost.lost_host} was lost: ")
        msg = (f"the Spark executor on {lost.lost_host} was lost, and with it "
               f"{lifecycle.ranks_text(gone)} of {np}: {why}")
        others = [o.rank for o in ordered if o.rank not in gone]
        if others:
            msg += f" (ranks {', '.join(map(str, others))} failed too)"
    else:
        msg = f"rank {first.rank} of {np} failed: {what}"
        if others:
            msg += f" (ranks {', '.join(map(str, others))} failed after it)"
    stopped = [o.rank for o in outcomes.values() if o.status == RankStatus.CANCELLED]
    if stopped:
        msg += f"; nbdist stopped ranks {', '.join(map(str, sorted(stopped)))}"
    return DistributedError(
        msg, job_id=job_id, reason=Reason.FAILED,
        failures={o.rank: o.describe() for o in ordered},
    )

def unheard_error(job_id: str, unheard: dict[int, str], outcomes: dict[int, RankOutcome],
              ranks: list[RankState], timeout: float) -> DistributedError:
    failures = {}
    for rank, host in sorted(unheard.items()):
        r = ranks[rank]
        since = time.strftime("%H:%M:%S", time.localtime(r.last_seen or 0))
        tail = "".join(f"    {line.text}\n" for line in list(r.log)[-10:])
        failures[rank] = (f"rank {rank} on {host} was last heard from at {since}"
                          + (f"; its last output:\n{tail}" if tail else "\n"))
    stopped = sorted(o.rank for o in outcomes.values()
                     if o.rank not in unheard)
    msg = (
        f"job {job_id} lost {lifecycle.on_hosts(unheard)}: not heard from for "
        f"{timeout:g} s "
        f"while connected. That host, or the network between it and the driver, is gone "
        f"(the heartbeat timeout is %config DistMagics.heartbeat_timeout or "
        f"NBDIST_HEARTBEAT_TIMEOUT); its ranks stop on their own when they stop hearing "
        f"from the driver"
    )
    if stopped:
        msg += f"; nbdist stopped ranks {', '.join(map(str, stopped))}"
    return DistributedError(msg, job_id=job_id, reason=Reason.FAILED, failures=failures)

def timeout_error(job_id: str, timeout: float, running: list[int], ranks: list[RankState],
              stacks: str) -> DistributedError:
    failures = {}
    for rank in running:
        r = ranks[rank]
        tail = [line.text for line in list(r.log)[-10:]]
        failures[rank] = "still running; its last output:\n" + "".join(
            f"    {t}\n" for t in tail
        ) if tail else "still running; it printed nothing\n"
    return DistributedError(
        f"job {job_id} timed out after {timeout:g} s (--timeout); ranks still "
        f"running: {', '.join(map(str, running)) or 'none'}; all ranks were stopped",
        job_id=job_id, reason=Reason.TIMEOUT, failures=failures,
        stacks=stacks,
    )


def lost_output(outcomes: list[RankOutcome], address: DriverAddress) -> str | None:
    """One warning for the ranks whose output did not reach the driver (None: nothing lost)."""
    lossy = [o for o in outcomes if o.channel_error or o.lost_lines or o.dropped_events]
    if not lossy:
        return None
    ranks = ", ".join(str(o.rank) for o in lossy)
    lines = sum(o.lost_lines for o in lossy)
    updates = sum(o.dropped_events for o in lossy)
    why = next((o.channel_error for o in lossy if o.channel_error), "")
    return (
        f"output lost from rank{'s' if len(lossy) > 1 else ''} {ranks}: {_count(lines, 'line')} "
        f"of output and {_count(updates, 'progress/metrics update')} never reached the "
        f"notebook (each rank's last lines are shown); results and errors came back through "
        f"the backend. {why}. {unreachable_hint(address)}"
    )


def unreachable_hint(address: DriverAddress) -> str:
    """What to check when ranks cannot reach the event server, naming the settings used."""
    where = f" nbdist's event server is {address.source}." if address.source else ""
    return (
        f"Check that the ranks can connect to that address (a firewall, a route).{where} "
        f"Where the executors reach the driver at another address or port (NAT, a driver in "
        f"a container), set it with %config DistMagics.driver_host / NBDIST_DRIVER_HOST and "
        f"forward a fixed port set with DistMagics.driver_port / NBDIST_DRIVER_PORT."
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"

"""Which failed rank a job's error names first: the cause, not its consequences.

When one rank fails, its peers' collectives lose their connection to it and fail too (gloo's
``Connection closed by peer``, NCCL's remote error, a collective's timeout). The driver names
the first failure it *heard* over the event channel, but that is not always the cause: a peer's
consequence can be heard first on a busy machine, and without the channel (the fallback
rendezvous, a broken channel) nothing is heard and the outcomes come back in rank order (a
Spark ``collect()``). :func:`root_cause` chooses from the outcomes themselves (docs/reliability.md,
"Which rank is blamed"). Pure functions.
"""

from __future__ import annotations

import math
import re
import signal

from nbdist.protocol import RankOutcome

#: Exception types torch.distributed raises when the process group itself broke (a peer gone,
#: the store unreachable), whatever the peer's own error was.
PEER_LOSS_TYPES = frozenset({"DistBackendError", "DistNetworkError", "DistStoreError"})

#: What a collective says when a peer went away, or never came to the collective: the
#: consequence of another rank's failure. Matched case-insensitively in the error's message.
PEER_LOSS = re.compile(
    "|".join((
        r"connection closed by peer",                    # gloo: the peer's process ended
        r"connection reset by peer",                     # gloo, TCPStore: the same, abruptly
        r"remote process exited or there was a network error",  # NCCL's remote error
        r"ncclRemoteError",
        r"NCCL communicator was aborted",                # NCCL: the watchdog aborted it
        r"Watchdog caught collective operation timeout",  # NCCL: a peer never came
        r"timed out waiting \d+ ?ms for (send|recv) operation",  # gloo: a peer never came
        r"gloo/transport/tcp/.*(timed out|broken pipe)",  # gloo's transport: the peer went
        r"failed to recv, got 0 bytes",                  # TCPStore: its host rank went
    )),
    re.IGNORECASE,
)


def peer_lost(outcome: RankOutcome) -> bool:
    """Whether the rank failed because a peer did: its collective (or the process group's
    store) lost the connection to another rank, or timed out waiting for one.

    A rank killed by a signal or that exited without an exception is a cause, never this.
    """
    error = outcome.error
    if error is None:
        return False
    if str(error.get("type", "")) in PEER_LOSS_TYPES:
        return True
    return PEER_LOSS.search(str(error.get("message", ""))) is not None


def killed(outcome: RankOutcome) -> bool:
    """Whether a signal nbdist did not send ended the rank (SIGKILL, a segfault), other than
    an abort (:func:`aborted`)."""
    return (outcome.error is None and outcome.exit_code is not None and outcome.exit_code < 0
            and outcome.exit_code != -signal.SIGABRT)


def aborted(outcome: RankOutcome) -> bool:
    """Whether the rank ended by ``abort()`` (SIGABRT) without a Python exception.

    Not always a cause: NCCL's error handling aborts a surviving rank's process once a peer is
    gone (``TORCH_NCCL_ASYNC_ERROR_HANDLING``), with a watchdog's lines in the rank's last
    output; a C++ assertion aborts too, as a cause."""
    return (outcome.error is None and outcome.exit_code is not None
            and outcome.exit_code == -signal.SIGABRT)


def _abort_after_peer(outcome: RankOutcome) -> bool:
    """An abort whose last output says a collective lost its peer (NCCL's watchdog)."""
    return aborted(outcome) and any(PEER_LOSS.search(line) for line in outcome.tail)


def root_cause(failed: list[RankOutcome], heard: int | None) -> int:
    """The rank whose failure the others' follow from, of ``failed`` (not empty).

    ``heard`` is the rank whose failure the driver heard of first over the event channel
    (None when nothing was heard). In order:

    1. a rank killed by a signal nbdist did not send (not an abort): its peers' errors (a
       connection reset) follow from it, whichever was heard first;
    2. a rank whose error is not a peer-loss consequence (:func:`peer_lost`);
    3. a rank that aborted (SIGABRT) without its last output blaming a lost peer;
    4. the rest: peer losses, and aborts after one (NCCL's watchdog);

    and between equals: the one heard first, else the one that ended first (``ended``, as its
    host's clock saw it), else the lowest rank.
    """
    tiers = (
        [o for o in failed if killed(o)],
        [o for o in failed if not killed(o) and not aborted(o) and not peer_lost(o)],
        [o for o in failed if aborted(o) and not _abort_after_peer(o)],
    )
    candidates = next((tier for tier in tiers if tier), failed)
    for o in candidates:
        if o.rank == heard:
            return o.rank
    first = min(candidates, key=lambda o: (
        o.ended if o.ended is not None else math.inf, o.rank))
    return first.rank

"""What a Spark barrier task returns to the driver is typed as it is: ``OutcomeFields`` lists
``RankOutcome``'s fields, and the driver keeps only the fields it knows."""

from __future__ import annotations

import dataclasses
import typing

from nbdist.launch.spark import _outcome
from nbdist.protocol import OutcomeFields, RankStatus
from nbdist.rank.supervisor import RankOutcome


def test_outcome_fields_are_the_fields_of_rank_outcome_with_their_types() -> None:
    """OutcomeFields has each RankOutcome field with its type (status: the word, a str)."""
    outcome = typing.get_type_hints(RankOutcome)
    fields = typing.get_type_hints(OutcomeFields)
    assert list(fields) == [f.name for f in dataclasses.fields(RankOutcome)]
    assert outcome.pop("status") is RankStatus and fields.pop("status") is str
    assert fields == outcome


def test_the_driver_drops_fields_it_does_not_know_and_reads_the_status_word() -> None:
    """Fields of another nbdist are dropped; a status word becomes a RankStatus; the row's
    rank is the partition's, whatever the fields say."""
    sent = {"rank": 7, "status": "failed", "error": {"type": "ImportError", "message": "m",
                                                      "traceback": ""}, "from_the_future": 1}
    outcome = _outcome(2, typing.cast(OutcomeFields, sent))
    assert outcome.rank == 2 and outcome.status is RankStatus.FAILED
    assert outcome.error == sent["error"] and outcome.tail == []
    fields = typing.cast(OutcomeFields, dataclasses.asdict(RankOutcome(3, RankStatus.DONE,
                                                                       result=b"x")))
    assert _outcome(3, fields) == RankOutcome(3, RankStatus.DONE, result=b"x")

"""The flight recorder lined up across ranks (``nbdist.collectives``) on dumps recorded from
real gloo runs, and ``%dist_check``'s judgement (``nbdist.check``), without processes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from nbdist import check, collectives, logfiles, stacks

DATA = Path(__file__).parent / "data" / "flight_recorder"


def _dumps(case: str, ranks: tuple[int, ...] = (0, 1, 2)) -> dict[int, str]:
    return {r: (DATA / f"{case}-{r}.json").read_text() for r in ranks}


def test_a_rank_that_stops_before_the_third_all_reduce_is_named() -> None:
    """Ranks 0 and 2 wait in all_reduce #3; rank 1 never entered it, its last completed
    collective and where its code is are said."""
    got = collectives.analyse(_dumps("stop"), [0, 1, 2], {1: "train.py:41"})
    text = got.text()
    assert text.startswith("collectives: ranks 0, 2 wait in all_reduce #3 (1000 float32, "
                           "gloo) since "), text
    assert "; rank 1 never entered it (its last: all_reduce #2, completed)" in text
    assert text.endswith(" — rank 1 is in train.py:41")
    assert got.missing == (1,)
    assert not got.desync


def test_a_desync_is_named_as_one() -> None:
    """All-reduce against broadcast at the same number: ``desync at #3`` names both sides."""
    got = collectives.analyse(_dumps("desync"), [0, 1, 2])
    assert got.lines[0] == "desync at #3: ranks 0, 2 call all_reduce, rank 1 calls broadcast"
    assert "ranks 0, 2 wait in all_reduce #3" in got.lines[1]
    assert "rank 1 in broadcast #3" in got.lines[1]
    assert got.desync == (3,)


def test_mismatched_sizes_and_dtypes_are_named() -> None:
    """The same op at one number with other sizes or dtypes is a mismatch, each side said."""
    dumps = _dumps("stop")
    data = json.loads(dumps[2])
    data["entries"][-1]["input_sizes"] = [[500]]
    data["entries"][-1]["input_dtypes"] = ["Double"]
    dumps[2] = json.dumps(data)
    got = collectives.analyse(dumps, [0, 1, 2])
    assert got.lines[0] == ("mismatch at all_reduce #3: rank 0 1000 float32, "
                            "rank 2 500 float64"), got.lines
    assert got.desync == (3,)


def test_ranks_that_completed_everything_say_nothing() -> None:
    """Every rank completed every collective it entered: no line (nothing waits)."""
    got = collectives.analyse(_dumps("none"), [0, 1, 2])
    assert not got and got.text() == ""


@pytest.mark.parametrize("garbage", ["", "{", "[" * 5000, '{"entries": 5}', "\xff\xfe",
                                     '{"entries": [{"collective_seq_id": "x"}]}'])
def test_garbage_dumps_are_left_out(garbage: str) -> None:
    """A dump that cannot be read counts as no collectives, never an exception."""
    assert collectives.parse(garbage) == []
    assert not collectives.analyse({0: garbage, 1: garbage}, [0, 1])


def test_a_rank_without_a_dump_is_one_that_entered_nothing() -> None:
    """A rank that gave no dump while others wait is named as never having entered."""
    dumps = _dumps("stop", (0, 2))
    got = collectives.analyse(dumps, [0, 1, 2])
    assert "rank 1 never entered it (its last: no record: it ended, or its recorder is off)" \
        in got.text()


def test_stacks_lead_with_the_collectives_line() -> None:
    """The stacks' text starts with the collectives line and says where the raw dumps are."""
    taken = stacks.Stacks.from_dumps("j1", {}, {}, 0.1, None, _dumps("stop"), [0, 1, 2])
    taken.saved = "flight recorder dumps: /x"
    text = taken.text()
    assert text.splitlines()[0].startswith("collectives: ranks 0, 2 wait in all_reduce #3")
    assert "(flight recorder dumps: /x)" in text
    assert taken.summary().startswith("collectives: ")
    quiet = stacks.Stacks.from_dumps("j1", {}, {}, 0.1, None, _dumps("none"), [0, 1, 2])
    assert "collectives" not in quiet.text()


def test_raw_dumps_are_written_for_torchs_analyser(tmp_path: Path) -> None:
    """The dumps go to ``flight-recorder/rank_R`` in the pickle format torch's fr_trace reads,
    and torch's own loader reads them back."""
    said = logfiles.write_flight_records(str(tmp_path), _dumps("stop"))
    folder = tmp_path / logfiles.FLIGHT_RECORDS
    assert said == f"flight recorder dumps: {folder}"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1", "rank_2"]
    assert (folder.stat().st_mode & 0o777) == 0o700
    with open(folder / "rank_1", "rb") as f:
        assert pickle.load(f)["entries"][-1]["collective_seq_id"] == 2
    loader = pytest.importorskip("torch.distributed.flight_recorder.components.loader")
    import argparse

    details, version = loader.read_dir(argparse.Namespace(trace_dir=str(folder), prefix=None))
    assert len(details) == 3 and version


def test_a_link_in_place_of_a_dump_is_not_followed(tmp_path: Path) -> None:
    """A symlink where a dump goes is refused with the path, its target untouched."""
    folder = tmp_path / logfiles.FLIGHT_RECORDS
    folder.mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_text("keep")
    (folder / "rank_0").symlink_to(target)
    said = logfiles.write_flight_records(str(tmp_path), _dumps("stop", (0,)))
    assert said.startswith("the flight recorder dumps were not written"), said
    assert target.read_text() == "keep"


def test_recorder_env_turns_it_on_and_off() -> None:
    """The recorder's variable: the entries asked, 0 for off."""
    assert collectives.recorder_env(256) == {"TORCH_FR_BUFFER_SIZE": "256"}
    assert collectives.recorder_env(0) == {"TORCH_FR_BUFFER_SIZE": "0"}


def _report(rank: int, durations: list[float], torch: str = "2.13.0",
            host: str = "h") -> dict[str, object]:
    sizes = [1024 << (2 * i) for i in range(len(durations))]
    return {"rank": rank, "host": host, "versions": {"python": "3.11.0", "torch": torch,
                                                       "cuda": "", "nbdist": "0.1.0"},
            "gpus": [], "free_gb": 50.0, "sweep": list(zip(sizes, durations, strict=True)),
            "error": "", "clock": 100.0}


def test_check_names_the_rank_that_reaches_each_all_reduce_late() -> None:
    """The rank the others wait for (it waits least) is named with its host; bus bandwidth
    comes from the all-reduce's own time."""
    reports = {0: _report(0, [0.301, 0.302, 0.305]), 1: _report(1, [0.001, 0.002, 0.005],
                                                                 host="slowhost"),
               2: _report(2, [0.300, 0.303, 0.304])}
    got = check.judge(reports, 3, {"python": "3.11.0"}, {0: 100.1, 1: 100.1, 2: 100.1})
    assert any(p.startswith("rank 1 on slowhost is the slowest") for p in got.problems), got
    n, t, bw = got.sweep[0]
    assert (n, t) == (1024, 0.001) and bw == pytest.approx(1024 / 0.001 * 4 / 3)
    assert got.text().splitlines()[-1].startswith("  rank 1 on slowhost is the slowest")


def test_check_of_equal_ranks_finds_nothing_and_names_a_version_that_differs() -> None:
    """Ranks that wait alike are healthy; a torch that differs on one rank is named."""
    even = {r: _report(r, [0.001, 0.002]) for r in range(2)}
    assert check.judge(even, 2).ok
    odd = {0: _report(0, [0.001, 0.002]), 1: _report(1, [0.001, 0.002], torch="2.12.0")}
    got = check.judge(odd, 2, {}, failed={})
    assert got.problems == ["torch differs between the ranks: rank 0 2.13.0, rank 1 2.12.0"]


def test_check_names_a_failed_rank_and_a_clock_that_is_off() -> None:
    """A rank that failed and one whose clock is seconds off are said."""
    got = check.judge({0: _report(0, [0.001])}, 2, {}, {0: 90.0},
                      failed={1: "Traceback...\nRuntimeError: boom"})
    assert "rank 1 failed: RuntimeError: boom" in got.problems
    assert any("its clock is +10.0 s off" in p for p in got.problems), got.problems


def test_a_ranks_gloo_and_nccl_recorders_are_read_as_one() -> None:
    """A CUDA build keeps NCCL's collectives in a recorder of its own: the rank's dump joins
    its entries to gloo's (a second group here), and garbage from either is left out."""
    from nbdist.rank import flight

    gloo = (DATA / "stop-0.json").read_bytes()
    nccl = json.loads(gloo)
    for e in nccl["entries"]:
        e["profiling_name"] = e["profiling_name"].replace("gloo:", "nccl:")
        e["process_group"] = ["1", "nccl"]
        e["pg_id"] = 1
    merged = flight._merge([gloo, json.dumps(nccl).encode()])
    calls = collectives.parse(merged)
    assert {c.backend for c in calls} == {"gloo", "nccl"}
    assert len(calls) == 2 * len(collectives.parse(gloo))
    assert flight._merge([gloo, b"\xff not json"]) == json.dumps(json.loads(gloo)).encode()
    assert flight._merge([gloo]) == gloo and flight._merge([]) == b""


def test_a_subgroups_wavefront_is_its_members_own() -> None:
    """A rank outside a process group (the groups the ranks' dumps name) is never said to
    have missed its collectives; garbage in that key is ignored."""
    def with_groups(dump: str, groups: object) -> str:
        return json.dumps({**json.loads(dump), "nbdist_groups": groups})

    dumps = {r: with_groups(d, {"0": [0, 2]}) for r, d in _dumps("stop").items()}
    got = collectives.analyse(dumps, [0, 1, 2])
    assert got.lines[0].startswith("ranks 0, 2 wait in all_reduce #3"), got.lines
    assert "never entered" not in got.text() and got.missing == ()
    assert collectives.members(with_groups(_dumps("stop")[0], {"0": "x", "1": [1, "2"]})) == \
        {"1": (1,)}
    assert collectives.members(b"\xff") == {} and collectives.members("[1]") == {}
    garbled = {r: with_groups(d, [0, 2]) for r, d in _dumps("stop").items()}
    assert collectives.analyse(garbled, [0, 1, 2]).missing == (1,)

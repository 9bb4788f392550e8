"""``nbdist.shard``: each rank's part of a table (docs/data.md). The arithmetic and the reader
alone, then real local ranks reading a notebook's pandas DataFrame, pyarrow Table and Parquet
files through ``%%distributed``: disjoint and complete shards, equal shards under DDP, epochs,
and bad input refused before launch."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pd = pytest.importorskip("pandas")
pq = pytest.importorskip("pyarrow.parquet")

from nbdist import data  # noqa: E402 - after the skips: it needs pyarrow
from nbdist import job as jobs  # noqa: E402
from nbdist.errors import CaptureError  # noqa: E402
from nbdist.rank.shard import ShardError, plan_from_path, shard, shard_range  # noqa: E402

from .helpers import run  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _rows(s: Any) -> list[int]:
    return [v for batch in s for v in batch.column("i").to_pylist()]


@pytest.fixture
def nb(ip: Any) -> Iterator[Any]:
    """The shared shell, with the names a test defines removed (and their exports with them)."""
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]
    ip.run_cell("pass")  # IPython's Out/_ references go with the next cells
    gc.collect()


# -- the arithmetic ------------------------------------------------------------------------------
@pytest.mark.parametrize("total", [1, 7, 8, 9, 100, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranges_cover_every_row_once(total: int, world: int) -> None:
    """Without equal, the ranks' ranges tile the table and differ by at most one row."""
    if total < world:
        return
    ranges = [shard_range(total, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = {stop - start for start, stop, _ in ranges}
    assert max(sizes) - min(sizes) <= 1 and all(rep == 0 for *_, rep in ranges)


@pytest.mark.parametrize(("total", "world"), [(10, 3), (9, 3), (1001, 8), (5, 5)])
def test_equal_modes_give_every_rank_the_same_rows(total: int, world: int) -> None:
    """equal=True drops fewer rows than ranks, equal='pad' repeats fewer rows than ranks, and
    either way every rank has the same count."""
    drop = [shard_range(total, r, world, True) for r in range(world)]
    assert len({stop - start for start, stop, _ in drop}) == 1
    assert 0 <= total - sum(stop - start for start, stop, _ in drop) < world
    pad = [shard_range(total, r, world, "pad") for r in range(world)]
    assert len({stop - start + rep for start, stop, rep in pad}) == 1
    assert sum(stop - start for start, stop, _ in pad) == total
    assert 0 <= sum(rep for *_, rep in pad) < world


def test_bad_arguments_are_named() -> None:
    """A bad equal mode, batch size or column, an empty table and fewer rows than ranks are
    clear errors."""
    table = pa.table({"i": list(range(3))})
    with pytest.raises(ValueError, match="equal='half'"):
        shard(table, equal="half")
    with pytest.raises(ValueError, match="batch_size=0"):
        shard(table, batch_size=0)
    with pytest.raises(ShardError, match=r"no column\(s\) \['y'\]"):
        shard(table, columns=["y"])
    with pytest.raises(ShardError, match="is empty"):
        shard(table.slice(0, 0))
    with pytest.raises(ShardError, match="has 3 rows for 4 ranks"):
        shard(table, rank=0, world_size=4)
    with pytest.raises(TypeError, match="cannot read a builtins.dict"):
        shard({"i": [1]})
    with pytest.raises(ShardError, match="no such file or directory"):
        shard("/nonexistent/nbdist.parquet")


# -- reading ------------------------------------------------------------------------------------
def test_parquet_directory_is_read_in_order_and_streamed(tmp_path: Path) -> None:
    """A directory of Parquet files with several row groups is one table in file order; each
    rank's batches have batch_size rows, and only the asked columns."""
    for part in range(3):
        start = part * 1000
        table = pa.table({"i": list(range(start, start + 1000)), "x": [0.5] * 1000})
        pq.write_table(table, tmp_path / f"part-{part:05d}.parquet", row_group_size=300)
    (tmp_path / "_SUCCESS").write_text("")
    plan = plan_from_path(tmp_path)
    assert plan.num_rows == 3000 and len(plan.pieces) == 12
    shards = [shard(tmp_path, rank=r, world_size=4, batch_size=128, columns=["i"])
              for r in range(4)]
    assert [_rows(s) for s in shards] == [list(range(r * 750, (r + 1) * 750))
                                          for r in range(4)]
    batches = list(shards[1].batches())
    assert [b.num_rows for b in batches] == [128] * 5 + [110] and len(shards[1]) == 6
    assert batches[0].schema.names == ["i"]


def test_arrow_file_and_in_memory_tables(tmp_path: Path) -> None:
    """An Arrow IPC file, a pyarrow Table and a pandas DataFrame give the same shards."""
    table = pa.table({"i": list(range(2001))})
    path = tmp_path / "t.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=300):
            w.write_batch(batch)
    for source in (path, str(path), table, table.to_pandas()):
        assert [_rows(shard(source, rank=r, world_size=3, batch_size=64)) for r in range(3)] \
            == [list(range(667)), list(range(667, 1334)), list(range(1334, 2001))]


def test_epochs_repeat_the_rows_and_shuffle_by_seed() -> None:
    """Each iteration is an epoch with the same rows; shuffled, the order changes per epoch
    and is the same for the same seed and epoch."""
    table = pa.table({"i": list(range(5000))})
    plain = shard(table, rank=1, world_size=2, batch_size=100)
    assert _rows(plain) == _rows(plain) == list(range(2500, 5000))
    mixed = shard(table, rank=1, world_size=2, batch_size=100, shuffle=True, seed=7)
    first, second = _rows(mixed), _rows(mixed)
    assert sorted(first) == sorted(second) == list(range(2500, 5000))
    assert first != second and first != list(range(2500, 5000))
    again = shard(table, rank=1, world_size=2, batch_size=100, shuffle=True, seed=7)
    assert _rows(again) == first and mixed.epoch == 2
    again.set_epoch(1)
    assert _rows(again) == second


@pytest.mark.slow
def test_pandas_and_torch_helpers() -> None:
    """.pandas() yields DataFrames per batch; .torch() a dataset of column tensors, or
    (features, label) pairs, one item per batch."""
    torch = pytest.importorskip("torch")
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "b": [5.0, 6.0, 7.0, 8.0],
                          "y": [0, 1, 0, 1]})
    s = shard(frame, rank=1, world_size=2, batch_size=1)
    assert [f.to_dict("list") for f in s.pandas()] == [
        {"a": [3.0], "b": [7.0], "y": [0]}, {"a": [4.0], "b": [8.0], "y": [1]}]
    whole = shard(frame, batch_size=4)
    (item,) = list(whole.torch())
    assert torch.equal(item["y"], torch.tensor([0, 1, 0, 1]))
    ((x, y),) = list(whole.torch(features=["a", "b"], label="y"))
    assert x.dtype == torch.float32 and x.tolist() == [[1, 5], [2, 6], [3, 7], [4, 8]]
    loader = torch.utils.data.DataLoader(whole.torch(columns=["a"]), batch_size=None)
    assert [b["a"].tolist() for b in loader] == [[1.0, 2.0, 3.0, 4.0]]


def test_an_export_missing_on_the_rank_says_how_to_share_it(tmp_path: Path) -> None:
    """A plan whose files this host does not have names the file and the setting to change."""
    frame = pd.DataFrame({"i": range(10)})
    plan = data.plan_for(frame, "frame")
    for piece in plan.pieces:
        os.remove(piece.path)
    with pytest.raises(ShardError, match=r"the export of pandas DataFrame 'frame' is not on "
                                         r"this host .*spark\.nbdist\.shard\.dir"):
        shard(plan)


# -- the kernel's exports ------------------------------------------------------------------------
def test_export_is_made_once_and_removed_with_the_table() -> None:
    """A pandas DataFrame is exported once, again only after it changed in place, and its
    export is removed when the frame is garbage-collected or nbdist unloaded; unconvertible
    columns and empty frames are named."""
    frame = pd.DataFrame({"i": range(100)})
    plan = data.plan_for(frame, "frame")
    (directory,) = [d for d in data.exports() if plan.pieces[0].path.startswith(d)]
    assert data.plan_for(frame, "frame") is plan
    frame.loc[0, "i"] = -1
    changed = data.plan_for(frame, "frame")
    assert changed is not plan and not os.path.exists(directory)
    (directory,) = [d for d in data.exports() if changed.pieces[0].path.startswith(d)]
    del frame
    gc.collect()
    assert not os.path.exists(directory)
    with pytest.raises(data.DataError, match="column 'bad' .* cannot be converted to Arrow"):
        data.plan_for(pd.DataFrame({"ok": [1, 2], "bad": [1, "x"]}), "odd")
    with pytest.raises(data.DataError, match="is empty"):
        data.plan_for(pd.DataFrame({"i": []}), "none")
    kept = pd.DataFrame({"i": range(5)})
    path = data.plan_for(kept, "kept").pieces[0].path
    data.forget_all()  # what %unload_ext nbdist does
    assert not os.path.exists(path) and data.exports() == []


def test_exports_of_killed_kernels_are_swept(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel's first export removes those a killed kernel on this host left (its pid is
    gone), and keeps those of kernels still running."""
    import socket
    import subprocess
    import sys

    monkeypatch.setenv(data.SHARD_DIR_ENV, str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    dead = tmp_path / f"{data._prefix(host, gone.pid)}abc_1"
    alive = tmp_path / f"{data._prefix(host, os.getppid())}abc_2"
    other = tmp_path / f"{data._prefix(host + '-2', gone.pid)}abc_3"
    for d in (dead, alive, other):
        (d / "parquet").mkdir(parents=True)
    frame = pd.DataFrame({"i": range(3)})
    plan = data.plan_for(frame, "frame")
    assert plan.pieces[0].path.startswith(str(tmp_path))
    assert not dead.exists() and alive.exists() and other.exists()
    del frame
    gc.collect()


# -- on real ranks -------------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_read_disjoint_complete_shards_of_a_notebook_frame(nb: Any) -> None:
    """Three local ranks each read their part of a notebook pandas DataFrame (not shipped
    whole: the cell's data holds only the plan), together every row once; a pyarrow Table and
    a Parquet path work the same."""
    nb.user_ns["frame"] = pd.DataFrame({"i": range(30_001), "pad": ["x" * 100] * 30_001})
    nb.user_ns["table"] = pa.table({"i": list(range(1000))})
    run(nb, """%%distributed -np 3 -o parts
import nbdist
s = nbdist.shard(frame, batch_size=4096)
t = nbdist.shard(table, equal=True)
(sorted(v for b in s for v in b.column("i").to_pylist()), s.num_rows, len(s),
 [b.num_rows for b in t])
""")
    parts = nb.user_ns["parts"]
    rows = [p[0] for p in parts]
    assert sorted(v for r in rows for v in r) == list(range(30_001))
    assert [len(r) for r in rows] == [p[1] for p in parts] == [10_000, 10_000, 10_001]
    assert [p[2] for p in parts] == [3, 3, 3]
    assert [p[3] for p in parts] == [[333]] * 3
    job = jobs.jobs()[-1]
    assert job.state.np == 3


@pytest.mark.slow
def test_equal_shards_let_ddp_end_on_every_rank(nb: Any) -> None:
    """With equal=True, DDP over a 1001-row frame on 3 ranks in batches of 111 takes the same
    number of steps everywhere and the job ends (unequal shards, 333 and 334 rows, give rank 0
    one step fewer and leave the others waiting in all_reduce)."""
    pytest.importorskip("torch")
    nb.user_ns["frame"] = pd.DataFrame({"x": [float(i % 7) for i in range(1001)],
                                        "y": [float(i % 7) * 2 for i in range(1001)]})
    run(nb, """%%distributed -np 3 -o steps --timeout 100
import torch, torch.distributed as dist
import nbdist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = nbdist.shard(frame, equal=True, batch_size=111, shuffle=True, seed=1)
steps = 0
for epoch in range(2):
    for x, y in data.torch(features=["x"], label="y"):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x).squeeze(1), y.float()).backward()
        opt.step()
        steps += 1
dist.destroy_process_group()
steps, data.num_rows, data.dropped
""")
    assert nb.user_ns["steps"] == [(6, 333, 2)] * 3


@pytest.mark.slow
def test_parquet_path_in_a_cell(nb: Any, tmp_path: Path) -> None:
    """A Parquet directory named by its path is read by each rank itself, in batches."""
    for part in range(2):
        pq.write_table(pa.table({"i": list(range(part * 50, part * 50 + 50))}),
                       tmp_path / f"part-{part}.parquet")
    nb.user_ns["where"] = str(tmp_path)
    run(nb, "%%distributed -np 2 -o got\nimport nbdist\n"
            "[b.column('i').to_pylist() for b in nbdist.shard(where, batch_size=30)]\n")
    assert nb.user_ns["got"] == [[list(range(30)), list(range(30, 50))],
                                 [list(range(50, 80)), list(range(80, 100))]]


def test_bad_tables_are_refused_before_launch(nb: Any) -> None:
    """An unconvertible column, an empty frame and fewer rows than ranks are refused before any
    rank starts, naming the variable and the column or the numbers."""
    started = len(jobs.jobs())
    nb.user_ns["odd"] = pd.DataFrame({"ok": [1, 2, 3], "mixed": [1, "two", 3.0]})
    nb.user_ns["none"] = pd.DataFrame({"i": pd.Series([], dtype="int64")})
    nb.user_ns["few"] = pd.DataFrame({"i": [1, 2]})
    cases = {
        "odd": (CaptureError, "nbdist.shard(odd): column 'mixed' (object) cannot be converted"),
        "none": (CaptureError, "nbdist.shard(none): pandas DataFrame 'none' is empty"),
        "few": (Exception, "nbdist.shard(few): pandas DataFrame 'few' has 2 rows for 3 ranks"),
    }
    for name, (kind, says) in cases.items():
        result = nb.run_cell(f"%%distributed -np 3\nimport nbdist\nnbdist.shard({name})\n")
        error = result.error_in_exec
        assert isinstance(error, kind) and says in str(error), error
    assert len(jobs.jobs()) == started


def test_a_frame_used_otherwise_is_shipped_as_before() -> None:
    """Capture sends the plan only for names the cell reads through nbdist.shard alone."""
    from nbdist.capture import capture_cell

    frame = pd.DataFrame({"i": range(10)})
    ns = {"frame": frame}
    sharded = capture_cell("import nbdist\nnbdist.shard(frame, equal=True)\n", ns)
    assert list(sharded.shards) == ["frame"] and sharded.shards["frame"].num_rows == 10
    both = capture_cell("import nbdist\nnbdist.shard(frame)\nlen(frame)\n", ns)
    assert both.shards == {} and [v.name for v in both.values] == ["frame"]


def test_without_pyarrow_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Without pyarrow, nbdist.shard raises an ImportError naming the extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'nbdist\[data\]'"):
        shard("/any/path.parquet")

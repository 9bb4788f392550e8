"""``nbdist.shard``: on a rank, its part of a table, streamed as Arrow record batches.

The table is a :class:`ShardPlan` (what the kernel made of a notebook DataFrame: Arrow or
Parquet files and the rows of each of their pieces, ``nbdist/data.py``), a Parquet or Arrow
file or directory, a pyarrow Table or a pandas DataFrame. Rank ``r`` of ``N`` reads rows
``[r * total // N, (r + 1) * total // N)`` of it (:func:`shard_range`): every row exactly once
across the ranks, shards that differ by at most one row. ``equal=True`` (``"drop"``) drops the
last ``total % N`` rows (fewer than N) so that every rank has ``total // N``; ``equal="pad"``
repeats a shard's first row on the ranks one short, so that every rank has
``ceil(total / N)``. Either way every rank then has the same number of batches, so a DDP loop
ends on the same step everywhere (unequal ones hang at the last step).

Memory is bounded by one piece of the files (a Parquet row group, an Arrow record batch) and
one batch: a shard is never read whole. Reading it again (another epoch) gives the same rows;
with ``shuffle=True`` in another order per epoch, from ``seed`` and the epoch (the order of
its pieces, and of the rows within each piece).

This module runs on the rank and imports pyarrow only when a shard is read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

#: The rows of one batch unless ``batch_size`` says otherwise.
DEFAULT_BATCH_ROWS = 1024
#: ``equal`` values: False (the shards differ by at most one row), drop, pad.
EQUAL_MODES = ("drop", "pad")


class ShardError(ValueError):
    """A table that cannot be sharded as asked (empty, fewer rows than ranks, missing files)."""


@dataclass(frozen=True)
class Piece:
    """A unit of a file read at once: a Parquet row group or an Arrow IPC record batch."""

    path: str
    kind: str  # "parquet" or "arrow"
    index: int
    rows: int


@dataclass(frozen=True)
class ShardPlan:
    """A table as it travels to the ranks: its files' pieces in order (the rows of the table,
    numbered from the first piece's first row), and where it came from for messages."""

    pieces: tuple[Piece, ...]
    columns: tuple[str, ...]
    origin: str  # "Spark DataFrame 'df'", "pandas DataFrame 'pdf'", a path

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.pieces)

    def check_ranks(self, world_size: int, name: str = "...") -> None:
        """Raise :class:`ShardError` if the table has fewer rows than ``world_size`` ranks."""
        if self.num_rows < world_size:
            raise ShardError(
                f"nbdist.shard({name}): {self.origin} has {self.num_rows} rows for "
                f"{world_size} ranks; every rank needs at least one row (use fewer ranks, or "
                f"more data)")


def shard_range(total: int, rank: int, world_size: int, equal: str | bool = False
                ) -> tuple[int, int, int]:
    """Rank ``rank``'s rows of ``total`` as ``(start, stop, repeat)``: it reads rows
    ``[start, stop)`` and then repeats its first ``repeat`` rows (``equal="pad"`` only)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    mode = _equal_mode(equal)
    if mode == "drop":
        each = total // world_size
        return rank * each, (rank + 1) * each, 0
    start, stop = rank * total // world_size, (rank + 1) * total // world_size
    if mode == "pad":
        return start, stop, -(-total // world_size) - (stop - start)
    return start, stop, 0


def _equal_mode(equal: str | bool) -> str | None:
    if equal is True:
        return "drop"
    if equal is False or equal is None:
        return None
    if equal not in EQUAL_MODES:
        raise ValueError(f"equal={equal!r}: use True (or 'drop': drop the last rows, fewer "
                         f"than the ranks), 'pad' (repeat a row on the ranks one short) or "
                         f"False")
    return str(equal)


# -- reading a table's pieces --------------------------------------------------------------------
def plan_from_path(path: str | os.PathLike[str], origin: str | None = None) -> ShardPlan:
    """The plan of a Parquet or Arrow IPC file, or of a directory of them (Spark's
    ``df.write.parquet`` output: its ``part-*`` files in name order). Reads footers only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.fspath(path)
    origin = origin or repr(path)
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and not os.path.basename(f).startswith(("_", "."))
                       and not f.endswith(".crc"))
        if not files:
            raise ShardError(f"{origin}: the directory {path} has no data files (on a cluster "
                             f"it must be on storage every host reads)")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ShardError(f"{origin}: no such file or directory {path!r} on this host (on a "
                         f"cluster it must be on storage every host reads)")
    pieces: list[Piece] = []
    columns: tuple[str, ...] | None = None
    for f in files:
        if _is_arrow(f):
            with pa.memory_map(f) as source:
                reader = pa.ipc.open_file(source)
                names = tuple(reader.schema.names)
                for i in range(reader.num_record_batches):
                    pieces.append(Piece(f, "arrow", i, reader.get_batch(i).num_rows))
        else:
            try:
                meta = pq.ParquetFile(f).metadata
            except Exception as exc:
                raise ShardError(f"{origin}: {f} is neither a Parquet nor an Arrow IPC file "
                                 f"({exc})") from None
            names = tuple(meta.schema.to_arrow_schema().names)
            pieces.extend(Piece(f, "parquet", i, meta.row_group(i).num_rows)
                          for i in range(meta.num_row_groups))
        if columns is None:
            columns = names
        elif names != columns:
            raise ShardError(f"{origin}: {f} has the columns {list(names)}, the files before "
                             f"it {list(columns)}: every file must have the same ones")
    return ShardPlan(tuple(p for p in pieces if p.rows), columns or (), origin)


def _is_arrow(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(6) == b"ARROW1"


class _Files:
    """Open files, kept while a shard is read (one open per file and epoch, not per piece)."""

    def __init__(self, columns: Sequence[str] | None) -> None:
        self.columns = list(columns) if columns is not None else None
        self._open: dict[str, Any] = {}

    def read(self, piece: Piece, start: int, stop: int, batch_rows: int
             ) -> Iterator[pa.RecordBatch]:
        """Rows ``[start, stop)`` of a piece, in batches of at most ``batch_rows``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        handle = self._open.get(piece.path)
        if piece.kind == "arrow":
            if handle is None:
                handle = self._open[piece.path] = pa.ipc.open_file(pa.memory_map(piece.path))
            batch = handle.get_batch(piece.index).slice(start, stop - start)
            if self.columns is not None:
                batch = batch.select(self.columns)
            yield batch
            return
        if handle is None:
            handle = self._open[piece.path] = pq.ParquetFile(piece.path)
        seen = 0
        for batch in handle.iter_batches(batch_size=batch_rows, row_groups=[piece.index],
                                         columns=self.columns, use_threads=False):
            lo, hi = max(start - seen, 0), min(stop - seen, batch.num_rows)
            seen += batch.num_rows
            if hi > lo:
                yield batch.slice(lo, hi - lo)
            if seen >= stop:
                break

    def close(self) -> None:
        self._open.clear()


# -- the shard -----------------------------------------------------------------------------------
class Shard:
    """This rank's part of a table (what :func:`shard` returns).

    Iterating it yields ``pyarrow.RecordBatch``es of ``batch_size`` rows (the last may be
    shorter); each iteration is the next epoch (:meth:`set_epoch` sets it, as torch's
    ``DistributedSampler``). ``len(shard)`` is its number of batches, the same on every rank
    with ``equal``. :meth:`pandas` yields pandas DataFrames, :meth:`torch` gives a torch
    ``IterableDataset``.
    """

    def __init__(self, plan: ShardPlan, *, rank: int, world_size: int,
                 equal: str | bool, batch_size: int, columns: Sequence[str] | None,
                 shuffle: bool, seed: int, table: pa.Table | None = None) -> None:
        self.plan = plan
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.columns = list(columns) if columns is not None else None
        self.epoch = 0
        self._table = table  # an in-memory table, read through its batches
        total = plan.num_rows
        self.total_rows = total
        self.start, self.stop, self.repeat = shard_range(total, rank, world_size, equal)
        #: rows of the table no rank reads (equal="drop") / rows read twice (equal="pad")
        mode = _equal_mode(equal)
        self.dropped = total - world_size * (total // world_size) if mode == "drop" else 0
        self.repeated = -total % world_size if mode == "pad" else 0

    @property
    def num_rows(self) -> int:
        """The rows this rank reads per epoch."""
        return self.stop - self.start + self.repeat

    def __len__(self) -> int:
        return -(-self.num_rows // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (its order, with ``shuffle``)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        epoch = self.epoch
        self.epoch += 1
        return self.batches(epoch)

    def batches(self, epoch: int | None = None) -> Iterator[pa.RecordBatch]:
        """The shard's rows as record batches of ``batch_size`` rows, in epoch ``epoch``'s
        order (the current one by default; it does not advance the epoch)."""
        return _rebatch(self._slices(self.epoch if epoch is None else epoch), self.batch_size)

    def pandas(self, epoch: int | None = None) -> Iterator[Any]:
        """The shard as pandas DataFrames, one per batch."""
        for batch in self.batches(epoch):
            yield batch.to_pandas()

    def torch(self, columns: Sequence[str] | None = None, *,
              features: Sequence[str] | None = None, label: str | None = None,
              dtype: Any = None) -> Any:
        """A torch ``IterableDataset`` of the shard, one item per batch (use it with
        ``DataLoader(ds, batch_size=None)``): a dict of column → tensor, or with ``features``
        (and ``label``) a float tensor of those columns side by side (and the label's tensor).
        Each iteration is the next epoch; DataLoader workers take every k-th batch."""
        from nbdist.rank.shard_torch import ShardDataset

        return ShardDataset(self, columns=columns, features=features, label=label,
                            dtype=dtype)

    def __repr__(self) -> str:
        extra = (f", {self.dropped} rows dropped for equal shards" if self.dropped else
                 f", {self.repeated} rows repeated for equal shards" if self.repeated else "")
        return (f"<nbdist shard of {self.plan.origin}: rank {self.rank} of {self.world_size}, "
                f"rows {self.start}..{self.stop - 1} of {self.total_rows}{extra}, "
                f"{len(self)} batches of {self.batch_size}>")

    # -- the rows, as slices of the table's pieces
    def _slices(self, epoch: int) -> Iterator[pa.RecordBatch]:
        spans = self._spans()
        rng = None
        if self.shuffle:
            import numpy as np

            rng = np.random.default_rng([self.seed, epoch])
            spans = [spans[i] for i in rng.permutation(len(spans))]
        files = _Files(self.columns)
        try:
            first: pa.RecordBatch | None = None
            for piece, lo, hi in spans:
                for batch in self._read(files, piece, lo, hi):
                    if rng is not None:
                        batch = batch.take(rng.permutation(batch.num_rows))
                    if first is None:
                        first = batch
                    yield batch
            if self.repeat and first is not None:
                yield first.slice(0, self.repeat)
        finally:
            files.close()

    def _spans(self) -> list[tuple[Piece, int, int]]:
        spans, offset = [], 0
        for piece in self.plan.pieces:
            lo, hi = max(self.start - offset, 0), min(self.stop - offset, piece.rows)
            if hi > lo:
                spans.append((piece, lo, hi))
            offset += piece.rows
            if offset >= self.stop:
                break
        return spans

    def _read(self, files: _Files, piece: Piece, lo: int, hi: int
              ) -> Iterator[pa.RecordBatch]:
        if self._table is None:
            return files.read(piece, lo, hi, self.batch_size)
        batch = self._table.slice(piece.index, piece.rows).slice(lo, hi - lo)
        if self.columns is not None:
            batch = batch.select(self.columns)
        return iter(batch.to_batches())


def _rebatch(slices: Iterator[pa.RecordBatch], size: int) -> Iterator[pa.RecordBatch]:
    """Slices cut and joined into batches of ``size`` rows (the last may be shorter)."""
    buf: list[pa.RecordBatch] = []
    held = 0
    for batch in slices:
        while batch.num_rows:
            take = min(size - held, batch.num_rows)
            buf.append(batch.slice(0, take))
            held += take
            batch = batch.slice(take)
            if held == size:
                yield _joined(buf)
                buf, held = [], 0
    if held:
        yield _joined(buf)


def _joined(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    """One batch of ``batches``' rows. Through a table, not ``pa.concat_batches``: that came
    with pyarrow 19, and Databricks' LTS runtimes have pyarrow 14 (the spark35 leg found it)."""
    import pyarrow as pa

    if len(batches) == 1:
        return batches[0]
    joined: list[pa.RecordBatch] = pa.Table.from_batches(batches).combine_chunks().to_batches()
    return joined[0]


# -- the entry point -----------------------------------------------------------------------------
def shard(source: Any, *, equal: str | bool = False, batch_size: int = DEFAULT_BATCH_ROWS,
          columns: Sequence[str] | None = None, shuffle: bool = False, seed: int = 0,
          rank: int | None = None, world_size: int | None = None) -> Shard:
    """This rank's part of a table, streamed as ``pyarrow.RecordBatch``es.

    Parameters
    ----------
    source
        In a ``%%distributed`` cell: a Spark DataFrame, pandas DataFrame or pyarrow Table of
        the notebook (the kernel exports it once; the ranks read their rows of the export,
        never the whole table), or a Parquet / Arrow IPC file or directory every rank can read.
        A pandas DataFrame or pyarrow Table made on the rank works too.
    equal : bool or {"drop", "pad"}
        Give every rank the same number of rows, so the same number of batches: ``True``
        (``"drop"``) leaves out the last ``total % world_size`` rows, ``"pad"`` repeats a row
        on the ranks one short. Default ``False``: the shards differ by at most one row.
    batch_size : int
        Rows per record batch (the last of the shard may be shorter).
    columns : sequence of str, optional
        Read only these columns.
    shuffle, seed : bool, int
        Read each epoch in another order, the same on every run for the same ``seed``; the
        rows of each rank stay the same.
    rank, world_size : int, optional
        Default: ``RANK`` and ``WORLD_SIZE`` from the environment (0 and 1 outside a job).

    Returns
    -------
    Shard
        Iterable of record batches (each iteration the next epoch); ``.pandas()``,
        ``.torch()``, ``len()`` (batches), ``.num_rows``.
    """
    require_pyarrow()
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: a positive number of rows")
    _equal_mode(equal)
    table = None
    if isinstance(source, ShardPlan):
        plan = source
        _check_files(plan)
    elif isinstance(source, str | os.PathLike):
        plan = plan_from_path(source)
    else:
        table = _as_table(source)
        if table is None:
            raise TypeError(_not_a_table(source))
        chunk = max(1, min(65536, table.num_rows))
        plan = ShardPlan(tuple(Piece("", "table", i, min(chunk, table.num_rows - i))
                               for i in range(0, table.num_rows, chunk)),
                         tuple(table.schema.names), f"a {type(source).__name__}")
    if columns is not None:
        missing = [c for c in columns if c not in plan.columns]
        if missing:
            raise ShardError(f"nbdist.shard: {plan.origin} has no column(s) {missing}; it has "
                             f"{list(plan.columns)}")
    if plan.num_rows == 0:
        raise ShardError(f"nbdist.shard: {plan.origin} is empty: there are no rows to share")
    plan.check_ranks(world_size)
    return Shard(plan, rank=rank, world_size=world_size, equal=equal, batch_size=batch_size,
                 columns=columns, shuffle=shuffle, seed=seed, table=table)


def require_pyarrow() -> None:
    """Raise an ImportError that says how to install pyarrow, if it is missing."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"nbdist.shard needs pyarrow in the kernel and on every rank ({exc}): "
                          f"pip install 'nbdist[data]' (pyarrow and pandas)") from None


def _check_files(plan: ShardPlan) -> None:
    """Fail with the fix when the export of a notebook table is not on this rank's host."""
    missing = sorted({p.path for p in plan.pieces if not os.path.exists(p.path)})
    if missing:
        import socket

        raise ShardError(
            f"nbdist.shard: the export of {plan.origin} is not on this host "
            f"({socket.gethostname()}): {missing[0]}"
            f"{f' and {len(missing) - 1} more files' if len(missing) > 1 else ''} missing. "
            f"The ranks read it where the kernel wrote it: set the Spark conf "
            f"spark.nbdist.shard.dir (or NBDIST_SHARD_DIR in the kernel's environment) to "
            f"storage every host mounts, e.g. /dbfs/tmp/nbdist (docs/data.md)")


def _as_table(source: Any) -> pa.Table | None:
    module = type(source).__module__ or ""
    if module.startswith("pyarrow"):
        import pyarrow as pa

        if isinstance(source, pa.Table):
            return source
        if isinstance(source, pa.RecordBatch):
            return pa.Table.from_batches([source])
    if module.startswith("pandas") and type(source).__name__ == "DataFrame":
        import pyarrow as pa

        return pa.Table.from_pandas(source, preserve_index=False)
    return None


def _not_a_table(source: Any) -> str:
    kind = f"{type(source).__module__}.{type(source).__qualname__}"
    if kind.startswith("pyspark"):
        return (f"nbdist.shard: a Spark DataFrame is read through the notebook: use "
                f"nbdist.shard(df) in a %%distributed cell, with df a notebook variable ({kind} "
                f"reached the rank some other way)")
    return (f"nbdist.shard: cannot read a {kind}; give it a Spark or pandas DataFrame, a "
            f"pyarrow Table, or the path of a Parquet or Arrow IPC file or directory")

"""The kernel's side of ``nbdist.shard(df)``: a notebook table made into a :class:`ShardPlan`.

A cell that uses a notebook DataFrame only as ``nbdist.shard(df)`` does not ship it: capture
asks :func:`plan_for` for the table's plan, which the ranks read their rows of
(``rank/shard.py``). The table is exported once, here:

- a **Spark DataFrame** is written by Spark's executors as Parquet (``df.write.parquet``)
  into the staging directory: the rows never pass through the driver, which reads only the
  files' footers (their row counts);
- a **pandas DataFrame** or **pyarrow Table** (already in the kernel's memory) is written as
  one Arrow IPC file of 64 Ki-row record batches, which the ranks memory-map.

The export is made once per table object and kept while the object lives (later cells, epochs,
restarts and sessions read the same files; a pandas DataFrame changed in place is exported
again); it is removed when the object is garbage-collected or the kernel exits. It is a
snapshot: a Spark DataFrame whose source table changes is read again only through a new
DataFrame object.

The staging directory must be readable by every rank: the kernel's temporary directory by
default (local ranks; a Spark cluster on this machine), else ``NBDIST_SHARD_DIR`` or the
Spark conf ``spark.nbdist.shard.dir`` (storage every host mounts: ``/dbfs/tmp/...``, NFS).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from nbdist.rank.shard import ShardError, ShardPlan, plan_from_path, require_pyarrow

#: Rows per record batch of an Arrow export (the unit a rank reads at once).
EXPORT_BATCH_ROWS = 65536
#: Where exports go when neither ``NBDIST_SHARD_DIR`` nor the Spark conf says.
SHARD_DIR_ENV = "NBDIST_SHARD_DIR"
SHARD_DIR_CONF = "spark.nbdist.shard.dir"


class DataError(ValueError):
    """A notebook table that cannot be sharded: the message names the variable and why."""


@dataclass
class _Export:
    plan: ShardPlan
    directory: str
    fingerprint: Any


_exports: dict[int, _Export] = {}
_lock = threading.Lock()


def kind(value: Any) -> str | None:
    """``"spark"``, ``"ray"``, ``"pandas"`` or ``"arrow"`` for a table :func:`plan_for` takes,
    else None
    (by the type's module and name: nothing is imported to ask)."""
    for cls in type(value).__mro__:
        module = (getattr(cls, "__module__", "") or "").partition(".")[0]
        name = getattr(cls, "__qualname__", "")
        if module == "pyspark" and name == "DataFrame":
            return "spark"
        if module == "pandas" and name == "DataFrame":
            return "pandas"
        if module == "pyarrow" and name in ("Table", "RecordBatch"):
            return "arrow"
        if module == "ray" and name == "Dataset":
            return "ray"
    return None


def plan_for(value: Any, name: str) -> ShardPlan:
    """The plan of notebook variable ``name``'s table, exported once (see the module's text).

    Raises :class:`DataError` for a table that cannot be sharded: an empty one, a column Arrow
    cannot convert, a Spark DataFrame of another SparkSession.
    """
    what = kind(value)
    if what is None:
        raise DataError(f"nbdist.shard({name}): {name} is a {type(value).__name__}, not a "
                        f"Spark or pandas DataFrame, a Ray Dataset or a pyarrow Table")
    require_pyarrow()
    fingerprint = _fingerprint(value) if what == "pandas" else None
    with _lock:
        done = _exports.get(id(value))
        if done is not None and done.fingerprint == fingerprint:
            return done.plan
    root = _root(value, what)
    _sweep(root)
    directory = tempfile.mkdtemp(prefix=f"{_prefix(socket.gethostname(), os.getpid())}",
                                 dir=root)
    try:
        plan = (_export_spark(value, name, directory) if what == "spark" else
                _export_ray(value, name, directory) if what == "ray" else
                _export_arrow(value, name, what, directory))
        if plan.num_rows == 0:
            raise DataError(f"nbdist.shard({name}): {plan.origin} is empty: there are no rows "
                            f"to share among the ranks")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    with _lock:
        old = _exports.pop(id(value), None)
        _exports[id(value)] = _Export(plan, directory, fingerprint)
    if old is not None:
        shutil.rmtree(old.directory, ignore_errors=True)
    else:
        weakref.finalize(value, _forget, id(value))
    return plan


def exports() -> list[str]:
    """The export directories kept now (for tests and ``%unload_ext``)."""
    with _lock:
        return [e.directory for e in _exports.values()]


def forget_all() -> None:
    """Remove every export (``%unload_ext nbdist``)."""
    with _lock:
        gone = list(_exports.values())
        _exports.clear()
    for e in gone:
        shutil.rmtree(e.directory, ignore_errors=True)


def _forget(key: int) -> None:
    with _lock:
        gone = _exports.pop(key, None)
    if gone is not None:
        shutil.rmtree(gone.directory, ignore_errors=True)


def _prefix(host: str, pid: int) -> str:
    """Export directories start with the kernel's host and pid: a later kernel on that host
    removes those of kernels that are gone without running their exit handlers (killed)."""
    return f"nbdist-shard-{host}-{pid}-"


def _sweep(root: str) -> None:
    """Remove the exports in ``root`` of this host's kernels that no longer run."""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(glob.escape(root), glob.escape(_prefix(host, 0)[:-2])
                                       + "*")):
        # ``<pid>-<mkdtemp's suffix>`` exactly (not another host whose name starts the same)
        rest = os.path.basename(path)[len(_prefix(host, 0)) - 2:]
        found = re.fullmatch(r"(\d+)-[a-z0-9_]+", rest)
        if found is None or int(found.group(1)) == os.getpid():
            continue
        pid = found.group(1)
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # alive, another user's


def _root(value: Any, what: str) -> str:
    root = os.environ.get(SHARD_DIR_ENV)
    if not root and what == "spark":
        try:
            root = value.sparkSession.conf.get(SHARD_DIR_CONF, None)
        except Exception:
            root = None
    root = root or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return root


def _fingerprint(frame: Any) -> Any:
    """What tells a pandas DataFrame changed in place: its shape, columns and a hash of its
    rows (vectorised; None, so exported every time, when a cell holds an unhashable value)."""
    import pandas as pd

    try:
        rows = int(pd.util.hash_pandas_object(frame, index=False).sum())
    except TypeError:
        return object()  # equal to nothing: export again
    return frame.shape, tuple(map(str, frame.columns)), tuple(map(str, frame.dtypes)), rows


# -- pandas and pyarrow --------------------------------------------------------------------------
def _export_arrow(value: Any, name: str, what: str, directory: str) -> ShardPlan:
    import pyarrow as pa

    if what == "pandas":
        table = _from_pandas(value, name)
        origin = f"pandas DataFrame {name!r}"
    else:
        table = pa.Table.from_batches([value]) if isinstance(value, pa.RecordBatch) else value
        origin = f"pyarrow Table {name!r}"
    path = os.path.join(directory, "table.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=EXPORT_BATCH_ROWS):
            writer.write_batch(batch)
    return plan_from_path(path, origin)


def _from_pandas(frame: Any, name: str) -> Any:
    import pyarrow as pa

    errors = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)
    try:
        return pa.Table.from_pandas(frame, preserve_index=False)
    except errors as exc:
        whole = str(exc)
    for column in frame.columns:  # which one: Arrow's message does not always say
        try:
            pa.Table.from_pandas(frame[[column]], preserve_index=False)
        except errors as exc:
            raise DataError(
                f"nbdist.shard({name}): column {column!r} ({frame[column].dtype}) cannot be "
                f"converted to Arrow: {exc}. Convert it (e.g. {name}[{column!r}] = "
                f"{name}[{column!r}].astype(str)) or leave it out") from None
    raise DataError(f"nbdist.shard({name}): the DataFrame cannot be converted to Arrow: "
                    f"{whole}")


# -- Spark ---------------------------------------------------------------------------------------
def _export_spark(df: Any, name: str, directory: str) -> ShardPlan:
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is None or df.sparkSession is not active:
        raise DataError(
            f"nbdist.shard({name}): {name} belongs to another SparkSession than the active "
            f"one ({'none is active' if active is None else 'spark'}); the ranks read through "
            f"the active session: make the DataFrame again from it (spark.table(...), "
            f"spark.read...)")
    _check_schema(df, name)
    out = os.path.join(directory, "parquet")
    # The executors write their partitions; the driver sees only the commit: flat in memory.
    df.write.parquet("file://" + out if "://" not in out else out)
    return _read_export(out, f"Spark DataFrame {name!r}", name, "The executors")


def _export_ray(ds: Any, name: str, directory: str) -> ShardPlan:
    """Ray's workers write the Dataset as Parquet (streamed, block by block): its rows never
    pass through the kernel, which reads the files' footers only."""
    out = os.path.join(directory, "parquet")
    ds.write_parquet(out)
    if not os.path.isdir(out) or not os.listdir(out):
        if ds.count() == 0:
            raise DataError(f"nbdist.shard({name}): Ray Dataset {name!r} is empty: there are "
                            f"no rows to share among the ranks")
    return _read_export(out, f"Ray Dataset {name!r}", name, "Ray's workers")


def _read_export(out: str, origin: str, name: str, writers: str) -> ShardPlan:
    try:
        return plan_from_path(out, origin)
    except ShardError as exc:
        raise DataError(
            f"nbdist.shard({name}): {exc}. {writers} wrote the export to {out}, which the "
            f"kernel cannot read: set {SHARD_DIR_ENV} (or, on Spark, {SHARD_DIR_CONF}) to "
            f"storage every host mounts (e.g. /dbfs/tmp/nbdist, an NFS folder)") from None


def _check_schema(df: Any, name: str) -> None:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType

    for field in df.schema.fields:
        try:
            to_arrow_schema(StructType([field]))
        except Exception as exc:
            raise DataError(
                f"nbdist.shard({name}): column {field.name!r} ({field.dataType.simpleString()}) "
                f"has no Arrow type ({type(exc).__name__}: {exc}); select the other columns or "
                f"cast it ({name}.withColumn({field.name!r}, "
                f"{name}[{field.name!r}].cast('string')))") from None


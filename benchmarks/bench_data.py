"""``nbdist.shard(df)`` benchmark: ranks reading a Spark DataFrame, and the driver's memory.

A DataFrame of ``--rows`` rows and 8 columns (one ``id``, seven doubles) is read by ``--np``
ranks on a standalone Spark cluster (tests/sparks.py's: a master and two workers on this
machine), three ways, in the same run, interleaved:

1. **nbdist.shard** — the cell uses ``nbdist.shard(df, batch_size=4096)``: capture has the
   executors export the DataFrame as Parquet (once), the ranks (Spark barrier tasks) read
   their rows as record batches and touch every column (a sum). Two epochs: the first
   includes the export, the second re-reads (what a training's later epochs cost).
2. **toPandas() + slicing** (the baseline) — ``pdf = df.toPandas()`` on the driver, then the
   same job with ``pdf`` shipped to every rank, which slices its rows and touches them in
   batches of 4096.
3. **TorchDistributor's DataFrame path** — ``TorchDistributor(local_mode=False)
   ._train_on_dataframe(fn, df)``: each task writes its partition to an Arrow file;
   ``fn`` reads it with ``_get_spark_partition_data_loader`` in batches of 4096.

Reported per contender: the wall time from the call in the notebook to the job's end, the
rows per second *per rank* that gives (the rank's rows / that time), the ratio to the baseline,
and the driver's peak memory above what it held before, the notebook's Python process and its
JVM apart (sampled every 20 ms during the read). Each measurement runs in a fresh driver
process, so that one contender's grown JVM heap does not hide the next one's. Goal (issue 28):
the driver flat, not proportional to the table.

The issue asks for 10 M rows; this 2-core machine, shared with other work, runs 1 M by default
(``--rows 10000000`` for the full size).

Usage::

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/bench_data.py [--quick] [--rows N]

Results: ``benchmarks/results/data.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 4096

SHARD_CELL = """
import time, nbdist
start = time.perf_counter()
s = nbdist.shard(df, batch_size=4096)
total = 0.0
for epoch in range(2):
    for batch in s:
        total += sum(batch.column(i).to_numpy().sum() for i in range(batch.num_columns))
    if epoch == 0:
        first = time.perf_counter() - start
(s.num_rows, first, time.perf_counter() - start - first, total)
"""

PANDAS_CELL = """
import os, time
r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mine = pdf.iloc[r * len(pdf) // n:(r + 1) * len(pdf) // n]
total = 0.0
for i in range(0, len(mine), 4096):
    total += float(mine.iloc[i:i + 4096].to_numpy().sum())
(len(mine), total)
"""


class Peak:
    """The peak resident memory of this process (the notebook's Python) and of its children
    (Spark's driver JVM), sampled every 20 ms, above what they held at the start."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> tuple[int, int]:
        import psutil

        jvm = 0
        for p in self._me.children(recursive=True):
            try:
                jvm += p.memory_info().rss
            except psutil.Error:
                pass
        return self._me.memory_info().rss, jvm

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            py, jvm = self._rss()
            self.peak = (max(self.peak[0], py), max(self.peak[1], jvm))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> dict[str, int]:
        return {"py": self.peak[0] - self.base[0], "jvm": self.peak[1] - self.base[1]}


def make_df(spark: Any, rows: int) -> Any:
    cols = ["id"] + [f"cast(id * {k} % 1000 as double) as c{k}" for k in range(1, 8)]
    return spark.range(0, rows, numPartitions=8).selectExpr(*cols)


def run_cell(cell: str, ns: dict[str, Any], np: int, times: dict[str, float] | None = None
             ) -> list[Any]:
    from nbdist import job as jobs
    from nbdist.capture import capture_cell
    from nbdist.options import JobOptions

    start = time.perf_counter()
    captured = capture_cell(cell, ns, warn_bytes=1 << 62)
    captured_at = time.perf_counter()
    job = jobs.start(captured.payload(), np, JobOptions(backend="spark", gpu=False))
    job.result()
    if times is not None:
        times["capture"] = captured_at - start
        times["job"] = time.perf_counter() - captured_at
    return job.results


def nbdist_shard(spark: Any, rows: int, np: int) -> dict[str, Any]:
    df = make_df(spark, rows)
    with Peak() as peak:
        start = time.perf_counter()
        times: dict[str, float] = {}
        results = run_cell(SHARD_CELL, {"df": df}, np, times)
        wall = time.perf_counter() - start
    from nbdist import data

    del df
    import gc

    gc.collect()
    assert not data.exports()
    per_rank = max(r[0] for r in results)
    return {"wall": wall, "rows_per_rank": per_rank, "growth": peak.growth,
            "epoch1": max(r[1] for r in results), "epoch2": max(r[2] for r in results),
            **times}


def to_pandas(spark: Any, rows: int, np: int) -> dict[str, Any]:
    df = make_df(spark, rows)
    with Peak() as peak:
        start = time.perf_counter()
        pdf = df.toPandas()
        collected = time.perf_counter() - start
        times: dict[str, float] = {}
        results = run_cell(PANDAS_CELL, {"pdf": pdf}, np, times)
        wall = time.perf_counter() - start
    del pdf
    return {"wall": wall, "rows_per_rank": max(r[0] for r in results), "growth": peak.growth,
            "toPandas": collected, **times}


def _td_train(rows_per_rank: int) -> int:
    from pyspark.ml.torch.distributor import _get_spark_partition_data_loader

    loader = _get_spark_partition_data_loader(rows_per_rank, 4096, num_workers=0)
    seen = 0
    for batch in loader:
        seen += len(batch[0])
    return seen


def torch_distributor(spark: Any, rows: int, np: int) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    df = make_df(spark, rows)
    per_rank = rows // np
    with Peak() as peak:
        start = time.perf_counter()
        TorchDistributor(num_processes=np, local_mode=False, use_gpu=False)._train_on_dataframe(
            _td_train, df.repartition(np), per_rank)
        wall = time.perf_counter() - start
    return {"wall": wall, "rows_per_rank": per_rank, "growth": peak.growth}


BASELINE = "toPandas() + slicing (baseline)"
CONTENDERS: dict[str, Callable[[Any, int, int], dict[str, Any]]] = {
    BASELINE: to_pandas,
    "nbdist.shard": nbdist_shard,
    "TorchDistributor._train_on_dataframe": torch_distributor,
}


def start_cluster() -> Any:
    from tests.sparks import Cluster

    cluster = Cluster(Path(tempfile.mkdtemp(prefix="nbdist-bench-data-")),
                      {**os.environ, "PYSPARK_PYTHON": sys.executable})
    cluster.launch()
    cluster.wait()
    return cluster


def one(name: str, master: str, rows: int, np: int) -> dict[str, Any]:
    """In a fresh process (a fresh driver JVM too): one contender's measurement."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors run this Python (nbdist)
    spark = (SparkSession.builder.master(master).appName(f"nbdist-bench-data-{name}")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.executor.cores", "2").config("spark.cores.max", "4")
             .config("spark.executor.memory", "1g")
             .getOrCreate())
    try:
        # Warm for everyone alike: the executors, the ranks' imports, and the JVM's one-time
        # costs of each path (a first Arrow collect, a first Parquet write: 10-15 s each here,
        # paid once per Spark application, which on a notebook's cluster lives for hours).
        make_df(spark, 1000).toPandas()
        run_cell(SHARD_CELL, {"df": make_df(spark, 1000)}, np)
        return CONTENDERS[name](spark, rows, np)
    finally:
        spark.stop()


def run_child(name: str, master: str, rows: int, np: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--one", name, master, str(rows), str(np)],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run each, 200 k rows")
    parser.add_argument("--rows", type=int, default=None, help="rows (default 1 M)")
    parser.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--reps", type=int, default=None, help="runs each (default 3)")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, master, rows_, np_ = args.one
        print(json.dumps(one(name, master, int(rows_), int(np_))))
        return 0
    rows = args.rows or (200_000 if args.quick else 1_000_000)
    reps = args.reps or (1 if args.quick else 3)
    cluster = start_cluster()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    try:
        for _ in range(reps):  # interleaved, so that a busy spell of the machine hits all alike
            for name in CONTENDERS:
                runs[name].append(run_child(name, cluster.url, rows, args.np))
                print(name, runs[name][-1], flush=True)
    finally:
        cluster.stop()
    base = statistics.median(r["wall"] for r in runs[BASELINE])
    size_mb = rows * 8 * 8 / 1e6
    lines = [f"{rows:,} rows x 8 columns ({size_mb:.0f} MB as 8-byte values) read by {args.np} "
             f"ranks (Spark barrier tasks) on a standalone cluster (a master and two workers on "
             f"this machine); each measurement in a fresh driver (Python and JVM), warmed alike; "
             f"medians of {reps}, interleaved.", "",
             "| contender | wall s | rows/s per rank | time vs baseline | driver Python peak "
             "growth | driver JVM peak growth |", "| --- | --- | --- | --- | --- | --- |"]
    for name, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        per_rank = statistics.median(r["rows_per_rank"] for r in rs)
        py = statistics.median(r["growth"]["py"] for r in rs)
        jvm = statistics.median(r["growth"]["jvm"] for r in rs)
        lines.append(f"| {name} | {wall:.2f} | {per_rank / wall:,.0f} | {wall / base:.2f}x | "
                     f"{py / 2**20:.0f} MiB | {jvm / 2**20:.0f} MiB |")
    epoch2 = statistics.median(r["epoch2"] for r in runs["nbdist.shard"])
    lines += ["", f"nbdist.shard's second epoch (the export reused): {epoch2:.2f} s on the "
              f"slowest rank, {rows // args.np / epoch2:,.0f} rows/s per rank."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.md").write_text(text)
    (out / "data.json").write_text(json.dumps({"rows": rows, "np": args.np, "runs": runs},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

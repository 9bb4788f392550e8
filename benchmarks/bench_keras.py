"""TensorFlow/Keras benchmark: what TF_CONFIG's port reservation costs, and TF jobs' launch.

Scenarios, medians with the ratio to a baseline measured in the same run:

1. **reservation, per rank** — what every supervisor now does in its hello (bind a free port on
   all interfaces, hold it, release it when the rank starts) against ``channel.free_port()``,
   which rank 0 already paid for MASTER_PORT (baseline). Microseconds per call.
2. **a job that does not use TF** — a trivial job on 4 local ranks, run right after the
   previous one (forked from a warm zygote: the launch is at its shortest, so a fixed cost shows
   most), with the reservation as shipped against the same job without it (baseline: every
   supervisor's ``_reserve_port`` replaced by one that reserves nothing).
3. **a tf.keras MWMS job** — 2 ranks, 2 epochs on digits: cold (a new zygote imports
   TensorFlow while the ranks meet; baseline), the second run (forked from that zygote), and
   with ``NBDIST_ZYGOTE=0`` (every rank a fresh interpreter that imports TensorFlow itself).

Usage::

    .venv/bin/python benchmarks/bench_keras.py [--reps 15] [--quick]

Scenario 3 needs ``nbdist[tf]``; without it the scenario is reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_launch import save, scenario, zygotes  # noqa: E402  (the shared table helpers)

import nbdist  # noqa: E402
from nbdist import channel  # noqa: E402
from nbdist.launch import local  # noqa: E402
from nbdist.rank import supervisor  # noqa: E402

TF_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def rank_of() -> str:
    import os

    return os.environ["RANK"]


def mwms_fit() -> float:
    import tensorflow as tf
    from sklearn.datasets import load_digits

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = load_digits(return_X_y=True)
    data = tf.data.Dataset.from_tensor_slices((x / 16.0, y)).batch(64)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"),
                                     tf.keras.layers.Dense(10)])
        model.compile(optimizer="sgd",
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return float(model.fit(data, epochs=2, verbose=0).history["loss"][-1])


# -- 1. the reservation itself -------------------------------------------------------------------
def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def reserve_and_release() -> None:
    sock = supervisor._reserve_port()
    if sock is not None:
        sock.close()


def reservation(reps: int, calls: int) -> dict[str, Any]:
    contenders: dict[str, Callable[[], Any]] = {
        "channel.free_port() (rank 0's MASTER_PORT)": channel.free_port,
        "supervisor._reserve_port() + release (every rank, TF_CONFIG)": reserve_and_release}
    times: dict[str, list[float]] = {c: [] for c in contenders}
    for _ in range(reps):
        for label, fn in contenders.items():
            times[label].append(per_call_us(fn, calls))
    medians = {c: statistics.median(t) for c, t in times.items()}
    base = medians["channel.free_port() (rank 0's MASTER_PORT)"]
    rows = [(c, f"{m:.1f} µs", f"{m / base:.2f}×", len(times[c])) for c, m in medians.items()]
    return {"scenario": f"1. the port reservation, per rank ({calls} calls per run)",
            "baseline": "channel.free_port()", "rows": rows, "samples": times, "errors": {}}


# -- 2. and 3. whole jobs ------------------------------------------------------------------------
@contextlib.contextmanager
def reserving(on: bool) -> Iterator[None]:
    """Supervisors reserve a TF port (as shipped), or reserve nothing (no TF_CONFIG)."""
    saved = supervisor._reserve_port
    if not on:
        supervisor._reserve_port = lambda: None
    try:
        yield
    finally:
        supervisor._reserve_port = saved


def warm_trivial(reserve: bool) -> float:
    with reserving(reserve):
        start = time.perf_counter()
        values = nbdist.run(rank_of, np=4, backend="local").results
        elapsed = time.perf_counter() - start
    assert values == ["0", "1", "2", "3"]
    return elapsed


def tf_job(cold: bool, zygote: bool = True) -> float:
    """One MWMS job; ``cold``: no zygote or warm interpreter left from an earlier job."""
    if cold:
        local.pool.clear()
    with zygotes(zygote):
        start = time.perf_counter()
        nbdist.run(mwms_fit, np=2, backend="local", env=TF_ENV).result()
        elapsed = time.perf_counter() - start
        local.pool.wait_ready(timeout=120)  # the next run finds TensorFlow imported
    return elapsed


def tf_second_run(zygote: bool) -> float:
    tf_job(cold=True, zygote=zygote)
    return tf_job(cold=False, zygote=zygote)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    results = [reservation(reps, 200 if args.quick else 2000)]
    warm_trivial(True)  # the zygote of this environment, warm for scenario 2
    results.append(scenario(
        "2. a job that does not use TF: 4 local ranks, forked from a warm zygote",
        {"without the reservation": lambda: warm_trivial(False),
         "with the reservation (as shipped)": lambda: warm_trivial(True)},
        "without the reservation", reps,
    ))
    local.pool.clear()
    tf_contenders: dict[str, Callable[[], float]] = {
        "cold (a new zygote imports TensorFlow)": lambda: tf_job(cold=True),
        "second run (forked from that zygote)": lambda: tf_second_run(zygote=True),
        "NBDIST_ZYGOTE=0, second run (fresh interpreters, warm ones when ready)":
            lambda: tf_second_run(zygote=False),
    }
    if importlib.util.find_spec("tf_keras") is None:
        tf_contenders = {}  # reported below as not run
    results.append(scenario(
        "3. tf.keras MWMS, 2 epochs on digits, 2 local ranks",
        tf_contenders, "cold (a new zygote imports TensorFlow)", 1 if args.quick else 3,
    ) if tf_contenders else {"scenario": "3. tf.keras MWMS (not run: pip install nbdist[tf])",
                             "baseline": "-", "rows": [], "samples": {}, "errors": {}})
    local.pool.clear()
    save("keras", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Spark Connect benchmark: nbdist on a Connect session against TorchDistributor on the same
Connect server, and against nbdist on a classic session, in the same run.

One Spark Connect server (pyspark's ``SparkConnectServer``, ``local[2]``, on 127.0.0.1) and one
classic ``local[2]`` session, each driven by a child process of this script (a Connect client
and a classic session cannot share a process). The job is the trivial one of
``bench_launch.py``: ``import torch``, ``init_process_group("gloo")``, a barrier, return the
rank; np = 2, CPU.

- **first run**: the first nbdist job of each application (no executor zygote yet), and
  TorchDistributor's first on the Connect server; one measurement each, in the same run.
- **later runs**: ``--reps`` rounds, the contenders taking turns in every round; medians, with
  the ratio to TorchDistributor on Connect (baseline) measured in the same run.

Usage::

    .venv/bin/python benchmarks/bench_connect.py [--reps 5]

Needs pyspark's Connect client (``pip install -e '.[connect]'``) and Java. The tables go to
``benchmarks/results/connect.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONF = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}


def trivial() -> int:
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    rank = int(os.environ["RANK"])
    dist.destroy_process_group()
    return rank


# -- a child: one session, jobs on request -------------------------------------------------------
def serve(kind: str, url: str) -> None:
    """Take ``nbdist`` / ``td`` lines on stdin, run that job, answer its seconds on stdout."""
    from pyspark.sql import SparkSession

    import nbdist

    if kind == "connect":
        spark = SparkSession.builder.remote(url).getOrCreate()
    else:
        builder = SparkSession.builder.master("local[2]").appName("nbdist-bench-classic")
        for key, value in CONF.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
    spark.range(2, numPartitions=2).collect()  # the application is up, its executor too
    print("ready", flush=True)
    for line in sys.stdin:
        what = line.strip()
        start = time.perf_counter()
        if what == "nbdist":
            nbdist.run(trivial, np=2, backend="spark").result()
        elif what == "td":
            from pyspark.ml.torch.distributor import TorchDistributor

            TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(trivial)
        else:
            break
        print(json.dumps(time.perf_counter() - start), flush=True)
    spark.stop()


class Child:
    def __init__(self, kind: str, url: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--url", url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # Spark's own start-up lines go to stderr
            if line.strip() == "ready":
                return
        raise RuntimeError(f"the {kind} child did not start")

    def run(self, what: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return float(json.loads(self.proc.stdout.readline()))

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    import pyspark

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--class",
            "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", "local[2]",
            "--name", "nbdist-bench-connect"]
    for key, value in {**CONF, "spark.connect.grpc.binding.address": "127.0.0.1",
                       "spark.connect.grpc.binding.port": str(port)}.items():
        argv += ["--conf", f"{key}={value}"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"sc://127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the Spark Connect server did not start") from None
            time.sleep(0.2)  # a JVM starting: nothing to wait on but its port


def table(title: str, baseline: str, rows: dict[str, list[float]]) -> dict[str, Any]:
    base = statistics.median(rows[baseline])
    out = []
    for name, values in rows.items():
        med = statistics.median(values)
        out.append((name, f"{med:.2f} s", f"{med / base:.2f}×", len(values)))
    return {"scenario": title, "baseline": baseline, "rows": out}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--serve", choices=("connect", "classic"))
    parser.add_argument("--url", default="")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.url)
        return 0
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    server, url = start_server(env)
    children: list[Child] = []
    try:
        connect = Child("connect", url, env)
        children.append(connect)
        classic = Child("classic", url, env)
        children.append(classic)
        first = {
            "TorchDistributor on Connect": [connect.run("td")],
            "nbdist on Connect": [connect.run("nbdist")],
            "nbdist on a classic session": [classic.run("nbdist")],
        }
        later: dict[str, list[float]] = {name: [] for name in first}
        for _ in range(args.reps):
            later["TorchDistributor on Connect"].append(connect.run("td"))
            later["nbdist on Connect"].append(connect.run("nbdist"))
            later["nbdist on a classic session"].append(classic.run("nbdist"))
    finally:
        for child in children:
            child.stop()
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    results = [table("first run (fresh application)", "TorchDistributor on Connect", first),
               table(f"later runs ({args.reps} rounds)", "TorchDistributor on Connect", later)]
    lines = []
    for res in results:
        lines += [f"### {res['scenario']} (baseline: {res['baseline']})", "",
                  "| contender | median | vs baseline | runs |", "| --- | --- | --- | --- |"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in res["rows"]]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "connect.md").write_text(text)
    (out / "connect.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

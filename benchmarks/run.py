"""Run every benchmark, one after another, and collect their tables in one markdown file.

    .venv/bin/python benchmarks/run.py [--quick] [--only launch,streaming,...]

Each ``bench_*.py`` here is also a script of its own; they run one at a time (never in
parallel: they would compete for the same cores) and each measures its baseline in the same
run. Output: ``benchmarks/results/<name>.json`` and ``.md`` from each, and
``benchmarks/results/RESULTS.md`` with all of them and the machine they ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["capture", "launch", "streaming", "training", "faults", "scale", "session", "pull",
           "hostile", "keras", "restart", "bad_hour", "data", "collectives"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    parser.add_argument("--only", help="comma-separated subset of: " + ",".join(BENCHES))
    args = parser.parse_args()
    names = args.only.split(",") if args.only else BENCHES
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {BENCHES}")
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
           "PYSPARK_PYTHON": sys.executable}
    sections = [
        "# nbdist benchmark results\n",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.platform()}, Python "
        f"{platform.python_version()}, {os.cpu_count()} cores\n",
    ]
    failed = []
    for name in names:
        cmd = [sys.executable, str(HERE / f"bench_{name}.py")]
        if args.quick and name != "faults":
            cmd.append("--quick")
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True)
        if proc.returncode != 0:
            failed.append(name)
            sys.stderr.write(proc.stderr[-3000:])
        md = HERE / "results" / f"{name}.md"
        text = md.read_text() if md.exists() else proc.stdout
        sections.append(f"## {name}\n\n{text}\n")
        print(text, flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "RESULTS.md").write_text("\n".join(sections))
    if failed:
        print(f"benchmarks that failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

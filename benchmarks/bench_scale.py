"""Scale on paper: what 64, 256 or 1024 ranks cost the driver's event server and panel.

Simulated ranks (256 by default; ``--ranks 64,256,1024`` runs each size in a process of its
own and writes one table) connect to a real :class:`nbdist.events.EventServer` from one separate
process: cheap ranks (no rank processes), but each talks through the supervisor's own
:class:`nbdist.rank.client.EventClient`, coalescing included. Each sends ``--rate`` events per
second (an output batch, a progress update and a metrics update in turn, a heartbeat every
``HEARTBEAT_S``, and a resources sample every ``resources.SAMPLE_S`` as a supervisor sends,
unless ``--no-resources``) for ``--seconds``. Measured in the driver process, which runs only
the server, a real ``JobState`` and the ranks' log files (``nbdist.logfiles``, written as a
job writes them): CPU time per second of wall time (as % of one core)
while the ranks send, and over the run and the job's end together (every rank closing at once:
its CPU is also given alone, in ms, as a job pays it once), the job's start alone (from the
rendezvous to every rank's first line in, its log file opened), against the same process idle for
the same time (the baseline), and resident memory per rank,
during the run and once every rank's log ring is full. The newest progress and metrics of
every rank must be in the state at the end (coalescing may only skip superseded updates), and
no event lost.

The panel is attached (unless ``--no-panel``): a real ``nbdist.views.widget.Panel`` on its own
thread, rendering as in a notebook; widgets without a front end send nothing, so its messages
and their bytes are counted here, and once the job ends every rank's newest progress must be
in the panel (its host groups list every rank). Ranks sit 8 to a host (``node-0``, ...), as on
8-GPU machines, so the panel and reports group them as they would on a cluster.

The rendezvous is timed as a job does it: every simulated rank says hello as a supervisor does
(rank 0 offering MASTER_PORT, every rank a TensorFlow port); once all have, the driver plans the
world (``world.plan_world``) and sends each rank its environment. Reported: the driver's CPU
for the plan and for the sends, and the wall time from the first hello to the last rank
holding its environment.

With ``--metrics N`` (issue 16) every event a rank sends is a report of N metrics instead
(heartbeats apart), and ``--charts`` renders the panel's charts in the driver from the job's
series (``nbdist.views.charts.ChartsView``, polled ten times a second under the job's lock as
the panel does): what it costs, how many redraws and how many bytes they would send.

    .venv/bin/python benchmarks/bench_scale.py [--ranks 256] [--rate 10] [--seconds 20]
    .venv/bin/python benchmarks/bench_scale.py --ranks 64,256,1024 --seconds 10
    .venv/bin/python benchmarks/bench_scale.py --metrics 5 --charts
    .venv/bin/python benchmarks/bench_scale.py --ranks 1024 --baseline main --rounds 3

``--baseline REF`` measures git revision REF's ``nbdist`` (extracted from this checkout) beside
this one, runs interleaved and the order swapped every round, so that both see the same load
on a shared machine; the comparison table gives each one's median driver CPU per size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil

import nbdist
from nbdist import channel, events, logfiles
from nbdist.state import LOG_LINES, JobState
from nbdist.world import Hello, plan_world

ROOT = Path(__file__).resolve().parent.parent

CLIENTS = textwrap.dedent("""
    import json, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from nbdist import resources
    from nbdist.rank import supervisor as rank
    from nbdist.rank.client import EventClient
    host, port, job, secret, ranks, rate, seconds, with_res, metrics = sys.argv[1:10]
    ranks, rate, seconds, metrics = int(ranks), float(rate), float(seconds), int(metrics)
    sample = max(1, round(resources.SAMPLE_S * rate)) if with_res == "1" else 0
    res = {"t": "res", "cpu": 187.5, "rss": 1234567890}
    # The supervisor's own client, with its coalescing: each simulated rank is one EventClient,
    # connecting at the same time as the others, as the ranks of a job do.
    world_at = [0.0] * ranks  # when each rank got its environment (time.monotonic)
    world = threading.Semaphore(0)
    def connect(r):
        def on_message(message, r=r):
            if message.get("t") == "world":
                world_at[r] = time.monotonic()
                world.release()
        hello = {"host": f"node-{r // 8}", "cpus": 64, "tf_port": 20000 + r % 8}
        if r == 0:
            hello["port"] = 29500
        return EventClient((host, int(port)), job, r, secret, hello, on_message)
    with ThreadPoolExecutor(64) as pool:
        clients = list(pool.map(connect, range(ranks)))
    for _ in range(ranks):
        world.acquire(timeout=60)
    for r, c in enumerate(clients):  # a rank's first line, as it starts (its log file opens)
        c.send({"t": "out", "s": "o", "text": f"rank {r} starts\\n"})
    kinds = [
        lambda i: {"t": "out", "s": "o", "text": f"step {i} loss 0.123\\n"},
        lambda i: {"t": "progress", "id": 1, "n": i, "total": 1000, "desc": "train"},
        lambda i: {"t": "metrics", "values": {"loss": 0.1, "step": i}},
    ]
    if metrics:  # a report of `metrics` values on every tick, the first one the tick itself
        kinds = [lambda i: {"t": "metrics", "step": i, "values": {
            "step": i, **{f"m{k}": 1.0 / (i + k + 1) for k in range(1, metrics)}}}]
    beat = max(1, round(rank.HEARTBEAT_S * rate))  # ticks between a rank's heartbeats
    print("connected", flush=True)
    start = time.monotonic(); i = 0; sent = 0
    last = [{} for _ in clients]  # the newest progress and metrics step sent by each rank
    while time.monotonic() - start < seconds:
        for r, c in enumerate(clients):
            # Heartbeats replace one tick's event, spread over the ranks, so the rate holds.
            event = {"t": "hb"} if (i + r) % beat == 0 else kinds[i % len(kinds)](i)
            c.send(event)
            if sample and (i + r) % sample == 0:  # besides the tick's event, as a sampler does
                c.send(res)
            if event["t"] in ("progress", "metrics"):
                last[r][event["t"]] = i
        sent += len(clients)
        i += 1
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
    print("closing", flush=True)
    closing = [threading.Thread(target=c.close) for c in clients]  # as ranks end: together
    for t in closing:
        t.start()
    for t in closing:
        t.join()
    print(json.dumps({"sent": sent, "dropped": sum(c.dropped for c in clients),
                      "last": last, "world_last": max(world_at),
                      "world_missing": world_at.count(0.0)}), flush=True)
""")


class Channel:
    """The job's side of the channel, as ``nbdist.job.Job`` has it: events go to the state
    and output also to the ranks' log files, and the rendezvous once every rank said hello
    (``Job.on_connect``)."""

    def __init__(self, job: JobState, server: events.EventServer,
                 logs: logfiles.RankLogs) -> None:
        self.job = job
        self.server = server
        self.logs = logs
        self.received = 0
        self.gone = threading.Semaphore(0)  # released once per closed connection
        self.hellos: dict[int, Hello] = {}
        self.first_hello = 0.0  # time.monotonic()
        self.plan_cpu_s = 0.0
        self.send_cpu_s = 0.0
        self.world_bytes = 0
        self.world_cpu_s = 0.0

    def on_connect(self, rank: int, hello: dict[str, object]) -> None:
        h = Hello.from_event(rank, hello)
        self.job.apply(rank, {"t": "hello", "host": h.host, "gpus": list(h.gpus)})
        self.hellos[rank] = h
        if len(self.hellos) == 1:
            self.first_hello = time.monotonic()
        if len(self.hellos) < self.job.np:
            return
        t0 = time.thread_time()
        envs = plan_world(self.hellos, self.job.np, "run", "bench")
        t1 = time.thread_time()
        for rank_, env in envs.items():
            message = {"t": "world", "env": env}
            self.world_bytes += len(channel.encode(message))
            self.server.send("bench", rank_, message)
        self.plan_cpu_s, self.send_cpu_s = t1 - t0, time.thread_time() - t1
        self.world_cpu_s = _cpu(None)  # the driver's CPU once every rank has its world

    def on_event(self, rank: int, event: dict[str, object]) -> None:
        self.received += 1
        if event.get("t") == "out" and isinstance(text := event.get("text"), str):
            self.logs.write(rank, text)
        self.job.apply(rank, event)

    def on_events(self, rank: int, events: list[dict[str, object]]) -> None:
        # A write's events at once, as ``Job.on_events`` folds them (before issue 30: one
        # ``on_event`` each, which a --baseline's server still calls).
        self.received += len(events)
        for event in events:
            if event.get("t") == "out" and isinstance(text := event.get("text"), str):
                self.logs.write(rank, text)
        self.job.apply_many(rank, events)

    def on_disconnect(self, rank: int) -> None:
        self.gone.release()


class _Charts:
    """The panel's charts without the panel: polled ten times a second under the job's lock
    (as ``Panel`` does), redrawn at their own pace; widgets without a front end send
    nothing, so the bytes are counted here."""

    def __init__(self, job: JobState) -> None:
        from nbdist.views.charts import ChartsView

        self.job = job
        self.view = ChartsView(job.series)
        self.seconds = 0.0  # spent redrawing

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(0.1):
            before = self.view.redraws
            t = time.perf_counter()
            with self.job.lock:
                self.view.render()
            if self.view.redraws != before:
                self.seconds += time.perf_counter() - t

    def figures(self, wall: float) -> dict[str, float]:
        n = max(1, self.view.redraws)
        return {"chart_redraws": self.view.redraws,
                "chart_bytes_per_redraw": self.view.bytes_sent / n,
                "chart_bytes_per_s": self.view.bytes_sent / wall,
                "chart_ms_per_redraw": 1000 * self.seconds / n}


def _cpu(me: psutil.Process | None) -> float:
    """CPU seconds of this process. ``cpu_times`` counts in clock ticks (10 ms, 0.05 % of a
    20 s run); Linux's scheduler statistics count nanoseconds of each thread."""
    try:
        total = 0
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        t = (me or psutil.Process()).cpu_times()
        return float(t.user + t.system)


def _full_logs_kb_per_rank(job: JobState, me: psutil.Process) -> float:
    """Memory per rank once every rank's log ring is full (the ceiling of a long job)."""
    gc.collect()
    before = me.memory_info().rss
    for r in range(job.np):
        text = "".join(f"epoch 3 step {i} loss 0.{i:04d} lr 3e-4 tokens/s 51234\n"
                       for i in range(LOG_LINES))
        job.apply(r, {"t": "out", "s": "o", "text": text})
    gc.collect()
    return (me.memory_info().rss - before) / 1024 / job.np


class _Messages:
    """Widget messages the panel would send to a front end: counted, with their bytes."""

    def __init__(self) -> None:
        import ipywidgets as w

        self.count = 0
        self.bytes = 0
        self._original = w.Widget._send
        messages = self

        def counting(widget: Any, msg: dict[str, Any], buffers: Any = None) -> None:
            if msg.get("method") == "update":
                messages.count += 1
                messages.bytes += len(json.dumps(msg.get("state"), default=str))
            messages._original(widget, msg, buffers)

        w.Widget._send = counting


def _panel_misses(panel: Any, job: JobState) -> list[int]:
    """Ranks whose newest progress the ended panel does not show (its host groups list every
    rank, with its bar as ``n/total``)."""
    tables = "".join(child.value for child in panel.hosts.children) if panel.collapsed else ""
    missing = []
    for r in job.ranks:
        bar = r.progress.get(1)
        if bar is None:
            continue
        shown = f"rank {r.rank}</td>" in tables and f"{bar.get('n')}/1000" in tables
        if panel.collapsed and not shown:
            missing.append(r.rank)
    return missing


def _table(results: list[dict[str, Any]]) -> str:
    code = any("code" in r for r in results)  # --baseline: which nbdist ran each row
    rows = [
        "| ranks |" + (" nbdist |" if code else "") + " driver CPU while running (% of a "
        "core) | run and end (% of a core) | the start / the end (ms of CPU) | idle baseline "
        "| panel: renders, messages/s, KB/s | memory per rank (run / full logs) | events sent "
        "/ delivered / lost | rendezvous: plan / sends (driver CPU) / wall | world sent |",
        "| --- |" + (" --- |" if code else "") +
        " --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        panel = (f"{r['panel_renders']}, {r['panel_messages_per_s']:.0f}, "
                 f"{r['panel_kb_per_s']:.1f}" if r.get("panel") else "no panel")
        rows.append(
            f"| {r['ranks']} |" + (f" {r.get('code', '')} |" if code else "") +
            f" {r['driver_cpu_running_pct']:.2f} % | {r['driver_cpu_pct_of_one_core']:.2f} % | "
            f"{r.get('start_cpu_ms', 0):.0f} / {r['end_cpu_ms']:.0f} | "
            f"{r['idle_baseline_cpu_pct']:.2f} % | {panel} | "
            f"{r['driver_memory_kb_per_rank']:.1f} KB / "
            f"{r['driver_memory_kb_per_rank_full_logs']:.0f} KB | {r['events_sent']} / "
            f"{r['events_delivered']} / {r['events_lost']} | "
            f"{1000 * r['rendezvous_plan_cpu_s']:.1f} ms / "
            f"{1000 * r['rendezvous_send_cpu_s']:.1f} ms / "
            f"{1000 * r['rendezvous_wall_s']:.0f} ms | {r['world_bytes'] / 1e6:.2f} MB |")
    return "\n".join(rows) + "\n"


def _baseline_tree(ref: str, where: Path) -> Path:
    """The ``nbdist`` package of git revision ``ref`` of this checkout, extracted under
    ``where`` (the baseline's code; this bench script drives both)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "nbdist"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def _one_size(args: argparse.Namespace, n: str, tree: Path | None) -> dict[str, Any]:
    """One size in a process of its own, on this checkout's nbdist or on ``tree``'s."""
    cmd = [sys.executable, __file__, "--ranks", n.strip(), "--rate", str(args.rate),
           "--seconds", str(5.0 if args.quick else args.seconds)]
    cmd += ["--no-resources"] if args.no_resources else []
    cmd += ["--no-panel"] if args.no_panel else []
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    subprocess.run(cmd, check=False, cwd=tree or ROOT, env=env)
    result: dict[str, Any] = json.loads(
        (ROOT / "benchmarks" / "results" / "scale.json").read_text())
    if args.baseline:
        result["code"] = f"{args.baseline} (baseline)" if tree else "as shipped"
    return result


def _sizes(args: argparse.Namespace) -> int:
    """Each size in a process of its own (memory per rank is the process's own), one table.
    With ``--baseline REF``: REF's nbdist and this one, interleaved (``--rounds`` each, the
    order swapped every round), and the medians of their driver CPU compared."""
    results = []
    with tempfile.TemporaryDirectory(prefix="nbdist-baseline-") as tmp:
        tree = _baseline_tree(args.baseline, Path(tmp)) if args.baseline else None
        for n in args.ranks.split(","):
            if tree is None:
                results.append(_one_size(args, n, None))
                continue
            for i in range(args.rounds):
                order = (tree, None) if i % 2 == 0 else (None, tree)
                results += [_one_size(args, n, t) for t in order]
    text = _table(results)
    if tree is not None:
        text += "\n" + _compare(results) + "\n"
    bad = [r["ranks"] for r in results if r["events_lost"] or r["ranks_with_stale_values"]
           or r.get("panel_misses")]
    if bad:
        text += f"\nsizes that lost something the views show: {bad}\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / "scale-sizes.json").write_text(json.dumps(results, indent=2))
    (out / "scale-sizes.md").write_text(text)
    return 1 if bad else 0


def _compare(results: list[dict[str, Any]]) -> str:
    """Per size and figure: the medians of the baseline's runs and of this nbdist's."""
    rows = ["| ranks | figure | baseline (median) | as shipped (median) | as shipped / "
            "baseline | runs each |", "| --- | --- | --- | --- | --- | --- |"]
    figures = (("driver CPU while running", "driver_cpu_running_pct", "%"),
               ("run and end", "driver_cpu_pct_of_one_core", "%"),
               ("the start", "start_cpu_ms", "ms"), ("the end", "end_cpu_ms", "ms"))
    for ranks in dict.fromkeys(r["ranks"] for r in results):
        mine = [r for r in results if r["ranks"] == ranks and r["code"] == "as shipped"]
        base = [r for r in results if r["ranks"] == ranks and r["code"] != "as shipped"]
        for name, key, unit in figures:
            b = statistics.median(r[key] for r in base)
            m = statistics.median(r[key] for r in mine)
            rows.append(f"| {ranks} | {name} | {b:.2f} {unit} | {m:.2f} {unit} | "
                        f"{m / b if b else float('nan'):.2f}x | {len(mine)} |")
    return "\n".join(rows)


def main() -> int:  # noqa: C901 - one measurement read top to bottom, its steps in order
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256", help="a number, or several: 64,256,1024")
    parser.add_argument("--rate", type=float, default=10.0, help="events per second per rank")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="5 seconds")
    parser.add_argument("--no-resources", action="store_true",
                        help="no resources samples (``res`` events), for comparison")
    parser.add_argument("--no-panel", action="store_true", help="no panel attached")
    parser.add_argument("--metrics", type=int, default=0,
                        help="every event a report of this many metrics")
    parser.add_argument("--charts", action="store_true",
                        help="render the panel's charts from the series meanwhile")
    parser.add_argument("--baseline", metavar="REF",
                        help="with several sizes: also run git revision REF's nbdist, "
                             "interleaved, and compare (e.g. main)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --baseline: runs of each nbdist per size")
    args = parser.parse_args()
    if "," in args.ranks or args.baseline:
        return _sizes(args)
    ranks = int(args.ranks)
    seconds = 5.0 if args.quick else args.seconds
    me = psutil.Process()
    with_panel = not args.no_panel and not (args.metrics or args.charts)
    messages = _Messages() if with_panel else None
    server = events.EventServer("127.0.0.1")
    rss_empty = me.memory_info().rss
    job = JobState("bench", "local", ranks)
    log_dir = tempfile.TemporaryDirectory(prefix="nbdist-bench-scale-")
    logs = logfiles.RankLogs(log_dir.name)  # a job writes every line to its rank's file
    job_channel = Channel(job, server, logs)
    secret = channel.new_secret()
    server.add_job("bench", secret, job_channel)

    cpu0, t0 = _cpu(me), time.monotonic()
    time.sleep(seconds)
    idle_pct = 100 * (_cpu(me) - cpu0) / (time.monotonic() - t0)

    panel = None
    if with_panel:
        from nbdist.views.widget import Panel

        panel = Panel(job)  # built before the ranks connect, as %%distributed does
        panel.start()
    clients = subprocess.Popen(
        [sys.executable, "-c", CLIENTS, *map(str, server.address), "bench", secret,
         str(ranks), str(args.rate), str(seconds), "0" if args.no_resources else "1",
         str(args.metrics)],
        # In the tree this nbdist comes from (``python -c`` puts its directory first).
        stdout=subprocess.PIPE, text=True, cwd=Path(nbdist.__file__).resolve().parent.parent,
    )
    assert clients.stdout is not None
    assert clients.stdout.readline().strip() == "connected"
    # The job's start: every rank's first line in (its log file opened) before the measure.
    deadline = time.monotonic() + 60
    while any(r.lines == 0 for r in job.ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    drawing = threading.Event()
    view = _Charts(job) if args.charts else None
    drawer = threading.Thread(target=view.run, args=(drawing,)) if view else None
    sent0 = (messages.count, messages.bytes) if messages else (0, 0)
    renders0 = panel.renders if panel else 0
    cpu0, t0 = _cpu(me), time.monotonic()
    start_cpu_ms = 1000 * (cpu0 - job_channel.world_cpu_s)
    if drawer:
        drawer.start()
    assert clients.stdout.readline().strip() == "closing"
    running_wall, cpu_run = time.monotonic() - t0, _cpu(me)  # the ranks stop sending
    report = json.loads(clients.stdout.readline())  # every rank has closed (the job's end)
    drawing.set()
    if drawer:
        drawer.join()
    wall = time.monotonic() - t0
    cpu_end = _cpu(me)
    busy_pct = 100 * (cpu_end - cpu0) / wall
    panel_figures: dict[str, Any] = {}
    if panel is not None and messages is not None:
        panel_figures = {
            "panel": True, "panel_renders": panel.renders - renders0,
            "panel_messages_per_s": (messages.count - sent0[0]) / wall,
            "panel_kb_per_s": (messages.bytes - sent0[1]) / 1024 / wall,
        }
    clients.wait()
    clients.stdout.close()
    # As a job does before it ends: every connection read to its end, the last events in.
    for _ in range(ranks):
        if not job_channel.gone.acquire(timeout=30):
            break
    if panel is not None:
        for r in range(ranks):
            job.set_rank(r, "done", 0)
        job.finish("done")
        panel.close()  # the final render: every pane and host group
        panel_figures["panel_misses"] = len(_panel_misses(panel, job))
    rss_busy = me.memory_info().rss
    server.close()
    logs.close()
    log_dir.cleanup()
    # Coalescing may skip superseded progress updates, never the newest value of anything.
    stale = [r for r, last in enumerate(report["last"])
             if (not args.metrics
                 and job.ranks[r].progress.get(1, {}).get("n") != last.get("progress"))
             or job.ranks[r].metrics.get("step") != last.get("metrics")]
    if args.metrics:  # and the newest point of each rank's series is that report's
        stale += [r for r, last in enumerate(report["last"])
                  if job.series.points("m1", r)[-1:] and
                  job.series.points("m1", r)[-1].step != last.get("metrics")]
    per_rank_kb = (rss_busy - rss_empty) / 1024 / ranks
    full_kb = _full_logs_kb_per_rank(job, me)
    sent = report["sent"]
    result = {
        "ranks": ranks, "events_per_rank_per_s": args.rate, "seconds": seconds,
        "resources_samples": not args.no_resources,
        "events_sent": sent, "events_delivered": job_channel.received,
        "events_lost": report["dropped"], "ranks_with_stale_values": len(stale),
        "driver_cpu_pct_of_one_core": round(busy_pct, 2),
        "driver_cpu_running_pct": round(100 * (cpu_run - cpu0) / running_wall, 2),
        "end_cpu_ms": round(1000 * (cpu_end - cpu_run), 1),
        "start_cpu_ms": round(start_cpu_ms, 1),
        "idle_baseline_cpu_pct": round(idle_pct, 2),
        "driver_cpu_us_per_event_sent": round(10_000 * (busy_pct - idle_pct) /
                                              (ranks * args.rate), 2),
        "driver_memory_kb_per_rank": round(per_rank_kb, 1),
        "driver_memory_kb_per_rank_full_logs": round(full_kb, 1),
        "metrics_per_report": args.metrics,
        "series_points_kept": sum(len(s) for name in job.series.names()
                                  for _, s in job.series.ranks(name)),
        "rendezvous_plan_cpu_s": job_channel.plan_cpu_s,
        "rendezvous_send_cpu_s": job_channel.send_cpu_s,
        "rendezvous_wall_s": report["world_last"] - job_channel.first_hello,
        "ranks_without_world": report["world_missing"],
        "world_bytes": job_channel.world_bytes,
        **panel_figures,
    }
    if view is not None:
        result.update(view.figures(time.monotonic() - t0))
    text = _table([result])
    if args.metrics:
        text += (f"\n{args.metrics} metrics a report; {result['series_points_kept']} points "
                 f"kept in the series of {len(job.series)} metrics.\n")
    if view is not None:
        text += (f"charts: {result['chart_redraws']} redraws, "
                 f"{result['chart_bytes_per_redraw']:.0f} bytes each, "
                 f"{result['chart_bytes_per_s']:.0f} bytes/s; a redraw took "
                 f"{result['chart_ms_per_redraw']:.1f} ms.\n")
    if stale:
        text += f"\n{len(stale)} ranks do not show their newest progress or metrics: {stale[:10]}\n"
    if panel_figures.get("panel_misses"):
        text += f"\n{panel_figures['panel_misses']} ranks' newest progress is not in the panel\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "scale-charts" if args.metrics or args.charts else "scale"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(text)
    failed = stale or report["dropped"] or report["world_missing"] or \
        panel_figures.get("panel_misses")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())

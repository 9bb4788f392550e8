"""The IPython magics: parse options, turn them into one call of the engine, show the result.

Capture lives in ``capture.py``, launching in ``job.py`` and ``launch/``, rendering in
``views/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Enum, Float

from nbdist import events
from nbdist import job as jobs
from nbdist.capture import capture_cell
from nbdist.views import status
from nbdist.views.text import TextView


@dataclass
class Options:
    """``%%distributed``'s options, validated."""

    np: int
    backend: str = "auto"
    gpu: bool | None = None
    timeout: float | None = None
    output: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    quiet: bool = False
    bg: bool = False
    show_source: bool = False
    export: str | None = None
    script: str | None = None
    script_args: list[str] = field(default_factory=list)


def parse_options(args: argparse.Namespace) -> Options:
    """Validate parsed arguments; every problem is a :class:`UsageError` naming the option."""
    if args.np is None:
        raise UsageError("%%distributed needs -np N: the number of ranks (e.g. -np 2)")
    try:
        np = int(args.np)
    except ValueError:
        raise UsageError(f"-np takes a whole number of ranks, not {args.np!r}") from None
    if np == 0:
        raise UsageError("-np 0 runs nothing: give N > 0 ranks, or -N for N local ranks")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout takes a positive number of seconds, not {args.timeout:g}")
    env: dict[str, str] = {}
    for item in args.env or ():
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env takes KEY=VALUE (e.g. --env NCCL_DEBUG=INFO), not {item!r}")
        env[key] = value
    if args.output is not None and not args.output.isidentifier():
        raise UsageError(f"-o takes a variable name, not {args.output!r}")
    export = getattr(args, "export", None)
    if export is not None:
        if not export.endswith(".py"):
            raise UsageError(f"--export takes the path of the .py script to write "
                             f"(e.g. --export train.py), not {export!r}")
        folder = os.path.dirname(os.path.abspath(export))
        if not os.path.isdir(folder):
            raise UsageError(f"--export {export}: there is no folder {folder!r} to write it in")
    if getattr(args, "bg", False) and args.output is not None:
        raise UsageError("-o stores the values when the job ends, and --bg does not wait for "
                         "that: drop -o and use the returned job's .results")
    return Options(
        np=np, backend=args.backend, gpu=args.gpu, timeout=args.timeout, output=args.output,
        env=env, quiet=args.quiet, bg=getattr(args, "bg", False), show_source=args.show_source,
        export=export,
        script=getattr(args, "script", None), script_args=list(getattr(args, "args", []) or []),
    )


@magics_class
class DistMagics(Magics):
    """Holds the magics; the work is done by ``nbdist.job``."""

    view = Enum(
        ("auto", "panel", "text"), "auto", config=True,
        help="How a running job is shown: 'panel' (widgets), 'text' (rank-labelled lines), or "
        "'auto': the panel in a Jupyter kernel with ipywidgets, else text. "
        "Set with %config DistMagics.view = 'text'.",
    )
    large_value_mb = Float(
        100.0, config=True,
        help="Warn when a value the cell takes from the notebook pickles to more than this "
        "many megabytes (every rank receives a copy). Set with "
        "%config DistMagics.large_value_mb = 500.",
    )

    @magic_arguments()
    @argument("-np", dest="np", metavar="N",
              help="number of ranks; -N runs N local ranks even when Spark is active")
    @argument("--backend", choices=("auto", "local", "spark"), default="auto",
              help="where ranks run (default: Spark if a session is active, else local)")
    @argument("--gpu", dest="gpu", action="store_true", default=None,
              help="one GPU per rank (default: when the backend has GPUs)")
    @argument("--no-gpu", dest="gpu", action="store_false", help="no GPUs for the ranks")
    @argument("--timeout", type=float, metavar="SECONDS",
              help="stop every rank and fail if the job runs longer")
    @argument("-o", dest="output", metavar="VAR",
              help="store every rank's value in VAR as a list (index = rank)")
    @argument("--env", action="append", metavar="KEY=VALUE",
              help="extra environment variable for every rank (repeatable)")
    @argument("--quiet", action="store_true", help="show no output, only errors and the result")
    @argument("--bg", action="store_true",
              help="run in the background: return the job at once; the panel stays live")
    @argument("--show-source", action="store_true",
              help="print the self-contained function that would run, and do not run it")
    @argument("--export", metavar="PATH",
              help="write a standalone script (and its values) to run with "
              "torchrun --nproc-per-node N PATH, and do not run it")
    @argument("script", nargs="?", help="line form: a Python script to run on every rank")
    @argument("args", nargs=argparse.REMAINDER, help="line form: the script's arguments")
    @no_var_expand
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run this cell (or a script, in the line form) on N ranks.

        The cell's imports and everything it uses from earlier cells travel with it. Every
        rank gets the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT, ...). Output is shown live, labelled by rank. The value of the last line
        on rank 0 is the cell's result.
        """
        opts = parse_options(parse_argstring(self.distributed, line))
        if cell is not None and opts.script:
            raise UsageError(f"unexpected argument {opts.script!r}: the cell is what runs")
        if cell is None:
            payload = self._script_payload(opts)
        else:
            shell = self.shell
            assert shell is not None
            captured = capture_cell(
                cell, shell.user_ns, transform=shell.transform_cell,
                filename=f"<cell In[{shell.execution_count}]>", line_offset=1,
                compile_flags=shell.compile.flags, warn_bytes=int(self.large_value_mb * 1e6),
            )
            if opts.show_source:
                print(captured.function_source())
            if opts.export:
                written = captured.export(opts.export, abs(opts.np))
                print(f"wrote {' and '.join(map(str, written))}; run it with: "
                      f"torchrun --nproc-per-node {abs(opts.np)} {opts.export}")
            if opts.show_source or opts.export:
                return None
            payload = captured.payload()
        return self._run(payload, opts, returns=cell is not None and payload["returns_last"])

    def _script_payload(self, opts: Options) -> dict[str, Any]:
        if not opts.script:
            raise UsageError("%distributed needs a script in its line form: "
                             "%distributed -np 4 train.py --lr 0.01")
        path = os.path.abspath(opts.script)
        if not os.path.isfile(path):
            raise UsageError(f"no such script: {opts.script!r} (looked in {os.getcwd()})")
        if opts.show_source or opts.export:
            raise UsageError("--show-source and --export apply to the cell form")
        return {"kind": "script", "path": path, "argv": opts.script_args}

    def _run(self, payload: dict[str, Any], opts: Options, *, returns: bool) -> Any:
        try:
            job = jobs.start(payload, opts.np, backend=opts.backend, gpu=opts.gpu,
                             timeout=opts.timeout, env=opts.env)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        view = None
        try:
            # From here on an interrupt (the stop button) may land anywhere, also while the
            # view is being built: every path must cancel the job, not leave it running.
            view = None if opts.quiet else self._view(job)
            if opts.bg:
                if view is not None:
                    view.start()  # renders from its own thread until the job ends
                return job
            if isinstance(view, TextView):
                job.wait(on_tick=view.update)
            else:
                if view is not None:
                    view.start()
                job.wait()
        except KeyboardInterrupt:
            job.cancel("interrupted from the notebook")
            job.wait(jobs.TEARDOWN_S)  # its error says so below
        finally:
            if view is not None and not (opts.bg and not job.done()):
                view.close()
        if job.error is not None or not job.done():
            job.result(timeout=0)
        if opts.output and self.shell is not None:
            self.shell.user_ns[opts.output] = job.results
        return job.result() if returns else None

    def _view(self, job: jobs.Job) -> Any:
        """The panel in a Jupyter kernel with ipywidgets (or when configured), else text."""
        mode = self.view
        if mode == "auto":
            mode = "panel" if _widget_frontend(self.shell) else "text"
        if mode == "text":
            return TextView(job.state)
        from nbdist.views.widget import Panel

        panel = Panel(job.state)
        panel.show()
        return panel

    @line_magic
    def dist_status(self, line: str) -> None:
        """Show this kernel's nbdist jobs and the capacity of the backends in use.

        ``%dist_status JOB`` shows one job's ranks: state, host, pid, GPU, exit code, last lines.
        """
        job_id = line.strip() or None
        if job_id is not None:
            job = jobs.get_job(job_id)
            if job is None:
                raise UsageError(f"no job {job_id!r}; %dist_status lists the jobs")
            display(status.RanksReport(job.state))
            return
        display(status.JobsReport([j.state for j in jobs.jobs()], _capacities(),
                                  rejected=events.rejected_connections()))

    @line_magic
    def dist_cancel(self, line: str) -> None:
        """Cancel a job (default: the one running); its ranks are gone within seconds."""
        args = shlex.split(line)
        job = jobs.get_job(args[0] if args else None)
        if job is None:
            raise UsageError(f"no job {args[0]!r}" if args else "no nbdist job to cancel")
        if job.done():
            print(f"job {job.id} already ended ({job.state.state})")
            return
        job.cancel("cancelled with %dist_cancel")
        job.wait(jobs.TEARDOWN_S)
        stopped = [r.rank for r in job.state.ranks if r.state == "cancelled"]
        ended = ", ".join(f"{n} {s}" for s, n in sorted(job.state.counts().items()))
        print(f"job {job.id} cancelled: ranks {', '.join(map(str, stopped)) or 'none'} "
              f"stopped ({ended})")


def _widget_frontend(shell: Any) -> bool:
    """True in a Jupyter kernel (ipykernel's shell) where ipywidgets can be imported."""
    import importlib.util

    in_kernel = any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)
    return in_kernel and importlib.util.find_spec("ipywidgets") is not None


def _capacities() -> list[tuple[str, Any]]:
    """(backend, Capacity) of the local backend, and of Spark when a session is active."""
    from nbdist.launch.local import LocalLauncher

    caps: list[tuple[str, Any]] = [("local", LocalLauncher().capacity())]
    if jobs._spark_session() is not None:
        try:
            launcher, _ = jobs.choose_launcher(1, "spark")
            caps.append(("spark", launcher.capacity()))
        except Exception as exc:  # no Spark backend here, or the cluster cannot be asked
            from nbdist.launch import Capacity

            caps.append(("spark", Capacity(0, 0, f"unknown: {exc}")))
    return caps

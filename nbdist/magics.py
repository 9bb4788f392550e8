"""The IPython magics: parse options, turn them into one call of the engine, show the result.

Options become one ``options.JobOptions`` (``parse_options``); capture lives in ``capture/``,
the backend's choice in ``launch/backends.py``, launching in ``job.py`` and ``launch/``,
rendering in ``views/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Bool, Enum, Float, Int, TraitError, Unicode, observe, validate

from nbdist import (
    _logcarry,
    check,
    elastic,
    events,
    handle,
    logfiles,
    settings,
    slices,
    waiting,
)
from nbdist import job as jobs
from nbdist import session as sessions
from nbdist.capture import capture_cell
from nbdist.errors import CellSyntaxError, PullWarning
from nbdist.launch import backends
from nbdist.magicline import strip_comment
from nbdist.options import BACKENDS, JobOptions, Restarts
from nbdist.protocol import CallPayload, Payload, Pulled, ScriptPayload
from nbdist.rank import debugger as rank_debugger
from nbdist.views import LiveView, live_view, status
from nbdist.views import timeline as timeline_view
from nbdist.views.session import SessionReport


@dataclass
class Options:
    """``%%distributed``'s options, validated."""

    np: int | None  # None: run on the kernel's session (%dist_session)
    #: How the job runs, restarts included: passed to the engine whole.
    job: JobOptions = field(default_factory=JobOptions)
    output: str | None = None
    quiet: bool = False
    bg: bool = False
    show_source: bool = False
    export: str | None = None
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    targets: str | None = None  # --targets SPEC: the session's ranks this cell runs on


class StatusArgs(NamedTuple):
    """``%dist_status``'s arguments."""

    job: str | None
    timeline: bool
    trace: str | None
    ranks: str | None = None  # --ranks SPEC: the ranks to list
    rank: int | None = None  # --rank R: the end of that rank's log
    lines: int = 20  # --lines N


#: Why a persistent session cannot restart (``--max-restarts`` with a session's cells).
SESSION_RESTARTS = (
    "--max-restarts relaunches every rank after a fault, and a session's ranks keep what earlier "
    "cells defined (a model, a data set, the process group), which a restart would lose. Give "
    "the cell -np N to run it as a job of its own that restarts (%%distributed -np N "
    "--max-restarts K), or run it on the session without --max-restarts"
)


def parse_status(line: str) -> StatusArgs:
    """``%dist_status``'s arguments: the job, ``--timeline``, ``--trace PATH``, ``--ranks
    SPEC``, ``--rank R`` and ``--lines N``."""
    job_id: str | None = None
    show_timeline, trace, ranks = False, None, None
    rank: int | None = None
    lines: int | None = None
    args = iter(shlex.split(line))
    for arg in args:
        name, eq, value = arg.partition("=")
        if arg == "--timeline":
            show_timeline = True
        elif name == "--ranks":
            ranks = value if eq else next(args, "")
            if not ranks:
                raise UsageError("--ranks takes the ranks to list: all, 8-15, failed, silent, "
                                 "outliers, host=NAME (e.g. %dist_status JOB --ranks all)")
        elif name == "--trace":
            trace = value if eq else next(args, "")
            if not trace:
                raise UsageError("--trace takes the path of the trace file to write "
                                 "(e.g. --trace launch.json)")
        elif name in ("--rank", "--lines"):
            text = value if eq else next(args, "")
            if not text.isdigit():
                raise UsageError(f"{name} takes a whole number (e.g. %dist_status j3 --rank 1 "
                                 f"--lines 50), not {text!r}")
            if name == "--rank":
                rank = int(text)
            else:
                lines = int(text)
        elif arg.startswith("-"):
            raise UsageError(f"%dist_status: unknown option {arg!r} (options: --timeline, "
                             f"--trace PATH, --ranks SPEC, --rank R, --lines N)")
        elif job_id is None:
            job_id = arg
        else:
            raise UsageError(f"%dist_status takes one job, not {job_id!r} and {arg!r}")
    if job_id is None and (show_timeline or trace is not None or ranks is not None
                           or rank is not None or lines is not None):
        raise UsageError("--timeline, --trace, --ranks, --rank and --lines need a job: "
                         "%dist_status JOB --timeline (%dist_status lists the jobs)")
    if lines is not None and rank is None:
        raise UsageError("--lines N shows the end of one rank's log: add --rank R "
                         "(e.g. %dist_status j3 --rank 1 --lines 50)")
    if trace is not None and (problem := timeline_view.trace_target_problem(trace)) is not None:
        raise UsageError(f"--trace {trace}: {problem}")
    return StatusArgs(job_id, show_timeline, trace, ranks, rank, 20 if lines is None else lines)


def unknown_job(job_id: str, magic: str) -> str:
    """What to say about a job id that names no job of this kernel: the ones it has."""
    known = [j.id for j in handle.jobs()]
    running = [j.id for j in handle.jobs() if not j.done()]
    if not known:
        return f"no job {job_id!r}: this kernel has run no nbdist job yet"
    if running:
        return (f"no job {job_id!r} in this kernel; running now: {', '.join(running)} "
                f"(e.g. {magic} {running[-1]}); %dist_status lists every job")
    return (f"no job {job_id!r} in this kernel, and none is running (the newest, "
            f"{known[-1]}, ended); %dist_status lists every job")


def parse_cancel(line: str) -> str | None:
    """``%dist_cancel``'s argument: the job, or None for the one running."""
    args = shlex.split(line)
    if len(args) > 1:
        raise UsageError(f"%dist_cancel takes one job, not {len(args)} arguments "
                         f"({' '.join(map(repr, args))}); cancel them one at a time")
    if args and args[0].startswith("-"):
        raise UsageError(f"%dist_cancel takes no options, not {args[0]!r}: give the job to "
                         f"cancel (%dist_cancel j3), or nothing for the one running")
    return args[0] if args else None


def check_session_args(args: argparse.Namespace) -> int | None:
    """Validate ``%dist_session``'s parsed arguments: ``-np`` for ``start`` (returned), and
    no launch options without ``start``."""
    if args.action != "start":
        given = [option for option, value in (
            ("-np", args.np), ("--backend", args.backend != "auto" or None),
            ("--gpu/--no-gpu", args.gpu), ("--env", args.env), ("--log-dir", args.log_dir),
            ("--idle-timeout", args.idle_timeout)) if value is not None]
        if given:
            action = args.action or "(no action)"
            raise UsageError(f"%dist_session {action} takes no {', '.join(given)}: they are "
                             f"options of %dist_session start")
        return None
    if args.max_restarts is not None:
        raise UsageError(
            "a session cannot restart: --max-restarts relaunches every rank after a fault, "
            "and a session's ranks keep what earlier cells defined, which a restart would "
            "lose. Run the training as a job of its own that restarts: %%distributed -np N "
            "--max-restarts K")
    np = _parse_np(args.np)
    if np is None:
        raise UsageError("%dist_session start needs -np N: the number of ranks")
    if args.idle_timeout is not None and args.idle_timeout <= 0:
        raise UsageError(f"--idle-timeout takes a positive number of seconds, not "
                         f"{args.idle_timeout:g}")
    return np


def _launch_arguments(func: Any) -> Any:
    """The options of a launch, shared by ``%%distributed`` and ``%dist_session start``."""
    for decorate in reversed((
        argument("-np", dest="np", metavar="N",
                 help="number of ranks; -N runs N local ranks even when Spark is active"),
        argument("--backend", choices=BACKENDS, default="auto",
                 help="where ranks run (default: Spark if a session is active, else Ray if "
                 "it is initialized, else local)"),
        argument("--gpu", dest="gpu", action="store_true", default=None,
                 help="one GPU per rank (default: when the backend has GPUs)"),
        argument("--no-gpu", dest="gpu", action="store_false", help="no GPUs for the ranks"),
        argument("--env", action="append", metavar="KEY=VALUE",
                 help="extra environment variable for every rank (repeatable)"),
        argument("--log-dir", metavar="DIR",
                 help="write every line of rank R to DIR/rank-R.log (default: a folder of the "
                 "job's under the temporary folder, named by %%dist_status JOB)"),
    )):
        func = decorate(func)
    return func


def _parse_np(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        np = int(value)
    except ValueError:
        raise UsageError(f"-np takes a whole number of ranks, not {value!r}") from None
    if np == 0:
        raise UsageError("-np 0 runs nothing: give N > 0 ranks, or -N for N local ranks")
    return np


def _parse_env(items: list[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--env takes KEY=VALUE (e.g. --env NCCL_DEBUG=INFO), not {item!r}")
        env[key] = value
    return env


def parse_options(args: argparse.Namespace, *, session: bool = False) -> Options:
    """Validate parsed arguments; every problem is a :class:`UsageError` naming the option.

    Without ``-np`` the cell runs on the kernel's session, when ``session`` says there is one.
    """
    np = _parse_np(args.np)
    if np is None and not session:
        raise UsageError("%%distributed needs -np N: the number of ranks (e.g. -np 2), or a "
                         "session to run on: %dist_session start -np N")
    log_dir = parse_log_dir(args.log_dir)
    if np is None and (args.backend != "auto" or args.gpu is not None or args.env or log_dir):
        raise UsageError("--backend, --gpu, --env and --log-dir are set once for a session, "
                         "when it starts (%dist_session start -np N --env KEY=VALUE); give -np "
                         "N to run this cell as a job of its own instead")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout takes a positive number of seconds, not {args.timeout:g}")
    env = _parse_env(args.env)
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
    mlflow = bool(getattr(args, "mlflow", False))
    if mlflow and np is None:
        raise UsageError("--mlflow applies to a job of its own: give -np N (a session's cells "
                         "log with mlflow.log_metric on the ranks)")
    restarts = _parse_restarts(args, np)
    if getattr(args, "bg", False) and args.output is not None:
        raise UsageError("-o stores the values when the job ends, and --bg does not wait for "
                         "that: drop -o and use the returned job's .results")
    targets = getattr(args, "targets", None)
    if targets is not None and np is not None:
        raise UsageError("--targets picks ranks of the kernel's session (%dist_session); a job "
                         "of its own (-np N) runs on all its ranks: drop -np or --targets")
    if targets is not None and not targets.strip():
        raise UsageError("--targets takes ranks of the session: 0,2 or 1-3 or host=NAME")
    try:
        job = JobOptions(backend=args.backend, gpu=args.gpu, timeout=args.timeout, env=env,
                         mlflow=mlflow, log_dir=log_dir, restarts=restarts)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return Options(
        np=np, job=job, output=args.output, quiet=args.quiet, bg=getattr(args, "bg", False),
        show_source=args.show_source, export=export,
        script=getattr(args, "script", None), script_args=list(getattr(args, "args", []) or []),
        targets=targets,
    )


def parse_log_dir(value: str | None) -> str | None:
    """``--log-dir DIR``: an absolute path that is a folder or can become one."""
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--log-dir {value}: {path!r} is a file, not a folder; give a folder "
                         f"for the ranks' logs (rank-R.log in it)")
    return path


def _parse_restarts(args: argparse.Namespace, np: int | None) -> Restarts:
    """``--max-restarts``, ``--restart-on-error``, ``--capacity-wait``, ``--checkpoint-dir``."""
    max_restarts = getattr(args, "max_restarts", None)
    if max_restarts is not None and np is None:
        raise UsageError(SESSION_RESTARTS)
    if max_restarts is not None and max_restarts < 0:
        raise UsageError(f"--max-restarts takes how many times to restart (0 or more), not "
                         f"{max_restarts}")
    on_error = bool(getattr(args, "restart_on_error", False))
    wait = getattr(args, "capacity_wait", None)
    if (on_error or wait is not None) and not max_restarts:
        option = "--restart-on-error" if on_error else "--capacity-wait"
        raise UsageError(f"{option} applies to a job that restarts: add --max-restarts K "
                         f"(how many restarts to allow)")
    if wait is not None and wait < 0:
        raise UsageError(f"--capacity-wait takes 0 or more seconds, not {wait:g}")
    folder = getattr(args, "checkpoint_dir", None)
    if folder is not None and np is None:
        raise UsageError("--checkpoint-dir applies to a job of its own: give -np N")
    try:
        return Restarts(max_restarts=max_restarts or 0, restart_on_error=on_error,
                        capacity_wait=wait, checkpoint_dir=folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _restart_arguments(func: Any) -> Any:
    """The options of a job that restarts after a fault (``nbdist.elastic``)."""
    for decorate in reversed((
        argument("--max-restarts", type=int, metavar="K",
                 help="after a lost host or a rank killed by a signal, launch every rank "
                 "again, up to K times (TORCHELASTIC_RESTART_COUNT counts them)"),
        argument("--restart-on-error", action="store_true",
                 help="restart after a Python exception of the cell too (by default taken "
                 "for a bug and not restarted)"),
        argument("--capacity-wait", type=float, metavar="SECONDS",
                 help="how long a restart waits for the slots of N ranks (default: "
                 "DistMagics.capacity_wait)"),
        argument("--checkpoint-dir", metavar="PATH",
                 help="what nbdist.checkpoint_dir() returns on the ranks: a path every rank "
                 "can reach"),
    )):
        func = decorate(func)
    return func


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
    driver_host = Unicode(
        "", config=True,
        help="The address Spark ranks connect to for the event channel (output, progress, "
        "the rendezvous), when it is not spark.driver.host: a port forwarder's address for a "
        "driver in a container. Wins over NBDIST_DRIVER_HOST. Default: spark.driver.host.",
    )
    driver_port = Int(
        None, allow_none=True, config=True,
        help="A fixed port for the event channel (bound on the driver, told to the ranks), "
        "e.g. one forwarded into a container; 0: any free port. Wins over NBDIST_DRIVER_PORT. "
        "Default: any free port.",
    )
    heartbeat_timeout = Float(
        None, allow_none=True, config=True,
        help="Seconds after which a Spark rank that hears nothing from the driver stops, and "
        "the driver fails a job (or session) whose connected ranks went silent: a host or "
        "network cut off. At least 10; 0 turns it off. Wins over NBDIST_HEARTBEAT_TIMEOUT. "
        f"Default: {settings.HEARTBEAT_TIMEOUT_S:g}.",
    )

    capacity_wait = Float(
        settings.CAPACITY_WAIT_S, config=True,
        help="Seconds a job that restarts (--max-restarts) waits for the backend to have the "
        "slots for its ranks again before it fails. --capacity-wait wins. "
        f"Default: {settings.CAPACITY_WAIT_S:g}.",
    )
    stacks_when_quiet = Float(
        None, allow_none=True, config=True,
        help="Take every rank's stacks once (%dist_stacks, kept in %dist_status JOB and the "
        "cell's saved output) when a running rank of a job printed nothing for this many "
        "seconds. Default: None (only on a timeout or a cancel).",
    )

    history = Int(
        50, config=True,
        help="Finished jobs kept for %dist_status; older ones are forgotten. Default: 50.",
    )
    history_mb = Float(
        256.0, config=True,
        help="What finished jobs keep of their values, in MiB of pickled size, in all: the "
        "last job's values are always kept; an older job's are let go once the jobs after it "
        "hold more (its .result() then says so). Default: 256.",
    )

    @validate("large_value_mb", "history", "history_mb")
    def _valid_setting(self, proposal: Any) -> Any:
        try:
            settings.Settings().__setattr__(proposal["trait"].name, proposal["value"])
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    @observe(*settings.names())
    def _setting(self, change: Any) -> None:
        # The one home of every knob (nbdist.settings): the engine reads them there at each
        # launch, also for nbdist.run() called in the notebook.
        setattr(settings.settings, change["name"], change["new"])

    @validate("stacks_when_quiet")
    def _valid_quiet(self, proposal: Any) -> float | None:
        value = proposal["value"]
        if value is not None and value <= 0:
            raise TraitError(f"stacks_when_quiet takes a positive number of seconds (or None), "
                             f"not {value:g}")
        return value  # type: ignore[no-any-return]

    checkpoint_root = Unicode(
        "", config=True,
        help="Where a job that restarts keeps its checkpoint directory "
        "(nbdist.checkpoint_dir()) when --checkpoint-dir is not given: a path every rank can "
        "reach (shared storage on a cluster). Default: nbdist-checkpoints under the working "
        "directory.",
    )

    flight_recorder = Int(
        settings.FLIGHT_RECORDER_ENTRIES, config=True,
        help="Entries of torch's flight recorder in every rank (TORCH_FR_BUFFER_SIZE): the "
        "collectives %dist_stacks and a hung job's error line up by rank. 0 turns it off; "
        "--env TORCH_FR_BUFFER_SIZE=N wins for one job. "
        f"Default: {settings.FLIGHT_RECORDER_ENTRIES}.",
    )

    @validate("flight_recorder")
    def _valid_recorder(self, proposal: Any) -> Any:
        try:
            settings.Settings().__setattr__("flight_recorder", proposal["value"])
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    warm_at_load = Bool(
        True, config=True,
        help="At %load_ext nbdist, when torch is installed, start the zygote the first local "
        "job forks its ranks from, importing torch and numpy at low priority (nice 19), so "
        "that the first cell starts at once. False (or NBDIST_WARM_AT_LOAD=0) waits for the "
        "first job; NBDIST_ZYGOTE=0 and NBDIST_WARM_POOL=0 turn it off too. Set it in an "
        "IPython profile (c.DistMagics.warm_at_load = False): it is read when nbdist loads; "
        "set with %config once loaded, True starts the zygote now and False says what it "
        "cannot undo.",
    )

    @observe("warm_at_load")
    def _warm_setting(self, change: Any) -> None:
        loaded: list[object] = list(getattr(self.shell, "configurables", ()))
        if self not in loaded:  # registered: not the profile's value, read at load
            return
        from nbdist.launch.local import warm_at_load

        if change["new"]:
            started = warm_at_load() is not None
            print("nbdist: starting the first job's zygote now (torch imported in the "
                  "background, at low priority)" if started else
                  "nbdist: no zygote to start (torch is not installed, or NBDIST_WARM_AT_LOAD=0, "
                  "NBDIST_ZYGOTE=0 or NBDIST_WARM_POOL=0 is set)")
        else:
            print("nbdist: DistMagics.warm_at_load is read at %load_ext nbdist, which has run: "
                  "a zygote it started stays until idle. To not start one at load, set "
                  "c.DistMagics.warm_at_load = False in an IPython profile, or "
                  "NBDIST_WARM_AT_LOAD=0 before %load_ext nbdist")

    @validate("heartbeat_timeout")
    def _valid_timeout(self, proposal: Any) -> float | None:
        value = proposal["value"]
        if value is not None:
            try:
                settings.check_heartbeat_timeout(value, "DistMagics.heartbeat_timeout")
            except ValueError as exc:
                raise TraitError(str(exc)) from None
        return value  # type: ignore[no-any-return]

    @validate("capacity_wait")
    def _valid_capacity_wait(self, proposal: Any) -> float:
        value = proposal["value"]
        if value < 0:
            raise TraitError(f"DistMagics.capacity_wait must be 0 or more seconds, not {value:g}")
        return value  # type: ignore[no-any-return]

    @validate("driver_port")
    def _valid_port(self, proposal: Any) -> int | None:
        value = proposal["value"]
        if value is not None and not 0 <= value <= 65535:
            raise TraitError(f"DistMagics.driver_port must be a port number (1-65535, or 0 for "
                             f"any free port), not {value}")
        return value  # type: ignore[no-any-return]

    ray_gpus_per_bundle = Int(
        None, allow_none=True, config=True,
        help="Ray, node-level launch: bundles of k GPUs that run k ranks each (-np a multiple "
        "of k), as one task of k GPUs on Spark. Wins over NBDIST_RAY_GPUS_PER_BUNDLE. "
        "Default: 1 (a bundle of one GPU per rank).",
    )
    ray_strategy = Enum(
        ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), None, allow_none=True, config=True,
        help="Ray's placement strategy for a job's bundles. Wins over NBDIST_RAY_STRATEGY. "
        "Default: PACK.",
    )
    ray_placement_wait = Float(
        None, allow_none=True, config=True,
        help="Seconds a Ray job waits for its placement group before it fails with the "
        "resources missing (the group is removed). Wins over NBDIST_RAY_PLACEMENT_WAIT. "
        "Default: 30.",
    )

    ray_cpus_per_rank = Float(
        None, allow_none=True, config=True,
        help="CPUs each Ray rank reserves in its bundle (0 or more). Wins over "
        "NBDIST_RAY_CPUS_PER_RANK. Default: 1.",
    )

    @observe("ray_gpus_per_bundle", "ray_strategy", "ray_placement_wait", "ray_cpus_per_rank")
    def _ray_setting(self, change: Any) -> None:
        from nbdist.launch import ray as ray_backend  # imports no Ray

        setattr(ray_backend.settings, change["name"].removeprefix("ray_"), change["new"])

    @magic_arguments()
    @_launch_arguments
    @argument("--timeout", type=float, metavar="SECONDS",
              help="stop every rank and fail if the job runs longer")
    @argument("-o", dest="output", metavar="VAR",
              help="store every rank's value in VAR as a list (index = rank)")
    @argument("--quiet", action="store_true", help="show no output, only errors and the result")
    @argument("--targets", metavar="SPEC",
              help="a session cell: run on these ranks only (0,2 or 1-3 or host=NAME); the "
              "others keep their state untouched, and -o gets the targets' values in rank order")
    @argument("--bg", action="store_true",
              help="run in the background: return the job at once; the panel stays live")
    @argument("--show-source", action="store_true",
              help="print the self-contained function that would run, and do not run it")
    @argument("--export", metavar="PATH",
              help="write a standalone script (and its values) to run with "
              "torchrun --nproc-per-node N PATH, and do not run it")
    @argument("--mlflow", action="store_true",
              help="log rank 0's reported metrics (nbdist.report) into the notebook's active "
              "MLflow run, with steps")
    @_restart_arguments
    @argument("script", nargs="?", help="line form: a Python script to run on every rank")
    @argument("args", nargs=argparse.REMAINDER, help="line form: the script's arguments")
    @no_var_expand
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None) -> Any:
        """Run this cell (or a script, in the line form) on N ranks.

        The cell's imports and everything it uses from earlier cells travel with it. Every
        rank gets the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
        MASTER_PORT, ...). Output is shown live, labelled by rank. The value of the last line
        on rank 0 is the cell's result. Without -np, the cell runs on the ranks of the
        kernel's session (%dist_session), which keep their variables between cells.
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        live = sessions.current()
        if live is not None and not live.alive and live.broken is None:
            live = None  # stopped on purpose: as if there were none (a broken one says why)
        opts = parse_options(parse_argstring(self.distributed, line), session=live is not None)
        on = live if opts.np is None else None
        if on is not None:
            on.check_usable()
        if cell is not None and opts.script:
            raise UsageError(
                f"unexpected argument {opts.script!r} on the %%distributed line: in the cell "
                f"form the cell is what runs (a script runs in the line form: %distributed "
                f"-np 4 train.py --lr 0.01), and a comment starts with ' #'")
        if cell is None:
            payload = self._script_payload(opts)
        else:
            shell = self.shell
            assert shell is not None
            try:
                captured = capture_cell(
                    cell, shell.user_ns, transform=shell.transform_cell,
                    filename=f"<cell In[{shell.execution_count}]>", line_offset=1,
                    compile_flags=shell.compile.flags,
                    warn_bytes=int(self.large_value_mb * 1e6),
                    remote_names=on.defined_names() if on is not None else (),
                )
            except SyntaxError as exc:  # the user's line, not nbdist's frames
                raise CellSyntaxError(*exc.args) from None
            np = on.np if on is not None else abs(opts.np or 1)
            for name, plan in captured.shards.items():  # before any rank starts
                try:
                    plan.check_ranks(np, name)
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
            if opts.show_source:
                print(captured.function_source())
            if opts.export:
                written = captured.export(opts.export, np)
                print(f"wrote {' and '.join(map(str, written))}; run it with: "
                      f"torchrun --nproc-per-node {np} {opts.export}")
            if opts.show_source or opts.export:
                return None
            cell_payload = captured.payload()
            cell_payload["logging"] = _logcarry.snapshot()  # as the environment is carried
            return self._run(cell_payload, opts, returns=cell_payload["returns_last"], on=on)
        return self._run(payload, opts, returns=False, on=on)

    def _script_payload(self, opts: Options) -> ScriptPayload:
        if not opts.script:
            raise UsageError("%distributed needs a script in its line form: "
                             "%distributed -np 4 train.py --lr 0.01")
        path = os.path.abspath(opts.script)
        if not os.path.isfile(path):
            raise UsageError(f"no such script: {opts.script!r} (looked in {os.getcwd()})")
        if opts.show_source or opts.export:
            raise UsageError("--show-source and --export apply to the cell form")
        return {"kind": "script", "path": path, "argv": opts.script_args}

    def _run(
        self, payload: Payload, opts: Options, *, returns: bool,
        on: sessions.Session | None = None,
    ) -> Any:
        job: handle.Handle
        if on is not None:
            try:
                targets = on.targets(opts.targets) if opts.targets is not None else None
            except ValueError as exc:
                raise UsageError(f"--targets {opts.targets}: {exc}") from None
            job = on.run_cell(payload, timeout=opts.job.timeout, targets=targets)
        else:
            assert opts.np is not None
            try:
                job = elastic.start(payload, opts.np, opts.job)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        view = None
        # From here on an interrupt (the stop button) may land anywhere, also while the view
        # is being built: every path must cancel the job, not leave it running, and on Spark
        # the stop button must stop this job only (nbdist.waiting: see launch/spark.py).
        with waiting.waiting():
            try:
                view = None if opts.quiet else self._view(job)
                if opts.bg:
                    if view is not None:
                        view.start()  # renders from its own thread until the job ends
                    return job
                if view is not None and view.ticks:
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

    def _view(self, job: handle.Handle) -> LiveView:
        """The panel in a Jupyter kernel with ipywidgets (or when configured), else text."""
        mode = self.view
        if mode == "auto":
            mode = "panel" if _widget_frontend(self.shell) else "text"
        return live_view(job.state, mode)

    @line_magic
    def dist_status(self, line: str) -> None:
        """Show this kernel's nbdist jobs and the capacity of the backends in use.

        ``%dist_status JOB`` shows one job's ranks: state, host, pid, GPU, exit code, CPU and
        memory, last lines, where each rank's complete log is, and how a rank that failed
        died (its peak memory, the signal, the out-of-memory killer).
        ``%dist_status JOB --rank R --lines N`` shows the last N lines (default 20) of rank
        R's log file. ``%dist_status JOB --timeline`` shows where its launch time went
        per rank (a table and a bar per rank); ``--trace PATH`` writes it as a Chrome trace
        file for Perfetto or chrome://tracing. A job of more than 16 ranks shows a summary
        line, a row per host and the ranks worth a look; ``--ranks SPEC`` lists the ranks SPEC
        names (``all``, ``8-15``, ``failed``, ``silent``, ``outliers``, ``host=NAME``).
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        job_id, show_timeline, trace, ranks, rank, lines = parse_status(line)
        if job_id is not None:
            job = handle.get_job(job_id)
            if job is None:
                raise UsageError(unknown_job(job_id, "%dist_status"))
            if rank is not None:
                try:
                    print(logfiles.tail_text(job.state, rank, lines))
                except ValueError as exc:
                    raise UsageError(str(exc)) from None
                return
            if trace is not None:
                try:
                    print(timeline_view.export_trace(job.state, trace))
                except timeline_view.TraceTargetError as exc:
                    raise UsageError(f"--trace {trace}: {exc}") from None
            if show_timeline:
                display(timeline_view.TimelineReport(job.state))
            if not (show_timeline or trace is not None) or ranks is not None:
                try:
                    report = status.RanksReport(job.state, ranks)
                except ValueError as exc:
                    raise UsageError(f"%dist_status {job_id} --ranks: {exc}") from None
                display(report)
            return
        display(status.JobsReport([j.state for j in handle.jobs()], backends.capacities(),
                                  rejected=events.rejected_connections()))

    @magic_arguments()
    @argument("job", nargs="?", help="the job (default: the one running)")
    @argument("--timeout", type=float, default=handle.STACKS_WAIT_S, metavar="SECONDS",
              help="how long to wait for the ranks' supervisors to answer (default "
              "%(default)s); each rank has 2 s to write its stacks, whatever this is")
    @line_magic
    def dist_stacks(self, line: str) -> None:
        """Show the Python stacks of every thread of every running rank, grouped.

        Ranks with the same stacks fold into one line (``ranks 0–2, 4–7: all_reduce ← step
        (cell line 41)``), then each group's frames. Works while a rank is stuck in C code (a
        collective, a lock). A rank that does not answer is named with its last lines.
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_stacks, line)
        job = handle.get_job(args.job)
        if job is None:
            raise UsageError(unknown_job(args.job, "%dist_stacks") if args.job
                             else "no nbdist job to show the stacks of")
        if job.done():
            raise UsageError(f"job {job.id} already ended ({job.state.status}): only running "
                             f"ranks have stacks; %dist_status {job.id} shows how they ended")
        if args.timeout <= 0:
            raise UsageError(f"--timeout takes a positive number of seconds, not "
                             f"{args.timeout:g}")
        display(job.stacks(args.timeout))

    @magic_arguments()
    @argument("-np", dest="np", type=int, required=True, metavar="N",
              help="ranks to check (negative: local ranks even when Spark is active)")
    @argument("--backend", choices=("auto", "local", "spark"), default="auto",
              help="the backend to check (default: as %%distributed chooses)")
    @argument("--gpu", action="store_true",
              help="one GPU per rank, the sweep over NCCL up to 256 MB")
    @argument("--timeout", type=float, default=120.0, metavar="SECONDS",
              help="fail the check after this long (default 120)")
    @line_magic
    def dist_check(self, line: str) -> None:
        """Check N ranks before a long run, in seconds: host, Python, torch, CUDA/NCCL and
        nbdist versions (a mismatch named), the GPUs each rank sees, free space, its clock
        against the notebook's, and an all-reduce sweep (bus bandwidth as nccl-tests computes
        it). What is wrong (a rank that failed, one far slower than the others, a version that
        differs) is said at the end.
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_check, line)
        if args.np == 0:
            raise UsageError("-np takes a number of ranks other than 0")
        if args.timeout <= 0:
            raise UsageError(f"--timeout takes a positive number of seconds, not "
                             f"{args.timeout:g}")
        print(check.run_check(args.np, args.backend, args.gpu, args.timeout).text())

    @magic_arguments()
    @argument("--rank", type=int, default=None,
              help="the rank to debug (default: the first that failed)")
    @line_magic
    def dist_debug(self, line: str) -> None:
        """Open a post-mortem debugger on a rank of the session's cell that failed last.

        The debugger runs on the rank, in the frames of its traceback with their live state;
        type its commands in the notebook's input box (``c`` or ``q`` ends it).
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_debug, line)
        live = sessions.current()
        cell = live.last_cell if live is not None and live.alive else None
        error = cell.error if cell is not None and cell.done() else None
        failures = getattr(error, "failures", None)
        if not failures:
            raise UsageError("%dist_debug opens a debugger on a failed cell of the session "
                             "(%dist_session start -np N); there is no failed session cell "
                             "(in a job's cell, put breakpoint() where to stop)")
        assert live is not None and cell is not None
        rank = min(failures) if args.rank is None else args.rank
        if rank not in failures:
            raise UsageError(f"rank {rank} did not fail in cell {cell.id}; ranks that failed: "
                             f"{', '.join(map(str, sorted(failures)))}")
        payload: CallPayload = {"kind": "call", "fn": rank_debugger.post_mortem,
                                "args": (rank,), "kwargs": {}}
        self._run(payload, Options(np=None, quiet=True), returns=False, on=live)

    @line_magic
    def dist_cancel(self, line: str) -> None:
        """Cancel a job (default: the one running); its ranks are gone within seconds."""
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        job_id = parse_cancel(line)
        job = handle.get_job(job_id)
        if job is None:
            raise UsageError(unknown_job(job_id, "%dist_cancel") if job_id is not None
                             else "no nbdist job to cancel")
        if job.done():
            print(f"job {job.id} already ended ({job.state.status})")
            return
        job.cancel("cancelled with %dist_cancel")
        job.wait(jobs.TEARDOWN_S)
        stopped = [r.rank for r in job.state.ranks if r.status == "cancelled"]
        ended = ", ".join(f"{n} {s}" for s, n in sorted(job.state.counts().items()))
        print(f"job {job.id} cancelled: ranks {', '.join(map(str, stopped)) or 'none'} "
              f"stopped ({ended})")


    @magic_arguments()
    @argument("action", nargs="?", choices=("start", "stop"),
              help="start a session, stop it, or (no action) show it")
    @_launch_arguments
    @argument("--idle-timeout", type=float, metavar="SECONDS",
              help="stop the session (releasing its ranks and cluster slots) after this long "
              "without a cell; a warning comes first")
    @argument("--max-restarts", type=int, help=argparse.SUPPRESS)
    @line_magic
    def dist_session(self, line: str) -> Any:
        """Start, stop or show the kernel's persistent session of ranks.

        ``%dist_session start -np 4`` starts ranks that stay up; every ``%%distributed`` cell
        without -np then runs on them, and what a cell defines on the ranks (a model, a data
        set, the process group) is still there in the next. ``%dist_session stop`` ends it.
        """
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_session, line)
        np = check_session_args(args)
        live = sessions.current()
        if args.action is None:
            if live is None:
                print("no session; start one with %dist_session start -np N")
                return None
            return SessionReport(live)
        if args.action == "stop":
            if live is None or not live.alive:
                raise UsageError("no session is running" if live is None else
                                 f"session {live.id} already ended")
            live.stop()
            print(f"session {live.id} stopped: its {live.np} ranks are gone")
            return None
        assert np is not None
        started = time.monotonic()
        try:
            options = JobOptions(backend=args.backend, gpu=args.gpu, env=_parse_env(args.env),
                                 log_dir=parse_log_dir(args.log_dir))
            session = sessions.start(np, options, idle_timeout=args.idle_timeout)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(f"session {session.id}: {session.np} ranks ready on {session.launcher.name} in "
              f"{time.monotonic() - started:.1f} s; %%distributed cells without -np run there")
        return None

    @magic_arguments()
    @argument("name", help="the variable to bring back")
    @argument("--rank", type=int, default=0, help="the rank to take it from (default 0)")
    @line_magic
    def dist_pull(self, line: str) -> None:
        """Copy a variable from a session's rank into the notebook (a picklable value)."""
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_pull, line)
        session = self._session()
        if not 0 <= args.rank < session.np:
            raise UsageError(f"--rank {args.rank}: session {session.id} has ranks 0 to "
                             f"{session.np - 1}")
        cell = session.run_cell({"kind": "pull", "name": args.name, "rank": args.rank})
        pulled: Pulled = cell.results[args.rank]
        value = pulled.value
        assert self.shell is not None
        self.shell.user_ns[args.name] = value
        print(f"{args.name} = rank {args.rank}'s {type(value).__name__}")
        if pulled.threads:
            warnings.warn(PullWarning(
                f"rank {args.rank} was running threads that the session's cells started "
                f"({', '.join(pulled.threads)}) while {args.name} was read and sent: if they "
                f"change it, {args.name} may mix moments (elements from before and after a "
                f"change). Pull it once they are done, or pull a copy they make under a lock"),
                stacklevel=1)

    @magic_arguments()
    @argument("names", nargs="+", help="the notebook variables to send")
    @line_magic
    def dist_push(self, line: str) -> None:
        """Copy notebook variables to every rank of the session (replacing theirs)."""
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_push, line)
        session = self._session()
        shell = self.shell
        assert shell is not None
        # Every value is pickled (and refused, if it must be) before any rank is involved: a
        # refusal leaves the session as it was. Each is pickled once; that pickle is what
        # travels (session.run_cell), and is let go once every rank has it.
        pickled: list[tuple[str, bytes]] = []
        for name in args.names:
            if name not in shell.user_ns:
                raise UsageError(f"the notebook has no variable {name!r} to push")
            # Capture applies its rules (refusals, size warnings) to a cell naming the value.
            captured = capture_cell(name, shell.user_ns,
                                    warn_bytes=int(self.large_value_mb * 1e6))
            if not captured.values:
                raise UsageError(f"{name!r} is a module or an import in the notebook; import "
                                 f"it in a %%distributed cell instead")
            pickled.append((name, captured.data))
            del captured
        while pickled:
            name, data = pickled.pop(0)
            session.run_cell({"kind": "push", "name": name, "data": data}).result()
            del data
        print(f"pushed {', '.join(args.names)} to the {session.np} ranks of {session.id}")

    @magic_arguments()
    @argument("name", help="the notebook variable to split across the ranks")
    @line_magic
    def dist_scatter(self, line: str) -> None:
        """Split a notebook list, tuple, numpy array, torch tensor or pandas DataFrame/Series
        across the session's ranks: rank r gets its slice (by rows) under the same name."""
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_scatter, line)
        session = self._session()
        shell = self.shell
        assert shell is not None
        if args.name not in shell.user_ns:
            raise UsageError(f"the notebook has no variable {args.name!r} to scatter")
        value = shell.user_ns[args.name]
        what = slices.kind(value)
        if what is None:
            raise UsageError(
                f"cannot scatter {args.name!r}, a {type(value).__name__}: %dist_scatter splits "
                f"lists, tuples, numpy arrays, torch tensors and pandas DataFrames or Series "
                f"by rows; use %dist_push {args.name} to send the whole value to every rank")
        n = slices.length(value)
        if n < session.np:
            raise UsageError(f"cannot scatter {args.name!r}: it has {n} items for the "
                             f"{session.np} ranks of {session.id}; every rank needs one")

        # Every slice is pickled (and refused, if it must be) before any rank is involved: a
        # refusal leaves the session as it was. The slices' pickles are what travel, each
        # let go once its rank has it (session.run_cell).
        parts: list[bytes | None] = [
            # Capture's rules (refusals, size warnings) apply to each slice as to a push.
            capture_cell(args.name, {args.name: slices.part(value, rank, session.np)},
                         warn_bytes=int(self.large_value_mb * 1e6)).data
            for rank in range(session.np)]

        def own(rank: int) -> dict[str, Any]:
            data, parts[rank] = parts[rank], None
            return {"data": data}

        session.run_cell({"kind": "push", "name": args.name, "data": b""},
                         per_rank=own).result()
        sizes = [b - a for a, b in (slices.bounds(n, r, session.np)
                                    for r in range(session.np))]
        print(f"scattered {args.name} ({what} of {n}) over the {session.np} ranks of "
              f"{session.id}: {min(sizes)} to {max(sizes)} each")

    @magic_arguments()
    @argument("name", help="the session variable to bring back from every rank")
    @line_magic
    def dist_gather(self, line: str) -> None:
        """Bring a session variable back from every rank, joined in rank order (lists, tuples,
        arrays, tensors and DataFrames are concatenated; other values come as a list)."""
        line = strip_comment(line)  # a trailing '# comment' is not an argument
        args = parse_argstring(self.dist_gather, line)
        session = self._session()
        cell = session.run_cell({"kind": "pull", "name": args.name, "rank": -1})
        value, joined = slices.join(cell.results)
        assert self.shell is not None
        self.shell.user_ns[args.name] = value
        if joined:
            what = (slices.kind(value) or "a value").removeprefix("a ")
            print(f"{args.name} = the {session.np} ranks' {what}s joined in rank order "
                  f"({slices.length(value)} items)")
        else:
            print(f"{args.name} = a list of the {session.np} ranks' values (index = rank): "
                  f"they are not all lists, tuples, arrays, tensors or DataFrames of one type")

    def _session(self) -> sessions.Session:
        live = sessions.current()
        if live is None:
            raise UsageError("no session; start one with %dist_session start -np N")
        live.check_usable()
        return live


def unload(shell: Any) -> None:
    """``%unload_ext nbdist``: stop what nbdist started and remove its magics.

    Refused (a :class:`UsageError` naming them) while a job or a session cell runs: unloading
    must not throw away a run's work; cancel it (``%dist_cancel``) or let it end first. Then:
    the session stops, the warm pool lets its zygotes and interpreters go, the event servers
    close, ``nbdist.shard``'s exports are removed, pyspark's own SIGINT handler is back, and
    ``%%distributed`` is unknown again.
    ``%load_ext nbdist`` starts over.
    """
    running = [j.id for j in handle.jobs() if not j.done()]
    if running:
        one = len(running) == 1
        what = f"job {running[0]} is" if one else f"jobs {', '.join(running)} are"
        it = "it" if one else "them"
        cancel = " and ".join(f"%dist_cancel {i}" for i in running)
        raise UsageError(f"nbdist was not unloaded: {what} still running. Let {it} end or stop "
                         f"{it} ({cancel}), then run %unload_ext nbdist again.")
    sessions.shutdown("nbdist was unloaded (%unload_ext nbdist)")
    backends.shutdown()
    events.close_shared()
    from nbdist import data  # stdlib only until a table is exported

    data.forget_all()  # nbdist.shard's exports of notebook tables
    manager = shell.magics_manager
    mine = manager.registry.pop(DistMagics.__name__, None)
    if mine is not None:
        for kind, table in manager.magics.items():
            for name, func in mine.magics.get(kind, {}).items():
                if table.get(name) == func:  # not if something else took the name since
                    del table[name]
        if mine in shell.configurables:
            shell.configurables.remove(mine)


def _widget_frontend(shell: Any) -> bool:
    """True in a Jupyter kernel (ipykernel's shell) where ipywidgets can be imported."""
    import importlib.util

    in_kernel = any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)
    return in_kernel and importlib.util.find_spec("ipywidgets") is not None

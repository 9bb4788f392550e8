"""The rank runtime: the fresh interpreter in which a rank's code runs.

The supervisor (``rank/supervisor.py``) starts ``python -c "from nbdist.rank.runtime import
main; main()"`` in a new process group with two pipes besides stdout and stderr:

- *control in* (supervisor → rank): frames (``protocol.Frame``): optionally "warm" (modules to
  import while the ranks meet), "env" (the rank's environment and working directory), then
  payloads one after another (a session's rank takes several), then "quit"; end of file means
  the supervisor is gone, and the rank kills its own process group (the parent-death
  detection horovod uses; it works even when the parent was SIGKILLed);
- *control out* (rank → supervisor): events (progress, metrics, state) and the result or error
  of each payload.

A frame is a 4-byte big-endian length, one byte of kind, and the body. After its last payload
the runtime flushes stdout/stderr (Python's and C's) and leaves with ``os._exit``: the
interpreter teardown is skipped because torch 2.13 CPU aborts in it 10-20% of the time after
the work is done. This module imports only the standard library, cloudpickle and nbdist's
rank side (``rank/``) and shared modules (``protocol.py``, ``values.py``): never IPython.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import io
import json
import linecache
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from nbdist import _logcarry, values  # standard library only
from nbdist.protocol import (
    STACKS_SIGNAL,
    CallPayload,
    CellPayload,
    EnvFrame,
    ErrorRecord,
    Frame,
    FrameWriter,
    NamesEvent,
    Payload,
    Pulled,
    PullPayload,
    PushPayload,
    ScriptPayload,
    SessionKeys,
    ShippedCode,
    StateEvent,
    load_values,
    read_frame,
)
from nbdist.rank import children as _children
from nbdist.rank import debugger, host, jax_cluster, localcode, reporting, rich
from nbdist.rank.host import installation_dirs, is_installed
from nbdist.rank.shell import RankShell
from nbdist.rank.streams import Pacer, flush_c_stdio

if TYPE_CHECKING:
    pass

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


# -- running a payload ---------------------------------------------------------------------------
def _import(module: str, what: str, name: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise ImportError(
            f"the notebook's name {name!r} needs `{what}`, which failed on this rank: "
            f"{_type_name(exc)}: {_message(exc)}. Install it where the ranks run."
        ) from None


#: The namespace of a persistent session's cells: one per rank interpreter, kept between cells
#: as a kernel keeps ``user_ns``. A one-off job's cell gets a fresh one. Each is the dict of a
#: module ``__main__`` (``_children``: what spawned children of the rank need).
_session_ns: dict[str, Any] = _children.namespace(keep=True)


def _namespace(payload: SessionKeys) -> dict[str, Any]:
    ns = _session_ns if payload.get("session") else _children.namespace()
    if "__builtins__" not in ns:
        ns.update({"__name__": "__main__", "__builtins__": builtins})
        shell = RankShell(ns)
        ns["get_ipython"] = lambda: shell
        ns["display"] = rich.display
    return ns


def session_names() -> list[str]:
    """The user's names in the session namespace (what a later cell need not ship)."""
    hidden = {"__name__", "__builtins__", "get_ipython", "display", "_exit_code"}
    return sorted(n for n in _session_ns if n not in hidden and not n.startswith("__"))


def _run_cell(payload: CellPayload) -> Any:
    filename: str = payload["filename"]
    source: str = payload["source"]
    offset: int = payload.get("line_offset", 0)
    # Line numbers count from the top of the user's cell, magic line included.
    lines = ["\n"] * offset + source.splitlines(True)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    ns = _namespace(payload)
    _children.enter(ns)
    _logcarry.apply(payload.get("logging"))
    for name, module, attr in payload.get("imports", ()):
        what = f"from {module} import {attr}" if attr else f"import {module}"
        mod = _import(module, what, name)
        try:
            ns[name] = getattr(mod, attr) if attr else mod
        except AttributeError as exc:
            raise ImportError(
                f"the notebook's name {name!r} needs `{what}`, which failed on this rank: "
                f"{exc}. Install the notebook's version where the ranks run."
            ) from None
    for module in payload.get("submodules", ()):
        _import(module, f"import {module}", module.partition(".")[0])
    if payload.get("data"):
        load_values(payload["data"], payload["value_names"], ns)
    # The notebook's ``from __future__`` features (flags); none of this module's own.
    flags: int = payload.get("flags", 0)
    tree = ast.parse(source, filename)
    ast.increment_lineno(tree, offset)
    last = None
    if payload.get("returns_last") and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    _mark("imports")
    exec(compile(tree, filename, "exec", flags=flags, dont_inherit=True), ns)
    if last is None:
        return None
    return eval(compile(last, filename, "eval", flags=flags, dont_inherit=True), ns)


#: The marks this interpreter sent. The supervisor keeps the first of each (the launch's), so
#: a session's later cells do not send theirs: two frames, and two wake-ups of the supervisor,
#: per rank and cell.
_marked: set[str] = set()


def _mark(name: str) -> None:
    """Stamp a moment of the launch timeline (``nbdist.timeline``) for the supervisor."""
    if name == "imports" and not _AT_IMPORTS:
        _AT_IMPORTS.update(sys.modules)
    if reporting.channel is not None and name not in _marked:
        _marked.add(name)
        reporting.channel.event({"t": "marks", "at": {name: time.time()}})


def _run_script(payload: ScriptPayload) -> Any:
    import runpy

    argv = [payload["path"], *payload.get("argv", ())]
    old = sys.argv
    sys.argv = argv
    try:
        runpy.run_path(payload["path"], run_name="__main__")
    finally:
        sys.argv = old
    return None


def _run_call(payload: CallPayload) -> Any:
    fn: Callable[..., Any] = payload["fn"]
    _children.install()  # a script's functions (its __main__'s) reach the rank's children too
    return fn(*payload.get("args", ()), **payload.get("kwargs", {}))


def _run_pull(payload: PullPayload) -> Pulled | Any:
    """``%dist_pull``: a session variable's value (from the rank asked; None from the rest),
    with the threads that may be changing it while it is read and sent; rank -1
    (``%dist_gather``): the bare value, from every rank."""
    rank = int(os.environ.get("RANK", "0"))
    if payload["rank"] not in (rank, -1):
        return None
    name: str = payload["name"]
    if name not in _session_ns:
        known = ", ".join(session_names()) or "none yet"
        raise NameError(f"rank {rank} has no variable {name!r} (defined there: {known})")
    if payload["rank"] == -1:
        return _session_ns[name]
    return Pulled(_session_ns[name], _cell_threads())


def _cell_threads() -> list[str]:
    """The threads running on this rank that the user's code started: not the main thread,
    nbdist's own (``nbdist-*``) nor tqdm's monitor. A cell is never running beside a pull
    (the session runs one at a time), but a thread a cell started may be."""
    main = threading.main_thread()
    return sorted(t.name for t in threading.enumerate()
                  if t is not main and t.is_alive() and not t.name.startswith("nbdist")
                  and not type(t).__module__.startswith("tqdm"))


def _run_push(payload: PushPayload) -> Any:
    """``%dist_push``: set a session variable on this rank to the notebook's value."""
    load_values(payload["data"], [payload["name"]], _namespace(payload))
    return None


def _run(payload: Payload) -> Any:
    """Run a payload of any kind (``nbdist.protocol``) and return its value."""
    if payload["kind"] == "cell":
        return _run_cell(payload)  # a cell marks "imports" after its imports
    _mark("imports")
    if payload["kind"] == "script":
        return _run_script(payload)
    if payload["kind"] == "call":
        return _run_call(payload)
    if payload["kind"] == "pull":
        return _run_pull(payload)
    return _run_push(payload)


def _format_error(exc: BaseException) -> ErrorRecord:
    """The user's traceback, without the runtime's own frames; never raises.

    Everything here runs user code: ``str()``/``repr()`` of the exception, its ``__notes__``,
    the exceptions it chains to. Any of them may raise, and an error escaping from here would
    end the rank (and break a session, with all its variables): each part falls back on its own.
    """
    kind = _type_name(exc)
    message = _message(exc)
    if isinstance(exc, SystemExit):
        message = f"called sys.exit({exc.code!r})" if _is_plain(exc.code) else (
            f"called sys.exit() with a {_type_name(exc.code)}")
    try:
        te = traceback.TracebackException.from_exception(exc)
        for cur in _chain(te):
            cur.stack = traceback.StackSummary.from_list(
                [f for f in cur.stack if not str(f.filename).startswith(_PKG_DIR)]
            )
        text = "".join(te.format())
    except Exception as why:
        text = _bare_traceback(exc, kind, message, why)
    if isinstance(exc, SystemExit):  # "SystemExit: 3" says less than what the code did
        plain = f"SystemExit: {_message(exc)}\n" if exc.code is not None else "SystemExit\n"
        said = f"SystemExit: the rank's code {message}\n"
        text = text[:-len(plain)] + said if text.endswith(plain) else text + said
    return {"type": kind, "message": message, "traceback": text}


def _is_plain(code: object) -> bool:
    return code is None or type(code) in (int, str, bool)


def _type_name(obj: object) -> str:
    try:
        return str(type(obj).__name__)
    except Exception:  # a metaclass that hides even the name
        return "exception"


def _message(exc: BaseException) -> str:
    """``str(exc)``; if that raises, its ``repr``; if that raises too, the type name alone."""
    try:
        return str(exc)
    except Exception as why:
        failed = f"its __str__ raised {_type_name(why)}"
    try:
        return f"{repr(exc)} ({failed})"
    except Exception as why:
        return (f"<unprintable {_type_name(exc)}: {failed} and its __repr__ raised "
                f"{_type_name(why)}>")


def _bare_traceback(exc: BaseException, kind: str, message: str, why: Exception) -> str:
    """The frames of ``exc`` alone, when the full report (chain, notes) could not be made."""
    try:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not str(f.filename).startswith(_PKG_DIR)]
        stack = "".join(traceback.format_list(frames))
    except Exception:
        stack = ""
    head = "Traceback (most recent call last):\n" if stack else ""
    return (f"{head}{stack}{kind}: {message}\n(nbdist could not format the rest of this "
            f"traceback: {_type_name(why)} while reading the exception)\n")


def _chain(te: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    seen: set[int] = set()
    stack = [te]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        stack.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)


def _flush_all() -> None:
    reporting.send_late()  # the newest counts and reports before the payload's end
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    flush_c_stdio()


#: Set by main() from NBDIST_SYNC (the supervisor's marker for this interpreter).
_sync_marker = b""
#: fd → a copy of it made at start (close-on-exec) and what it was: the rank's stdout and
#: stderr, the pipes to its supervisor (``_keep_outputs``).
_outputs: dict[int, tuple[int, tuple[int, int]]] = {}


def _keep_outputs() -> None:
    """Keep a copy of fds 1 and 2, so that a cell that closes them does not end the pipes to
    the supervisor, and :func:`_restore_outputs` can put them back."""
    import fcntl

    for fd in (1, 2):
        try:
            copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
            st = os.fstat(copy)
        except OSError:
            continue
        _outputs[fd] = (copy, (st.st_dev, st.st_ino))


def _restore_outputs() -> None:
    """After a cell: put back fd 1 or 2 if the cell closed it (or closed it and opened
    something else there), and say so on the rank's stderr. A session's next cells print
    again (before: every later cell failed with "Bad file descriptor"). A deliberate
    ``os.dup2(devnull, 1)`` is undone too: the supervisor learns that a cell's output is all
    there from a marker written on these pipes (``_mark_synced``)."""
    restored = []
    for fd, (copy, was) in _outputs.items():
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == was:
                continue
        except OSError:
            pass
        try:
            os.dup2(copy, fd)
        except OSError:
            continue
        restored.append("stdout" if fd == 1 else "stderr")
    if restored:
        with contextlib.suppress(OSError):
            os.write(2, (f"nbdist: this cell closed or replaced the rank's "
                         f"{' and '.join(restored)}; restored for the next cell (what the cell "
                         "wrote meanwhile is lost)\n").encode())


def _mark_synced() -> None:
    """Write the supervisor's sync marker on stdout and stderr, after the cell's output.

    A session's rank stays alive after a cell, so its output pipes never reach end of file:
    the marker tells the supervisor that everything printed before the result has been
    forwarded, and the cell's last lines land in its own panel, not the next cell's.
    """
    if _sync_marker:
        for fd in (1, 2):
            try:
                os.write(fd, _sync_marker)  # one write, below PIPE_BUF: never split or interleaved
            except OSError:
                pass


def _own_rss() -> int | None:
    """This interpreter's resident memory in bytes (Linux's ``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


#: Modules loaded before any payload or warm-up: what every fresh interpreter has anyway.
_AT_START: set[str] = set()
#: Modules loaded once the first payload's own imports were done (its "imports" mark): what
#: the code imports later, lazily, is reported at any depth (``_imported_since``).
_AT_IMPORTS: set[str] = set()


def _warm(modules: list[str]) -> None:
    """Import what the last job used, so the next one finds it loaded (a warm interpreter)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException:  # anything a module does at import must not kill the rank
            pass


def _set_env(spec: EnvFrame) -> None:
    env = spec.get("env", {})
    threads_before = os.environ.get("OMP_NUM_THREADS")
    for name in spec.get("unset", ()):
        os.environ.pop(name, None)
    os.environ.update(env)
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    threads = env.get("OMP_NUM_THREADS")
    if threads is not None and threads != threads_before:
        _size_thread_pools(threads)


#: Variables that size one BLAS library's threads ahead of OMP_NUM_THREADS, which each of them
#: falls back on (as under torchrun, which sets only OMP_NUM_THREADS).
_OWN_THREADS_VARS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS",),
    "blis": ("BLIS_NUM_THREADS",),
    "flexiblas": ("FLEXIBLAS_NUM_THREADS",),
}


def _size_thread_pools(threads: str) -> None:
    """Give the thread pools loaded before this rank had its OMP_NUM_THREADS that number.

    A fresh interpreter starts with the variable set, and torch, OpenMP and the BLAS libraries
    (numpy's OpenBLAS, MKL) size their pools from it as they load. A rank forked from a zygote
    or a warm interpreter loaded them earlier, sized for the whole machine: torch is told
    ``set_num_threads``, the others through threadpoolctl, except a BLAS whose own variable
    (``OPENBLAS_NUM_THREADS``, ...) the rank has, which it read at load as a fresh rank would.
    """
    try:
        n = int(threads)
    except ValueError:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.set_num_threads(n)
        except (AttributeError, RuntimeError):
            pass
    if not any(m in sys.modules for m in ("numpy", "scipy", "torch")):
        return  # nothing that loads a BLAS or an OpenMP runtime: a fresh interpreter's state
    try:
        from threadpoolctl import ThreadpoolController

        for lib in ThreadpoolController().lib_controllers:
            own = _OWN_THREADS_VARS.get(lib.internal_api, ())
            if lib.user_api in ("blas", "openmp") and not any(v in os.environ for v in own):
                lib.set_num_threads(n)
    except Exception:  # threadpoolctl missing, or a library it cannot drive: left as loaded
        pass


def _imported_since(before: set[str], base: set[str] | None = None) -> list[str]:
    """Installed modules imported since ``before``: what a warm interpreter imports next time.

    The top-level packages; of the modules imported after ``base`` (the interpreter's modules
    once the payload's own imports were done: a forked rank's include its zygote's), those one
    level down and, at any depth, those whose parent package was loaded at ``base``. Importing a
    package does not import all it has, and a zygote that imported ``torch`` alone left the
    rest to every rank it forked. In the order they were imported (a zygote importing them in
    turn finds most of them loaded by the first ones), at most ``MAX_REPORTED`` (the
    shallowest).

    Only packages of the installation (``is_installed``) qualify: the user's own modules may be
    edited before the next run, and a warm interpreter would hold the old code. Of what came
    after the payload's imports from the first module of ``NOT_AHEAD`` on, only what does not
    touch torch qualifies (``_tied_to_not_ahead``).
    """
    dirs: list[str] | None = None
    names = []
    base = base or before
    order = list(sys.modules)  # the order they were imported in
    new = set(order) - before
    later = new - base  # a submodule in ``base`` came with the payload's imports
    cut = next((i for i, n in enumerate(order) if n in later and _not_ahead(n)), None)
    if cut is not None:
        dropped = _tied_to_not_ahead(later.intersection(order[cut:]))
        later -= dropped
        new -= dropped
    for name in {n for n in new if "." not in n}.union(
            n for n in later if n.count(".") == 1 or n.rpartition(".")[0] in base):
        top = name.partition(".")[0]
        if not top or top.startswith("_") or top == "__main__":
            continue
        path = getattr(sys.modules.get(top), "__file__", None)
        if not isinstance(path, str):
            continue
        installed = _installed.get(path)
        if installed is None:
            if dirs is None:
                dirs = installation_dirs()
            installed = _installed[path] = is_installed(path, dirs)
        if installed:
            names.append(name)
    if len(names) > MAX_REPORTED:
        names = sorted(names, key=lambda n: (n.count("."), n))[:MAX_REPORTED]
    chosen = set(names)
    return [n for n in order if n in chosen]


#: What a zygote never imports ahead of a rank's code when the rank imported it as its code ran, nor
#: what of torch the rank imported after it (``_tied_to_not_ahead``): ``torch._dynamo``, which DDP's
#: constructor imports. Loaded before ``init_process_group``, it made the end of a common DDP
#: function (``destroy_process_group()``, then return with the model alive) hang in torch's teardown
#: in about one later run in five: the DDP reducer's process group is freed with the GIL held, and
#: gloo's worker thread, freeing the last collective's work, waits for the GIL (pytorch#56297); a
#: fresh rank, which imports it in the constructor, did not hang in 32 runs
#: (docs/magics.md#warm-ranks-the-second-run-starts-fast). A rank whose own imports bring it gets it
#: ahead, as a fresh interpreter does.
NOT_AHEAD = ("torch._dynamo",)


def _not_ahead(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in NOT_AHEAD)


def _tied_to_not_ahead(after: set[str]) -> set[str]:
    """Of ``after`` (modules a rank imported from the first ``NOT_AHEAD`` module on), those a
    zygote must not import ahead either: the modules of that module's own top-level package
    (``torch._functorch``, ``torch.fx``, ...), and every module of a package that refers to that
    package (a module of it among its globals, or something defined there), which importing
    might bring ``torch._dynamo`` with it. What is left does not touch torch (``sympy`` and
    ``mpmath``, half a second of a DDP rank's first call): kept."""
    roots = {p.partition(".")[0] for p in NOT_AHEAD}
    tops = {n.partition(".")[0] for n in after} - roots
    for name in after:
        top = name.partition(".")[0]
        if top in tops and _refers_to(sys.modules.get(name), roots):
            tops.discard(top)
    return {n for n in after if n.partition(".")[0] not in tops}


def _refers_to(module: object, roots: set[str]) -> bool:
    """Whether ``module`` holds a module of ``roots`` (``import torch``) or something defined
    in one (``from torch import nn`` or ``Tensor``) among its globals."""
    for value in list(getattr(module, "__dict__", {}).values()):
        name: object
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
            name = getattr(value, "__module__", None)
        else:
            continue
        if isinstance(name, str) and name.partition(".")[0] in roots:
            return True
    return False


#: The most module names a rank reports after its code (``_imported_since``): a fresh rank
#: of a DDP function reports about 300 (6 kB), and the list travels to the zygote in one packet.
MAX_REPORTED = 1000

#: A module's file → whether it is installed (``_imported_since``): a session's rank asks
#: after every cell, and following the symlinks of each path (``realpath``) took about half of
#: what a trivial cell cost its rank.
_installed: dict[str, bool] = {}


#: Set while a payload runs: a SIGINT raises KeyboardInterrupt in the user's code then, and is
#: ignored while the rank waits or reports.
_interruptible = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    if _interruptible.is_set():
        raise KeyboardInterrupt


class _Cells:
    """Which session cell runs, so that an interrupt reaches the cell it was meant for.

    An interrupt may arrive before its cell started (still in the inbox: it is raised as the
    cell starts) or after it ended (ignored, instead of hitting the next cell).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: int | None = None
        self.last = 0  # the highest cell number started
        self.interrupted: set[int] = set()

    def interrupt(self, cell: int) -> None:
        with self.lock:
            if cell == self.running:
                os.kill(os.getpid(), signal.SIGINT)  # handled in the main thread, in the cell
            elif cell > self.last:
                self.interrupted.add(cell)

    def start(self, cell: int | None) -> None:
        """Mark ``cell`` running; raise KeyboardInterrupt if it was interrupted already."""
        if cell is None:
            return
        with self.lock:
            self.running, self.last = cell, max(self.last, cell)
            if cell in self.interrupted:
                self.interrupted.discard(cell)
                raise KeyboardInterrupt

    def end(self) -> None:
        with self.lock:
            self.running = None


_cells = _Cells()


class _PayloadLoader(pickle.Unpickler):
    """Unpickles a payload; its shipped code (``protocol.ShippedCode``) is installed as it is
    read, before the functions and values of that code that come after it in the stream."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("nbdist.protocol", "shipped_code"):
            return _install_code
        return super().find_class(module, name)


def _install_code(digest: str, files: tuple[tuple[str, bytes], ...],
                  modules: tuple[tuple[str, int, int], ...]) -> ShippedCode:
    code = ShippedCode(digest, files, modules)
    localcode.install(code)
    return code


def _load_payload(data: bytes) -> Payload:
    stream = io.BytesIO(data)
    loaded: Payload = _PayloadLoader(stream).load()
    if loaded["kind"] == "push" and "data" not in loaded:
        # A large push: its value's pickle follows the payload's in the frame (PushPayload).
        # (a view, not a copy: load_values reads any bytes-like object)
        cast(Any, loaded)["data"] = memoryview(data)[stream.tell():]
    return loaded


def _serve(inbox: queue.Queue[tuple[int, bytes] | None], chan: FrameWriter) -> None:  # noqa: C901 - one branch per frame kind
    import cloudpickle

    keeping = False  # the last payload's "keep": a session's rank serves on after an error
    while True:
        frame = inbox.get()
        if frame is None or frame[0] == Frame.QUIT:
            return
        if frame[0] == Frame.WARM:
            _warm(json.loads(frame[1]))
            chan.event({"t": "warm"})
            continue
        if frame[0] == Frame.ENV:
            _set_env(json.loads(frame[1]))
            continue
        try:
            payload: Payload = _load_payload(frame[1])
        except Exception as exc:
            # Its shipped code could not be installed (a code folder another user made), a
            # value could not be unpickled: the user's error, said as one, not a crash.
            chan.send(Frame.ERROR, json.dumps(_format_error(exc)).encode())
            if not keeping:
                return
            continue
        keeping = bool(payload.get("keep"))
        try:
            reporting.bridge_tqdm()
            rich.install()  # display() and matplotlib's figures reach the notebook
            chan.event({"t": "state", "state": "running"})
            try:
                _interruptible.set()
                try:
                    _cells.start(payload.get("cell"))
                    value = _run(payload)
                finally:
                    # First: an interrupt (``_cells.interrupt``) from here on is ignored, never
                    # raised in this cleanup (skipping the rest of it, and leaving the next
                    # interrupt to end the serve loop, and the rank, between cells).
                    _interruptible.clear()
                    rich.flush_figures()  # the cell's open figures, as the inline backend
                    # What follows (the end mark, modules, names, value or error) goes to the
                    # supervisor in one write (see ``FrameWriter.hold``).
                    chan.hold()
                    _mark("end")
                    _cells.end()
                    _restore_outputs()
            except BaseException as exc:
                # sys.exit(0) (or exit(), sys.exit()) ends the rank's code successfully with no
                # value, as a script's exit status 0 does under torchrun. Any other SystemExit is
                # a failure. In a session it ends the cell, never the rank: the session and its
                # variables stay, as a Jupyter kernel stays after a cell's sys.exit.
                if isinstance(exc, SystemExit) and _is_plain(exc.code) and exc.code in (None, 0):
                    value = None
                else:
                    _flush_all()
                    if payload.get("session"):
                        _mark_synced()
                        debugger.last_traceback = exc.__traceback__  # for %dist_debug
                    chan.send(Frame.ERROR, json.dumps(_format_error(exc)).encode())
                    if not payload.get("keep"):
                        return
                    continue
            finally:
                chan.event({"t": "modules", "names": _imported_since(_AT_START, _AT_IMPORTS)})
                if payload.get("session"):
                    names: NamesEvent = {"t": "names", "names": session_names()}
                    rss = _own_rss()
                    if rss is not None:
                        names["rss"] = rss
                    chan.event(names)
            _flush_all()
            if payload.get("session"):
                _mark_synced()
            try:
                # A session's value goes in pieces (``%dist_pull`` of a large one: nbdist.values).
                segments = values.dumps(value) if payload.get("session") else [
                    memoryview(cloudpickle.dumps(value))]
            except Exception as exc:
                chan.send(Frame.ERROR, json.dumps({
                    "type": "PicklingError",
                    "message": f"the cell's value of type {type(value).__qualname__} cannot be "
                    f"pickled to return it to the notebook: {_type_name(exc)}: {_message(exc)}",
                    "traceback": "",
                }).encode())
            else:
                # The type travels apart from the value, so a driver that cannot unpickle the
                # value can still say what it was.
                kind = type(value)
                name = f"{kind.__module__}.{kind.__qualname__}"
                if payload.get("session"):
                    chan.event({"t": "result", "type": name, "sizes": [s.nbytes for s in segments],
                                "bytes": values.bytes_segments(segments)})
                    for seg in segments:
                        for start in range(0, seg.nbytes, values.CHUNK):
                            chan.send(Frame.PIECE, seg[start:start + values.CHUNK])
                    chan.send(Frame.RESULT, b"")
                else:
                    chan.event({"t": "result", "type": name})
                    chan.send(Frame.RESULT, segments[0])
                del segments
        finally:
            chan.release()
        if not payload.get("keep"):
            return


def _guard_forks(pacer: Pacer) -> None:
    """Make a fork of the rank safe for its output and its control channel (see ``streams.Pacer``).

    The channel's and the progress bars' locks are held over the fork too
    (``reporting.before_fork``), so that the child never inherits one taken by a thread it does
    not have (nbdist.progress in a DataLoader worker would hang) nor half a frame in the
    channel's buffer. Registered in the rank only, never in the zygote, whose forks are the
    ranks themselves.
    """

    # Each hook runs both halves whatever the first raises: Python forks all the same (it
    # prints what a hook raised), and a half skipped would leave its locks held for good, or
    # release in the after-hooks a lock its before-hook never took.
    def before() -> None:
        try:
            reporting.before_fork()
        finally:
            pacer.before_fork()

    def parent() -> None:
        try:
            pacer.after_fork_in_parent()
        finally:
            reporting.after_fork_in_parent()

    def child() -> None:
        try:
            pacer.after_fork_in_child()
        finally:
            reporting.after_fork_in_child()

    os.register_at_fork(before=before, after_in_parent=parent, after_in_child=child)


def main(guard: bool = True) -> None:
    """Run the rank; ``guard``: first leave a guardian behind (``host.guard``), unless the caller
    is one already (a zygote, which forks this rank)."""
    global _sync_marker
    if guard:
        host.guard()
    _sync_marker = os.environ.pop("NBDIST_SYNC", "").encode()
    fd_in = int(os.environ.pop("NBDIST_CTL_IN"))
    fd_out = int(os.environ.pop("NBDIST_CTL_OUT"))
    ctl_in = os.fdopen(fd_in, "rb")
    chan = reporting.channel = FrameWriter(os.fdopen(fd_out, "wb"))
    inbox: queue.Queue[tuple[int, bytes] | None] = queue.Queue()

    def watch() -> None:
        # End of file on control-in: the supervisor is gone. Take the whole group with us.
        while True:
            frame = read_frame(ctl_in)
            if frame is None:
                break
            if frame[0] == Frame.INTERRUPT:
                _cells.interrupt(int(frame[1]))
                continue
            if frame[0] == Frame.DEBUG:
                debugger.inbox.put(frame[1].decode("utf-8", "replace"))
                continue
            if frame[0] == Frame.STACKS:
                _dump_stacks_here()
                continue
            if frame[0] == Frame.COLLECTIVES:
                _ask_collectives(chan)
                continue
            inbox.put(frame)
        inbox.put(None)
        debugger.inbox.put(None)
        if not done.is_set():
            _kill_descendants()
            os.killpg(os.getpgid(0), signal.SIGKILL)

    done = threading.Event()
    signal.signal(signal.SIGINT, _on_sigint)
    _AT_START.update(sys.modules)
    host.become_subreaper()
    _keep_outputs()
    threading.Thread(target=watch, name="nbdist-watch", daemon=True).start()
    pacer = Pacer()
    pacer.install()
    _guard_forks(pacer)
    jax_cluster.install()  # jax.distributed.initialize() finds the job, if the cell uses JAX
    ready: StateEvent = {"t": "state", "state": "ready", "pid": os.getpid(), "at": time.time()}
    debugger.install(lambda text: chan.event({"t": "debug", "text": text}))
    stacks = register_stack_dumps()
    if stacks is not None:
        ready["stacks"] = stacks
    chan.event(ready)
    code = 0
    try:
        _serve(inbox, chan)
    except BaseException:
        # nbdist's own failure (not the user's code, whose errors _serve reports): leave the
        # traceback on stderr, where the supervisor keeps the rank's last lines.
        traceback.print_exc()
        code = 70  # EX_SOFTWARE
    finally:
        done.set()
        _flush_all()
        _kill_descendants()
        os._exit(code)


#: Requests for the flight recorder's dump, answered by one thread of their own.
_fr_requests: queue.Queue[None] | None = None


def _ask_collectives(chan: FrameWriter) -> None:
    """Answer ``Frame.COLLECTIVES`` off the control thread (torch's dump takes the GIL, which
    a busy cell holds), from one thread started at the first request and kept: a thread
    starting or ending while ``faulthandler`` walks the threads for a stack dump can crash
    the rank, so none does during one (the supervisor asks for the stacks after this answer).
    """
    global _fr_requests
    if _fr_requests is None:
        _fr_requests = queue.Queue()
        threading.Thread(target=_answer_collectives, args=(chan, _fr_requests), daemon=True,
                         name="nbdist-fr").start()
    _fr_requests.put(None)


def _answer_collectives(chan: FrameWriter, requests: queue.Queue[None]) -> None:
    from nbdist.rank import flight

    while True:
        requests.get()
        try:
            chan.send(Frame.COLLECTIVES, flight.dump())
        except (OSError, ValueError):
            return  # the supervisor is gone


#: Where the rank's stack dumps go (kept open for its life; ``faulthandler`` keeps the fd).
_stacks_file: Any = None


def register_stack_dumps() -> str | None:
    """Write every thread's stack to a file on ``STACKS_SIGNAL``; the path the supervisor
    reads it at, or None where that cannot be.

    ``faulthandler`` writes from the signal handler itself, in C, so a rank stuck in C code (a
    collective, a lock, a long numpy call) still answers. On Linux the file is unlinked at once
    and read through ``/proc/PID/fd``: nothing is left behind however the rank ends.
    """
    global _stacks_file
    import faulthandler
    import tempfile

    sig = getattr(signal, STACKS_SIGNAL, None)
    if sig is None:
        return None
    try:
        fd, path = tempfile.mkstemp(prefix="nbdist-stacks-", suffix=".txt")
        _stacks_file = os.fdopen(fd, "w")
        faulthandler.register(sig, file=_stacks_file, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return None
    proc_path = f"/proc/{os.getpid()}/fd/{fd}"
    if os.path.exists(proc_path):
        os.unlink(path)
        return proc_path
    return path


def _dump_stacks_here() -> None:
    """Write every thread's stack to the dump file from this thread, without a signal (the
    supervisor asks so where ``STACKS_SIGNAL`` would end the rank, be lost, or cut short a
    system call: ``rank/signals.py``). Needs the GIL, which a rank stuck in C code holding it
    does not give: the supervisor then reads the stacks from outside (py-spy) or says why not."""
    import faulthandler

    if _stacks_file is not None:
        try:
            faulthandler.dump_traceback(file=_stacks_file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass  # the supervisor reports no dump within its wait


def _kill_descendants() -> None:
    """Kill every process the rank started, including those that left its process group."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # nothing here may stop the rank from leaving
        pass

"""What capture refuses before launch, and how it says so.

Every refusal names the variable, its type, the cell line that uses it (editor numbering: the
``%%distributed`` line is line 1) and what to do instead. The objects are real ones (real
locks, files, sockets, sqlite connections, widgets); the only stand-in is the CUDA tensor,
since this machine has no GPU: a real ``torch.Tensor`` subclass whose ``is_cuda`` and
``device`` say CUDA.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import socket
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nbdist.capture import capture_cell
from nbdist.errors import CaptureError, CaptureWarning
from nbdist.settings import settings


def cuda_tensor() -> Any:
    """A CPU tensor that reports itself as a CUDA tensor (no GPU on the test machine)."""
    import torch

    class StandInCudaTensor(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

        @property
        def device(self) -> Any:  # type: ignore[override]
            return torch.device("cuda", 0)

    return torch.zeros(2).as_subclass(StandInCudaTensor)


def cuda_model() -> Any:
    import torch

    model = torch.nn.Linear(2, 1)
    model.weight = torch.nn.Parameter(cuda_tensor())
    return model


def widget() -> Any:
    import ipywidgets

    return ipywidgets.IntSlider()


@pytest.fixture
def made(tmp_path: Path) -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Make objects for a test and release what they hold (files, sockets, connections)."""
    objs: list[Any] = []

    def make(factory: Callable[[], Any]) -> Any:
        obj = factory()
        objs.append(obj)
        return obj

    yield make
    for obj in objs:
        for held in (obj, *(obj.values() if isinstance(obj, dict) else ())):
            close = getattr(held, "close", None)
            if callable(close):
                close()


def _file(tmp_path: Path) -> Any:
    path = tmp_path / "data.txt"
    path.write_text("x")
    return open(path)  # closed by the `made` fixture


REFUSALS: list[tuple[str, str, Callable[[Path], Any], str, list[str]]] = [
    # (id, variable, factory, cell, [what the message must say])
    ("lock", "lock", lambda _: threading.Lock(), "with lock:\n    pass",
     ["a lock (_thread.lock)", "dist.barrier()"]),
    ("rlock", "lock", lambda _: threading.RLock(), "with lock:\n    pass",
     ["a lock (_thread.RLock)"]),
    ("event", "ev", lambda _: threading.Event(), "ev.set()", ["a lock (threading.Event)"]),
    ("process-lock", "plock", lambda _: multiprocessing.get_context("fork").Lock(),
     "plock.acquire()", ["a lock (multiprocessing.synchronize.Lock)"]),
    ("thread", "worker", lambda _: threading.Thread(target=print), "worker.start()",
     ["a thread (threading.Thread)", "start the thread inside the cell"]),
    ("open-file", "f", _file, "f.read()",
     ["an open file (_io.TextIOWrapper)", "open the file inside the cell"]),
    ("socket", "sock", lambda _: socket.socket(), "sock.connect(('localhost', 1))",
     ["a socket (socket.socket)", "open the connection inside the cell"]),
    ("generator", "gen", lambda _: (i for i in range(3)), "next(gen)",
     ["it is a generator;", "list(gen)"]),
    ("sqlite", "conn", lambda _: sqlite3.connect(":memory:"), "conn.execute('select 1')",
     ["a database connection (sqlite3.Connection)", "sqlite3.connect(path)"]),
    ("widget", "slider", lambda _: widget(), "slider.value",
     ["a Jupyter widget (ipywidgets.widgets.widget_int.IntSlider)", "nbdist.progress"]),
    ("cuda-tensor", "x", lambda _: cuda_tensor(), "y = x * 2",
     ["a CUDA tensor (", "x.cpu()", "LOCAL_RANK"]),
    ("cuda-model", "model", lambda _: cuda_model(), "model(None)",
     ["a torch.nn.modules.linear.Linear that holds a CUDA tensor", "at model._parameters",
      "model.cpu()"]),
    ("in-a-container", "cfg", lambda _: {"db": sqlite3.connect(":memory:")}, "cfg['db']",
     ["a dict that holds a database connection (sqlite3.Connection) at cfg['db']"]),
    ("cloudpickle-refuses", "h", lambda _: hashlib.sha256(), "h.update(b'x')",
     ["a _hashlib.HASH that cloudpickle cannot serialise",
      "TypeError: cannot pickle '_hashlib.HASH' object", "create it inside the cell"]),
]


@pytest.mark.parametrize(("var", "factory", "cell", "says"),
                         [pytest.param(*r[1:], id=r[0],
                                       marks=pytest.mark.torch if r[0].startswith("cuda") else ())
                          for r in REFUSALS])
def test_unshippable_values_are_refused_with_a_fix(
    made: Any, tmp_path: Path, var: str, factory: Callable[[Path], Any], cell: str,
    says: list[str],
) -> None:
    """The error names the variable, its type, the cell line and what to do instead."""
    ns = {"__name__": "__main__", var: made(lambda: factory(tmp_path))}
    with pytest.raises(CaptureError) as info:
        capture_cell(f"x0 = 1\n{cell}", ns, line_offset=1)
    message = str(info.value)
    first = cell.splitlines()[0]
    assert message.startswith(f"cannot send {var!r} to the ranks: it is ")
    assert f"the cell uses it at line 3: `{first}`" in message
    assert "\nInstead: " in message
    for text in says:
        assert text in message


def test_a_notebook_function_is_refused_for_what_its_globals_hold(made: Any) -> None:
    """A notebook function that uses a notebook lock is refused, naming the path to the lock."""
    ns: dict[str, Any] = {"__name__": "__main__", "lock": made(threading.Lock)}
    exec(compile("def critical():\n    with lock:\n        return 1\n", "<nb>", "exec",
                 dont_inherit=True), ns)
    with pytest.raises(CaptureError, match=r"'critical' to the ranks: it is a function that "
                       r"holds a lock \(_thread.lock\) at critical → global lock; the cell uses "
                       r"it at line 1: `critical\(\)`"):
        capture_cell("critical()", ns)


def test_an_optional_name_that_cannot_travel_is_left_to_the_cell(made: Any) -> None:
    """A name the cell binds itself on some paths is not refused; --show-source says why."""
    ns = {"__name__": "__main__", "conn": made(lambda: sqlite3.connect(":memory:"))}
    captured = capture_cell("if False:\n    conn = None\nconn", ns)
    assert captured.values == []
    assert "conn" in captured.left_out
    assert "# not shipped: conn (a database connection (sqlite3.Connection), which cannot " \
        "be sent; the cell can do without it)" in captured.function_source()


SYNTAX_REFUSALS = [
    # IPython's transform drops leading blank lines; the line numbers must not move
    ("after-blank-lines", "\n\nx = 1\n%load_ext autoreload", 5, ["`%load_ext autoreload`"]),
    ("load-ext", "%load_ext autoreload", 2, ["%load_ext cannot run on the ranks",
                                              "run it in a normal cell"]),
    ("cell-magic-inside", "x = 1\n%%time\ny = 2", 3, ["%%time cannot run on the ranks",
                                                     "must start a cell"]),
    ("help", "x = 1\nx?", 3, ["help (`?`) is for the notebook"]),
    ("time", "%time x = 1", 2, ["time.perf_counter()"]),
    ("alias", "x = 1\n%ls -l", 3, ["write it as a shell command", "`!ls -l`"]),
    ("env", "%env A=1", 2, ["--env KEY=VALUE"]),
    ("cd", "%cd /tmp", 2, ["os.chdir"]),
    ("other-magic", "%who", 2, ["magics run in the notebook's kernel"]),
    ("await", "import asyncio\nawait asyncio.sleep(0)", 3, ["top-level `await`",
                                                           "asyncio.run(main())"]),
    ("async-for", "async for x in y:\n    pass", 2, ["`async for`"]),
    ("async-comprehension", "[x async for x in y]", 2, ["top-level `await`"]),
    ("yield", "x = 1\nyield x", 3, ["`yield` outside a function"]),
    ("relative-import", "from . import helpers", 2, ["a relative import needs a package"]),
    ("star-import-unknown", "from nbdist_no_such_module import *", 2,
     ["Import the names you use explicitly", "ModuleNotFoundError"]),
]


@pytest.mark.parametrize(("cell", "line", "says"), [r[1:] for r in SYNTAX_REFUSALS],
                         ids=[r[0] for r in SYNTAX_REFUSALS])
def test_what_cannot_run_on_a_rank_is_refused_naming_the_line(
    ip: Any, cell: str, line: int, says: list[str],
) -> None:
    """Notebook-only magics, top-level await/yield and relative imports fail before launch."""
    with pytest.raises(CaptureError) as info:
        capture_cell(cell, {}, transform=ip.transform_cell, line_offset=1)
    message = str(info.value)
    assert message.startswith(f"line {line}: `{cell.splitlines()[line - 2].strip()}`: ")
    for text in says:
        assert text in message


def test_compile_errors_are_found_before_launch(ip: Any) -> None:
    """Code Python refuses to compile (``return`` outside a function) fails at capture, with
    the editor's line number."""
    with pytest.raises(SyntaxError, match="'return' outside function") as info:
        capture_cell("x = 1\nreturn x", {}, transform=ip.transform_cell, line_offset=1)
    assert info.value.lineno == 3


def test_shell_commands_and_pip_are_allowed(ip: Any) -> None:
    """``!cmd``, ``x = !cmd``, ``%pip`` and ``%sx`` are what a rank can run: no refusal."""
    capture_cell("!nvidia-smi\nx = !pip list\n%pip --version\n%sx ls", {},
                 transform=ip.transform_cell)


def test_large_values_warn_with_name_and_size() -> None:
    """A value over the threshold warns, naming it, its size and how to raise the limit."""
    ns = {"__name__": "__main__", "big": bytes(2_500_000)}
    with pytest.warns(CaptureWarning) as record:
        capture_cell("x = 0\nlen(big)", ns, warn_bytes=1_000_000, line_offset=1)
    (w,) = record
    assert str(w.message).startswith("'big' (bytes) is 2.5 MB pickled, over the 1.0 MB warning "
                                     "threshold: every rank receives a copy at start-up")
    assert "line 3: `len(big)`" in str(w.message)
    assert "%config DistMagics.large_value_mb = 3" in str(w.message)


def test_the_default_threshold_is_a_module_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the threshold nothing warns; lowering ``settings.large_value_mb`` makes it warn."""
    ns = {"__name__": "__main__", "big": bytes(200_000)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        capture_cell("big", ns)  # 100 MB by default
    monkeypatch.setattr(settings, "large_value_mb", 0.1)
    with pytest.warns(CaptureWarning, match="'big' .* over the 100.0 KB warning threshold"):
        capture_cell("big", ns)

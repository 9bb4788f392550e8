"""Capture proven on real ranks: ``%%distributed -np 2`` in a real InteractiveShell, one launch
per category of the capture table (``test_capture.py`` checks each shape on its own), plus
``--show-source``, refusals before launch, and ``--export`` run under a real ``torchrun``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nbdist import job as jobs
from nbdist.channel import free_port
from nbdist.errors import CaptureError, CaptureWarning, DistributedError

from .helpers import rank_processes, run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def nb(ip: Any) -> Iterator[Any]:
    """The shared shell, with the names a test defines removed afterwards."""
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]


@pytest.mark.slow
def test_imports_and_notebook_modules_work_on_ranks(
    nb: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cell's own imports (anywhere, aliased, submodules, ``*``, a local helper module) and
    modules, objects and a local helper module imported in earlier cells all work in the ranks'
    fresh interpreters."""
    (tmp_path / "nbdist_capture_helpers.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run(nb, "import math\nimport collections as col\nimport os.path as osp\n"
            "from fractions import Fraction\nimport xml.etree.ElementTree\n"
            "import nbdist_capture_helpers\n")
    value = run(nb, """%%distributed -np 2
import json
import nbdist_capture_helpers as helpers
if True:
    import statistics
try:
    import tomllib as toml
except ImportError:
    toml = None
import torch.nn.functional as F
from math import *
def mean3():
    import statistics as st
    return st.mean([1, 2, 3])
(math.factorial(4), col.deque([1, 2]).pop(), osp.join("a", "b"), str(Fraction(1, 3) * 3),
 xml.etree.ElementTree.fromstring("<a/>").tag, nbdist_capture_helpers.triple(2), floor(2.5),
 mean3(), toml is not None, json.dumps([1]), F.relu.__name__, helpers.triple(3))
""")
    assert value == (24, 2, "a/b", "1", "a", 6, 2, 2, True, "[1]", "relu", 9)


NOTEBOOK_DEFS = '''
import enum
import functools
import torch
from dataclasses import dataclass
from torch.utils.data import Dataset
K = 3
def inner(x):
    return x + K
def outer(x):
    return inner(x) * 2
def twice(f):
    @functools.wraps(f)
    def wrapper(x):
        return f(f(x))
    return wrapper
@twice
def inc(x):
    return x + 1
square = functools.partial(pow, exp=2)
add = lambda a, b: a + b
def make_counter(start):
    def count(n):
        return start + n
    return count
from10 = make_counter(10)
@dataclass
class Point:
    x: int
    y: int = 0
class Color(enum.Enum):
    RED = 1
    BLUE = 2
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 1)
    def forward(self, x):
        return self.fc(x)
class Squares(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i * i
scale = 1
def scaled(x):
    return x * scale
'''


@pytest.mark.slow
def test_notebook_functions_and_classes_work_on_ranks(nb: Any) -> None:
    """Notebook functions (chained, decorated, partial, lambda, closure) and classes
    (dataclass, enum, nn.Module, Dataset) run on the ranks with their globals and imports,
    and see what the cell assigns; a notebook class comes back as the notebook's class."""
    run(nb, NOTEBOOK_DEFS)
    value = run(nb, """%%distributed -np 2
from torch.utils.data import DataLoader
scale = 10
net = Net()
(outer(1), inc(0), inc.__name__, square(7), add(2, 3), from10(5), Point(1), Color(2).name,
 tuple(net(torch.zeros(3, 2)).shape), [int(b) for b in DataLoader(Squares(), batch_size=None)],
 scaled(2))
""")
    Point = nb.user_ns["Point"]
    assert value == (8, 2, "inc", 49, 5, 15, Point(1, 0), "BLUE", (3, 1), [0, 1, 4, 9], 20)
    assert type(value[6]) is Point


@pytest.mark.slow
def test_values_travel_shared_and_large_ones_warn(nb: Any) -> None:
    """Values arrive with their sharing intact; one over ``DistMagics.large_value_mb`` warns
    with its name and size before the launch."""
    run(nb, "import numpy\na = [1]\nb = a\narr = numpy.arange(4)\nbig = bytes(1_500_000)\n")
    magics = nb.magics_manager.registry["DistMagics"]
    run(nb, "%config DistMagics.large_value_mb = 1")
    try:
        with pytest.warns(CaptureWarning, match=r"'big' \(bytes\) is 1.5 MB pickled, over "
                          r"the 1.0 MB warning threshold"):
            value = run(nb, "%%distributed -np 2\na.append(2)\n(b, int(arr.sum()), len(big))")
    finally:
        magics.large_value_mb = 100.0
    assert value == ([1, 2], 6, 1_500_000)


def test_python_scoping_on_ranks(nb: Any) -> None:
    """Names the cell binds first are its own (even over an unshippable notebook value);
    names it reads first, optional names, comprehensions, global, nonlocal, del, walrus,
    match, try/except NameError, class bodies, defaults and f-strings behave as in Python."""
    run(nb, "import threading\nlock = threading.Lock()\nx = 5\ntotal = 10\nmode = 'notebook'\n"
            "k = 2\nbase_lr = 0.1\ndefault = 3\ncache = {'a': 1}\npoint = (1, 2)\nname = 'nb'\n")
    value = run(nb, """%%distributed -np 2
lock = "cell's own"
y = x + 1
x = 100
total += 5
if False:
    mode = 'cell'
squares = [i * k for i in range(3)]
def setup():
    global state
    state = 42
setup()
def outer():
    n = 0
    def inc():
        nonlocal n
        n += 1
    inc()
    inc()
    return n
tmp = 1
del tmp
if (w := 10) > 5:
    pass
match point:
    case (p, q):
        r = p + q
try:
    cache
except NameError:
    cache = {}
class Cfg:
    k = 1
    lr = base_lr * 2
    ys = [k for _ in range(2)]
def f(a=default) -> int:
    return a
(lock, y, x, total, mode, squares, state, outer(), w, r, len(cache), Cfg.lr, Cfg.ys, f(),
 f"{name!r:>5}")
""")
    assert value == ("cell's own", 6, 100, 15, "notebook", [0, 2, 4], 42, 2, 10, 3, 1, 0.2,
                     [2, 2], 3, " 'nb'")


def test_shell_commands_and_pip_run_on_each_rank(nb: Any, capsys: pytest.CaptureFixture[str]
                                                 ) -> None:
    """``!cmd`` (with ``{var}`` from the notebook and ``$ENV``), ``x = !cmd`` and ``%pip`` run
    through a shell on every rank, and ``display`` prints there."""
    run(nb, "word = 'hello'")
    value = run(nb, "%%distributed -np 2\n"
                    "!echo \"bang on rank $RANK\"\n"
                    "out = !echo {word}\n"
                    "%pip --version\n"
                    "display({'shown': 'on a rank'})\n"
                    "(out, _exit_code)\n")
    assert value == (["hello"], 0)
    printed = capsys.readouterr().out
    assert "bang on rank 0" in printed and "bang on rank 1" in printed
    assert printed.count("pip ") >= 2  # "pip X.Y from ..." once per rank
    assert printed.count("{'shown': 'on a rank'}") == 2


def test_a_trailing_semicolon_suppresses_the_value(nb: Any) -> None:
    """As in IPython, ``;`` after the last expression gives the cell no value."""
    assert run(nb, "%%distributed -np 2\nimport os\nint(os.environ['RANK']) + 41;") is None


def test_remote_tracebacks_point_at_the_cell_lines(nb: Any) -> None:
    """A rank's traceback names the cell and the editor's line (``%%distributed`` is line 1)
    and shows the user's source line."""
    with pytest.raises(DistributedError) as info:
        run(nb, "%%distributed -np 2\nimport os\nx = 1\nif os.environ['RANK'] == '1':\n"
                "    raise ValueError('boom on rank 1')\nx\n")
    tb = info.value.failures[1]
    assert re.search(r'File "<cell In\[\d+\]>", line 5, in <module>\n'
                     r"    raise ValueError\('boom on rank 1'\)", tb), tb


def test_refusals_come_before_any_launch(nb: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An unshippable value is refused through the magic, naming the line, shown as just its
    message (no nbdist frames); nothing starts."""
    run(nb, "import threading\nlock = threading.Lock()")
    started = len(jobs.jobs())
    capsys.readouterr()
    result = nb.run_cell("%%distributed -np 2\nx = 1\nwith lock:\n    x = 2\n")
    assert isinstance(result.error_in_exec, CaptureError)
    assert "cannot send 'lock' to the ranks: it is a lock (_thread.lock); the cell uses it at " \
        "line 3: `with lock:`" in str(result.error_in_exec)
    shown = capsys.readouterr().out
    assert shown.startswith("CaptureError: cannot send 'lock'")
    assert re.search(r"nbdist[/\\]capture", shown) is None, shown  # no frame of capture's
    assert len(jobs.jobs()) == started and rank_processes() == []


def test_show_source_prints_the_function_and_does_not_run(
    nb: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    """``--show-source`` prints imports, values with kind and size, and the cell; no job."""
    run(nb, "import numpy as np\nSCALE = 3\ndef scaled(x):\n    return x * SCALE\n")
    started = len(jobs.jobs())
    assert run(nb, "%%distributed -np 2 --show-source\ny = scaled(np.pi)\ny") is None
    text = capsys.readouterr().out
    assert text.startswith("def cell():\n    # imported on the rank, by name (never pickled)\n"
                           "    import numpy as np\n")
    assert re.search(r"    scaled = \.\.\.  # function, \d+(\.\d)? [KB]+\n", text), text
    assert text.endswith("    # the cell\n    y = scaled(np.pi)\n    return y\n\n")
    assert len(jobs.jobs()) == started


EXPORT_CELL = """%%distributed --export {path} -np 2
import os
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([scaled(float(weights.sum()))])
dist.all_reduce(t)
!echo "shell on rank $RANK of {{os.environ['WORLD_SIZE']}}"
dist.destroy_process_group()
(int(os.environ["WORLD_SIZE"]), t.item())
"""


@pytest.mark.slow
def test_export_runs_under_plain_torchrun(nb: Any, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--export`` writes a script and its values that ``torchrun --nproc-per-node 2`` runs
    from another directory, without nbdist importable, giving the cell's result on rank 0."""
    run(nb, "import torch\nimport numpy as np\nSCALE = 3\nweights = np.arange(4.0)\n"
            "def scaled(x):\n    return x * SCALE\n")
    script = tmp_path / "out" / "train.py"
    script.parent.mkdir()
    assert run(nb, EXPORT_CELL.format(path=script)) is None
    assert f"run it with: torchrun --nproc-per-node 2 {script}" in capsys.readouterr().out
    assert sorted(p.name for p in script.parent.iterdir()) == ["train.py", "train.values.pkl"]
    # Any import of nbdist fails: the exported files must stand on their own.
    blocker = tmp_path / "blocker" / "nbdist"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the export must not need nbdist')")
    env = {**os.environ, "PYTHONPATH": str(blocker.parent), "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port("127.0.0.1")),
         str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "(2, 36.0)" in lines  # rank 0 prints the value: (0+1+2+3) * 3, summed over 2 ranks
    assert lines.count("(2, 36.0)") == 1
    assert "shell on rank 0 of 2" in lines and "shell on rank 1 of 2" in lines


def test_export_without_values_is_one_plain_script(nb: Any, tmp_path: Path) -> None:
    """A cell that needs only imports exports to a single script that plain python runs."""
    run(nb, "import math")
    script = tmp_path / "job.py"
    run(nb, f"%%distributed --export {script} -np 1\nfrom __future__ import annotations\n"
            f"def f(x: Undefined) -> int:\n    return 1\ny = 2; math.factorial(3) + f(0) + y")
    assert [p.name for p in tmp_path.iterdir()] == ["job.py"]
    text = script.read_text()
    assert "import math\n" in text
    assert not re.search(r"^\s*(import|from) nbdist", text, re.MULTILINE)
    assert text.split('"""')[2].lstrip().startswith("from __future__ import annotations\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out == "9\n"


@pytest.mark.parametrize(("line", "message"), [
    ("--export train.txt -np 2", "--export takes the path of the .py script to write"),
    ("--export /no/such/dir/train.py -np 2", "there is no folder '/no/such/dir'"),
])
def test_bad_export_paths_are_usage_errors(nb: Any, line: str, message: str) -> None:
    """A path that is not a .py file in an existing folder is refused before anything runs."""
    from IPython.core.error import UsageError

    result = nb.run_cell(f"%%distributed {line}\n1")
    assert type(result.error_in_exec) is UsageError
    assert message in str(result.error_in_exec)

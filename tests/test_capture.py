"""Cell capture, shape by shape: what each cell takes from the notebook, and what it computes.

Every shape is checked three ways:

- the notebook's own answer (the cell run in the notebook's namespace, as IPython runs it) is
  the expected value, so the table cannot drift from Python's semantics;
- capture takes exactly the expected names by name (imports) and by value;
- the payload runs in a *fresh* interpreter through the rank runtime (``runtime._run_cell``)
  and gives the notebook's answer. All shapes share one interpreter to keep this cheap; real
  ``%%distributed`` launches, category by category, are in ``test_capture_ranks.py``.

Notebooks are plain namespaces with ``__name__ == "__main__"`` (what makes cloudpickle ship
their functions by value, as for IPython's); cells go through the real shell's
``transform_cell``.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from IPython.core.displayhook import DisplayHook

from nbdist.capture import Captured, capture_cell


@dataclass(frozen=True)
class Shape:
    id: str
    notebook: str
    cell: str
    imports: frozenset[str] = frozenset()
    values: frozenset[str] = frozenset()
    left_out: frozenset[str] = frozenset()
    expect: Any = None
    oracle: bool = True  # False: the notebook itself cannot give the answer (see the shape)


def S(id: str, notebook: str, cell: str, *, imports: str = "", values: str = "",
      left_out: str = "", expect: Any = None, oracle: bool = True) -> Shape:
    return Shape(id, notebook, cell, frozenset(imports.split()), frozenset(values.split()),
                 frozenset(left_out.split()), expect, oracle)


LOCK = "import threading\n{} = threading.Lock()"  # a notebook name that cannot be shipped

SHAPES = [
    # -- imports inside the cell: the cell's own, nothing taken from the notebook ----------
    S("imp-top", "", "import math\nmath.factorial(5)", expect=120),
    S("imp-in-if", "", "if True:\n    import json\njson.dumps([1])", expect="[1]"),
    S("imp-in-try", "", "try:\n    import tomllib as toml\nexcept ImportError:\n"
      "    toml = None\ntoml is not None", expect=sys.version_info >= (3, 11)),  # tomllib: 3.11
    S("imp-in-function", "", "def mean3():\n    import statistics\n"
      "    return statistics.mean([1, 2, 3])\nmean3()", expect=2),
    S("imp-alias", "", "import collections as c\nc.Counter('aab')['a']", expect=2),
    S("imp-submodule-alias", "", "import os.path as osp\nosp.basename('/a/b')", expect="b"),
    S("imp-submodule", "", "import os.path\nos.path.join('a', 'b')", expect="a/b"),
    S("imp-torch-functional", "", "import torch\nimport torch.nn.functional as F\n"
      "F.relu(torch.tensor([-1.0, 2.0])).tolist()", expect=[0.0, 2.0]),
    S("imp-from-alias", "", "from collections import OrderedDict as OD\nlist(OD(a=1))",
      expect=["a"]),
    S("imp-star-shadows-notebook", LOCK.format("floor"), "from math import *\nfloor(2.5)",
      expect=2),
    S("imp-future-annotations", LOCK.format("Undefined"),
      "from __future__ import annotations\ndef f(x: Undefined) -> Undefined:\n    return 1\n"
      "(f(0), f.__annotations__['x'])", expect=(1, "Undefined")),
    S("imp-shadows-notebook-name", LOCK.format("np"), "import math as np\nnp.pi > 3",
      expect=True),
    # -- modules and objects imported in earlier cells: imported again by name -------------
    S("nb-module", "import math", "math.factorial(4)", imports="math", expect=24),
    S("nb-module-alias", "import collections as col", "col.deque([1, 2]).pop()",
      imports="col", expect=2),
    S("nb-submodule-alias", "import os.path as osp", "osp.join('a', 'b')", imports="osp",
      expect="a/b"),
    S("nb-object-alias", "from math import sqrt as s", "s(16.0)", imports="s", expect=4.0),
    S("nb-package-submodules", "import xml.etree.ElementTree",
      "xml.etree.ElementTree.fromstring('<a/>').tag", imports="xml", expect="a"),
    S("nb-star-import", "from math import *", "floor(2.5)", imports="floor", expect=2),
    S("nb-class-imported", "from fractions import Fraction", "str(Fraction(1, 3) * 3)",
      imports="Fraction", expect="1"),
    S("nb-torch-alias", "import torch\nimport torch.nn as nn", "nn.Linear(2, 3).out_features",
      imports="nn", expect=3),
    # -- functions and classes defined in the notebook: by value, with their globals -------
    S("nb-function", "def double(x):\n    return 2 * x", "double(21)", values="double",
      expect=42),
    S("nb-function-chain", "K = 3\ndef inner(x):\n    return x + K\n"
      "def outer(x):\n    return inner(x) * 2", "outer(1)", values="outer", expect=8),
    S("nb-function-imports", "import math\ndef hyp(a, b):\n    return math.hypot(a, b)",
      "hyp(3, 4)", values="hyp", expect=5.0),
    S("nb-decorated", "import functools\ndef twice(f):\n    @functools.wraps(f)\n"
      "    def wrapper(x):\n        return f(f(x))\n    return wrapper\n"
      "@twice\ndef inc(x):\n    return x + 1", "(inc(0), inc.__name__)", values="inc",
      expect=(2, "inc")),
    S("nb-partial", "import functools\ndef power(base, exp):\n    return base ** exp\n"
      "square = functools.partial(power, exp=2)", "square(7)", values="square", expect=49),
    S("nb-lambda", "add = lambda a, b: a + b", "add(2, 3)", values="add", expect=5),
    S("nb-closure", "def make_counter(start):\n    def count(n):\n        return start + n\n"
      "    return count\nfrom10 = make_counter(10)", "from10(5)", values="from10", expect=15),
    S("nb-dataclass", "from dataclasses import dataclass, field\n@dataclass\nclass Point:\n"
      "    x: int\n    y: int = 0\n    tags: list = field(default_factory=list)",
      "p = Point(1)\n(p.x, p.y, p.tags, Point(2, 3) == Point(2, 3))", values="Point",
      expect=(1, 0, [], True)),
    S("nb-enum", "import enum\nclass Color(enum.Enum):\n    RED = 1\n    BLUE = 2",
      "(Color(2).name, Color.RED in Color)", values="Color", expect=("BLUE", True)),
    S("nb-torch-module", "import torch\nclass Net(torch.nn.Module):\n"
      "    def __init__(self):\n        super().__init__()\n"
      "        self.fc = torch.nn.Linear(2, 1)\n    def forward(self, x):\n"
      "        return self.fc(x)",
      "net = Net()\n(tuple(net(torch.zeros(3, 2)).shape), sum(p.numel() for p in "
      "net.parameters()))", imports="torch", values="Net", expect=((3, 1), 3)),
    S("nb-torch-dataset", "from torch.utils.data import Dataset\nclass Squares(Dataset):\n"
      "    def __len__(self):\n        return 4\n    def __getitem__(self, i):\n"
      "        return i * i", "from torch.utils.data import DataLoader\n"
      "[int(b) for b in DataLoader(Squares(), batch_size=None)]", values="Squares",
      expect=[0, 1, 4, 9]),
    S("nb-instance", "class Cfg:\n    def __init__(self):\n        self.lr = 0.1\ncfg = Cfg()",
      "cfg.lr * 10", values="cfg", expect=1.0),
    S("nb-subclass", "class A:\n    x = 1\nclass B(A):\n    y = 2",
      "(B.x + B.y, issubclass(B, A))", values="A B", expect=(3, True)),
    S("nb-class-descriptors", "class T:\n    scale = 2\n    @staticmethod\n    def s(x):\n"
      "        return x\n    @classmethod\n    def c(cls):\n        return cls.scale\n"
      "    @property\n    def p(self):\n        return 7", "(T.s(1), T.c(), T().p)",
      values="T", expect=(1, 2, 7)),
    S("nb-generator-function", "def countdown(n):\n    yield from range(n, 0, -1)",
      "list(countdown(3))", values="countdown", expect=[3, 2, 1]),
    S("nb-function-sees-cell-globals", "scale = 1\ndef scaled(x):\n    return x * scale",
      "scale = 10\nscaled(2)", values="scaled", expect=20),
    S("nb-function-mutates-global", "count = 0\ndef bump():\n    global count\n"
      "    count += 1", "bump()\nbump()\ncount", values="bump count", expect=2),
    S("nb-default-argument", "table = {'a': 1}\ndef lookup(k, t=table):\n    return t[k]",
      "lookup('a')", values="lookup", expect=1),
    # -- plain values ----------------------------------------------------------------------
    S("val-plain", "n = 3\nname = 'x'\nitems = [1, 2]\nconf = {'a': (1, 2)}",
      "(n, name, items, conf)", values="n name items conf",
      expect=(3, "x", [1, 2], {"a": (1, 2)})),
    S("val-numpy", "import numpy\narr = numpy.arange(4)", "int(arr.sum())", values="arr",
      expect=6),
    S("val-shared-identity", "a = [1]\nb = a", "a.append(2)\nb", values="a b", expect=[1, 2]),
    S("val-cpu-tensor", "import torch\nt = torch.ones(3)", "float(t.sum())", values="t",
      expect=3.0),
    S("val-shadowed-builtin", "len = lambda x: 42", "len([1])", values="len", expect=42),
    S("val-builtins-stay", "", "sorted(range(3), reverse=True)", expect=[2, 1, 0]),
    # -- scoping -----------------------------------------------------------------------------
    S("sc-assigned-before-use", LOCK.format("x"), "x = 5\nx + 1", expect=6),
    S("sc-used-before-assignment", "x = 5", "y = x + 1\nx = 100\ny", values="x", expect=6),
    S("sc-augmented", "total = 10", "total += 5\ntotal", values="total", expect=15),
    S("sc-conditional-assignment", "mode = 'notebook'", "if False:\n    mode = 'cell'\nmode",
      values="mode", expect="notebook"),
    S("sc-both-branches-assign", LOCK.format("mode"),
      "import random\nif random.random() < 2:\n    mode = 'a'\nelse:\n    mode = 'b'\nmode",
      expect="a"),
    S("sc-loop-target-unshippable", LOCK.format("i"), "for i in range(3):\n    pass\ni",
      left_out="i", expect=2),
    S("sc-loop-zero-iterations", "i = 7", "for i in range(0):\n    pass\ni", values="i",
      expect=7),
    S("sc-while-true-break", LOCK.format("batch"),
      "n = 0\nwhile True:\n    batch = n\n    n += 1\n    if n == 3:\n        break\nbatch",
      expect=2),
    S("sc-comprehension-variable", "x = 'notebook'", "[x for x in range(3)]\nx", values="x",
      expect="notebook"),
    S("sc-comprehension-reads", "k = 2", "[i * k for i in range(3)]", values="k",
      expect=[0, 2, 4]),
    S("sc-comprehension-subscript-target", "d = {}", "[d['k'] for d['k'] in range(3)]",
      values="d", expect=[0, 1, 2]),
    S("sc-nested-comprehensions", "k = 2\nrows = [[1, 2], [3]]",
      "({v * k for r in rows for v in r}, sum(v for r in rows for v in r), "
      "{i: i * k for i in range(2)})", values="k rows", expect=({2, 4, 6}, 6, {0: 0, 1: 2})),
    S("sc-global-in-cell-function", LOCK.format("state"),
      "def setup():\n    global state\n    state = 42\nsetup()\nstate", expect=42),
    S("sc-nonlocal", LOCK.format("n"), "def outer():\n    n = 0\n    def inc():\n"
      "        nonlocal n\n        n += 1\n    inc()\n    inc()\n    return n\nouter()",
      expect=2),
    S("sc-del-notebook-name", "tmp = 5", "y = tmp\ndel tmp\ny", values="tmp", expect=5),
    S("sc-del-cell-name", LOCK.format("tmp"), "tmp = 1\ndel tmp\n'ok'", expect="ok"),
    S("sc-walrus", LOCK.format("n"), "if (n := 10) > 5:\n    pass\nn", expect=10),
    S("sc-walrus-in-comprehension", "last = 'notebook'", "[(last := i) for i in range(3)]\nlast",
      values="last", expect=2),
    S("sc-match-sequence", "import threading\npoint = (1, 2)\nx = threading.Lock()",
      "match point:\n    case (x, y):\n        r = x + y\n    case _:\n        r = 0\nr",
      values="point", expect=3),
    S("sc-match-class", "from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int\n"
      "    y: int\npt = P(1, 2)", "match pt:\n    case P(x=0):\n        where = 'axis'\n"
      "    case P(x=a, y=b):\n        where = a + b\nwhere", values="P pt", expect=3),
    S("sc-try-nameerror-present", "cache = {'a': 1}",
      "try:\n    cache\nexcept NameError:\n    cache = {}\nlen(cache)", values="cache",
      expect=1),
    # The notebook's lock cannot travel and the cell can do without it: its fallback runs.
    S("sc-try-nameerror-unshippable", LOCK.format("cache"),
      "try:\n    cache\nexcept NameError:\n    cache = {}\ntype(cache).__name__",
      left_out="cache", expect="dict", oracle=False),
    S("sc-try-nameerror-absent", "", "try:\n    cache\nexcept NameError:\n    cache = {}\n"
      "len(cache)", expect=0),
    S("sc-module-annotation", "Alias = int", "x: Alias = 3\nx", imports="Alias", expect=3),
    S("sc-function-annotation", "Tensor = float",
      "def f(a: Tensor) -> Tensor:\n    return a\nf.__annotations__['a'] is float",
      imports="Tensor", expect=True),
    S("sc-fstring", "name = 'nb'", "f'{name!r:>6}|{1 + 1=}'", values="name",
      expect="  'nb'|1 + 1=2"),
    S("sc-global-at-top-level", "x = 1", "global x\nx", values="x", expect=1),
    S("sc-class-decorator", "def register(c):\n    c.registered = True\n    return c",
      "@register\nclass A:\n    pass\nA.registered", values="register", expect=True),
    S("sc-lambda-default", "d = 4", "f = lambda a=d: a\nd = 0\nf()", values="d", expect=4),
    S("sc-match-mapping", "cfg = {'lr': 0.1, 'x': 1}",
      "match cfg:\n    case {'lr': lr, **rest}:\n        out = (lr, rest)\nout",
      values="cfg", expect=(0.1, {"x": 1})),
    S("sc-decorator", "def tag(f):\n    f.tag = 'tagged'\n    return f",
      "@tag\ndef g():\n    pass\ng.tag", values="tag", expect="tagged"),
    S("sc-class-body", "base_lr = 0.1", "class Cfg:\n    lr = base_lr * 2\n"
      "    def get(self):\n        return self.lr\nCfg().get()", values="base_lr", expect=0.2),
    S("sc-class-names-not-in-methods", "x = 'global'", "class A:\n    x = 'class'\n"
      "    def f(self):\n        return x\nA().f()", values="x", expect="global"),
    S("sc-class-body-comprehension", "k = 10",
      "class A:\n    k = 1\n    ys = [k for _ in range(2)]\nA.ys", values="k", expect=[10, 10]),
    S("sc-default-argument", "default = 3", "def f(a=default):\n    return a\nf()",
      values="default", expect=3),
    S("sc-lambda", "offset = 1", "g = lambda v: v + offset\ng(1)", values="offset", expect=2),
    S("sc-called-before-rebinding", "thr = 5", "def over(v):\n    return v > thr\n"
      "first = over(6)\nthr = 10\n(first, over(6))", values="thr", expect=(True, False)),
    S("sc-called-after-binding", LOCK.format("thr"),
      "def over(v):\n    return v > thr\nthr = 10\nover(6)", expect=False),
    S("sc-closure-over-cell-local", LOCK.format("v"), "def outer():\n    v = 5\n"
      "    def inner():\n        return v\n    return inner()\nouter()", expect=5),
    S("sc-except-as", LOCK.format("err"), "try:\n    1 / 0\nexcept ZeroDivisionError as err:\n"
      "    msg = str(err)\nmsg", expect="division by zero"),
    S("sc-with-as", LOCK.format("f"), "import io\nwith io.StringIO('hi') as f:\n"
      "    text = f.read()\ntext", expect="hi"),
    S("sc-key-lambda", "weights = {'a': 2, 'b': 1}", "sorted(weights, key=lambda k: weights[k])",
      values="weights", expect=["b", "a"]),
    S("sc-star-unpacking", LOCK.format("head"), "head, *rest = [1, 2, 3]\n(head, rest)",
      expect=(1, [2, 3])),
    S("sc-raising-branch", LOCK.format("value"), "import os\n"
      "if os.environ.get('NBDIST_NEVER_SET'):\n    raise SystemExit\nelse:\n    value = 1\nvalue",
      expect=1),
    # -- IPython syntax: shell commands run on the rank ------------------------------------
    S("ip-bang", "", "!true\n'after'", expect="after", oracle=False),
    S("ip-getoutput-expands-variables", "word = 'hello'", "out = !echo {word} $word\nout",
      values="word", expect=["hello hello"], oracle=False),
    S("ip-double-bang", "", "!!echo hi", expect=["hi"], oracle=False),
    S("ip-bang-in-function", "", "def f():\n    !true\n    return 1\nf()", expect=1,
      oracle=False),
    S("ip-sx-magic", "", "%sx echo hi", expect=["hi"], oracle=False),
    # -- the cell's value --------------------------------------------------------------------
    S("ret-last-expression", "", "x = 1\nx + 1", expect=2),
    S("ret-semicolon", "", "1 + 1;", expect=None),
    S("ret-semicolon-comment", "", "1 + 1;  # quiet", expect=None),
    S("ret-assignment", "", "x = 1", expect=None),
    S("ret-string-with-semicolon", "", "'a;'", expect="a;"),
    S("ret-multiline-expression", "", "(1 +\n 2)", expect=3),
    S("ret-comment-only", "", "# nothing", expect=None),
    S("ret-if-last", "", "if True:\n    5", expect=None),
]


def _needs_torch(shape: Shape) -> bool:
    return "torch" in shape.notebook + shape.cell


#: The shapes as parameters: those that import torch skip where it is not installed.
SHAPE_PARAMS = [pytest.param(s, id=s.id, marks=pytest.mark.torch if _needs_torch(s) else ())
                for s in SHAPES]


def test_the_table_is_large_and_unique() -> None:
    """The suite covers at least 60 cell shapes, each with its own id."""
    assert len(SHAPES) >= 60
    assert len({s.id for s in SHAPES}) == len(SHAPES)


def notebook(shape: Shape) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    # dont_inherit: this test module's ``from __future__ import annotations`` must not leak
    exec(compile(shape.notebook, "<notebook>", "exec", dont_inherit=True), ns)
    return ns


def run_as_notebook(ip: Any, shape: Shape) -> Any:
    """The cell's value when the notebook itself runs it (IPython's rules for the value)."""
    ns = notebook(shape)
    tree = ast.parse(ip.transform_cell(shape.cell))
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and \
            not DisplayHook.semicolon_at_end_of_expression(shape.cell):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec", dont_inherit=True), ns)
    return None if last is None else eval(compile(last, "<cell>", "eval", dont_inherit=True), ns)


def capture(ip: Any, shape: Shape) -> Captured:
    return capture_cell(shape.cell, notebook(shape), transform=ip.transform_cell,
                        filename=f"<cell {shape.id}>", line_offset=1)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_capture_takes_exactly_what_the_cell_needs(ip: Any, shape: Shape) -> None:
    """Each shape re-imports and ships exactly its expected names, and the expected value is
    the one the notebook itself computes."""
    captured = capture(ip, shape)
    assert {i.name for i in captured.imports} == shape.imports
    assert {v.name for v in captured.values} == shape.values
    assert set(captured.left_out) == shape.left_out
    if shape.oracle:
        assert run_as_notebook(ip, shape) == shape.expect


RUNNER = textwrap.dedent("""
    import sys, traceback, cloudpickle
    from nbdist.rank import runtime
    with open(sys.argv[1], "rb") as f:
        payloads = cloudpickle.load(f)
    results = {}
    for key, payload in payloads.items():
        try:
            results[key] = ("ok", runtime._run_cell(payload))
        except BaseException as exc:
            results[key] = ("error", "".join(traceback.format_exception(exc)))
    with open(sys.argv[2], "wb") as f:
        cloudpickle.dump(results, f)
""")


@pytest.fixture(scope="module")
def fresh_results(ip: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every shape's payload, run by the rank runtime in one fresh interpreter."""
    folder = tmp_path_factory.mktemp("capture")
    torch = importlib.util.find_spec("torch") is not None
    payloads = {s.id: capture(ip, s).payload() for s in SHAPES if torch or not _needs_torch(s)}
    (folder / "in.pkl").write_bytes(cloudpickle.dumps(payloads))
    subprocess.run([sys.executable, "-c", RUNNER, str(folder / "in.pkl"), str(folder / "out.pkl")],
                   check=True, timeout=300, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = cloudpickle.loads((folder / "out.pkl").read_bytes())
    return result


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_shape_runs_in_a_fresh_interpreter(fresh_results: dict[str, Any], shape: Shape) -> None:
    """The captured payload alone, in an interpreter that never saw the notebook, gives the
    notebook's value."""
    status, value = fresh_results[shape.id]
    assert status == "ok", value
    assert value == shape.expect


def test_packages_bring_the_submodules_the_cell_reaches(ip: Any) -> None:
    """``xml.etree.ElementTree.x`` through a notebook ``import xml.etree.ElementTree`` imports
    the submodules on the rank, which ``import xml`` alone does not load."""
    shape = next(s for s in SHAPES if s.id == "nb-package-submodules")
    assert capture(ip, shape).submodules == ["xml.etree", "xml.etree.ElementTree"]


def test_ipython_names_never_travel() -> None:
    """In, Out, input history and get_ipython stay in the notebook."""
    ns = {"__name__": "__main__", "In": ["", "x"], "Out": {1: 2}, "_i1": "x", "_ih": [],
          "get_ipython": lambda: None}
    captured = capture_cell("(In, Out, _i1, _ih, get_ipython)", ns)
    assert captured.values == [] and captured.imports == []


def test_values_share_one_pickle_stream() -> None:
    """Sizes add up to the payload's data, and an object shared by two names is stored once."""
    ns = {"__name__": "__main__", "big": list(range(1000))}
    ns["alias"] = ns["big"]
    captured = capture_cell("(big, alias)", ns)
    sizes = {v.name: v.size for v in captured.values}
    assert sum(sizes.values()) == len(captured.data)
    assert sizes["alias"] < 20 < sizes["big"]  # a memo reference, not a second copy


def test_show_source_lists_imports_values_and_the_return() -> None:
    """The generated function shows imports, each value's kind and size, and ``return``."""
    ns = notebook(S("x", "import math\nimport numpy\nK = 3\ndef f(x):\n    return x * K\n"
                         "arr = numpy.zeros(10)", ""))
    text = capture_cell("y = f(math.pi)\n(y,\n arr.sum())", ns).function_source()
    assert "    import math\n" in text
    assert "    f = ...  # function, " in text
    assert "    arr = ...  # numpy.ndarray, " in text
    assert "    return (y,\n" in text and "            arr.sum())" in text
    compile(text, "<show-source>", "exec")  # it is valid Python


def test_semicolon_inside_a_string_at_the_end_keeps_the_value() -> None:
    """Only a real trailing ``;`` token suppresses the value, as in IPython."""
    assert capture_cell("x = 'a;'\nx", {}).returns_last
    assert not capture_cell("x = 1\nx ;  # done", {}).returns_last


def test_capture_does_not_import_heavy_or_optional_packages(tmp_path: Path) -> None:
    """Recognising Spark, widgets and CUDA tensors by type names needs none of them imported."""
    code = textwrap.dedent("""
        import sys, threading
        from nbdist.capture import capture_cell
        from nbdist.errors import CaptureError
        ns = {"__name__": "__main__", "x": 3, "lock": threading.Lock()}
        capture_cell("x + 1", ns)
        try:
            capture_cell("lock", ns)
        except CaptureError:
            pass
        heavy = sorted(m for m in ("pyspark", "torch", "ipywidgets", "IPython", "numpy")
                       if m in sys.modules)
        print(heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


def test_capture_package_exports_exactly_its_all() -> None:
    """``nbdist.capture`` exposes exactly the names in its ``__all__``; the rest is private."""
    import __future__

    import nbdist.capture as package

    feature = type(__future__.annotations)  # ``from __future__ import annotations`` is a name
    public = {name for name, value in vars(package).items()
              if not name.startswith("_") and not isinstance(value, feature)}
    assert sorted(package.__all__) == sorted(public) == sorted([
        "RANK_MAGICS", "Captured", "Import", "Value", "call_code",
        "capture_cell",
    ])

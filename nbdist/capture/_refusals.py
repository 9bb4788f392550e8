"""Values that cannot travel to the ranks, and the messages that refuse them.

Each kind of value nbdist refuses (a Spark handle or DataFrame, a thread, a lock, an open
file, a socket, a generator, a database connection, a Jupyter widget, a CUDA tensor) is a
:class:`Rule`: what it is, why it cannot travel, and what to do instead. :func:`rule_for`
finds the rule of an object by the module and name of its type and its bases, so that capture
never imports Spark, widgets or torch to recognise their objects. The pickler
(``_ship.py``) asks it about every object it meets, and raises :class:`Refused`;
:func:`refusal` turns that into the :class:`~nbdist.errors.CaptureError` the user sees, with
the path to the object when it sits inside the value (``cfg['db']``, ``f → global lock``).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nbdist.capture._scope import Need
from nbdist.capture._syntax import Lines
from nbdist.errors import CaptureError


@dataclass(frozen=True)
class Rule:
    """A kind of value that cannot travel: the three parts of its message, and an optional
    check of the object itself (a tensor is refused only when it is on a GPU)."""

    what: str
    why: str
    instead: str
    check: Callable[[Any], bool] | None = None


def _is_cuda(obj: Any) -> bool:
    try:
        return obj.is_cuda is True
    except Exception:
        return False


_SPARK_HANDLE = Rule(
    "a Spark handle",
    "it belongs to the Spark driver in this notebook, which the ranks cannot reach",
    "read the data inside the cell with a library the ranks have (e.g. pandas.read_parquet("
    "path)), or turn what the ranks need into plain data in an earlier cell "
    "(pdf = df.toPandas()) and use that",
)
_SPARK_DATA = Rule(
    "a Spark DataFrame (or RDD)",
    "its rows live in Spark, and it only works next to the notebook's Spark session",
    "read a DataFrame's rows on the ranks with nbdist.shard(df) (each rank gets its part, "
    "streamed; use df only that way in the cell), or collect what the ranks need into plain "
    "data in an earlier cell (pdf = df.toPandas())",
)
_THREAD = Rule(
    "a thread", "a thread runs only inside the process that started it",
    "start the thread inside the cell, so each rank runs its own",
)
_LOCK = Rule(
    "a lock", "a lock synchronises only the threads of the process that made it",
    "create it inside the cell; to coordinate ranks use torch.distributed "
    "(dist.barrier(), dist.all_reduce(...))",
)
_FILE = Rule(
    "an open file", "an open file belongs to the process that opened it",
    "pass the path, and open the file inside the cell (with open(path) as f: ...)",
)
_SOCKET = Rule(
    "a socket", "a connection belongs to the process that opened it",
    "open the connection inside the cell, so each rank makes its own",
)
_GENERATOR = Rule(
    "a generator", "a running generator's state cannot be copied to another process",
    "ship what it produces (items = list(gen) in an earlier cell), or the function that "
    "creates it, and call that inside the cell",
)
_DATABASE = Rule(
    "a database connection", "a connection belongs to the process that opened it",
    "connect inside the cell (e.g. sqlite3.connect(path)), so each rank opens its own",
)
_WIDGET = Rule(
    "a Jupyter widget", "widgets live in the notebook's front end, which ranks do not have",
    "keep widgets in the notebook; on the ranks print, or use nbdist.progress(...) and "
    "nbdist.report(...) to show progress and metrics in the panel",
)
_CUDA = Rule(
    "a CUDA tensor",
    "it lives in this machine's GPU memory; ranks may run on other machines, each with its "
    "own GPU",
    "move it to the CPU first (x.cpu(), model.cpu(), or a state_dict of CPU tensors), or "
    "create it on the rank: torch.device('cuda', int(os.environ['LOCAL_RANK']))",
    check=_is_cuda,
)
_SPARK_HANDLES = frozenset({
    "SparkSession", "SparkContext", "SQLContext", "HiveContext", "StreamingContext",
    "DataFrameReader", "DataFrameWriter", "DataStreamReader", "DataStreamWriter",
    "StreamingQuery", "Catalog",
})
_SPARK_DATAS = frozenset({"DataFrame", "RDD", "Column", "GroupedData", "Broadcast", "Accumulator"})
_DB_ROOTS = frozenset({
    "sqlite3", "_sqlite3", "psycopg", "psycopg2", "pymysql", "MySQLdb", "mysql", "sqlalchemy",
    "duckdb", "pyodbc", "cx_Oracle", "oracledb", "pymssql", "snowflake", "redis", "pymongo",
    "clickhouse_driver", "databricks",
})
_DB_WORDS = ("connection", "cursor", "engine", "session", "client", "pool", "redis", "blob")
_BY_TYPE: dict[tuple[str, str], Rule] = {
    ("threading", "Thread"): _THREAD,
    ("_thread", "lock"): _LOCK, ("_thread", "RLock"): _LOCK,
    ("threading", "Condition"): _LOCK, ("threading", "Semaphore"): _LOCK,
    ("threading", "BoundedSemaphore"): _LOCK, ("threading", "Event"): _LOCK,
    ("threading", "Barrier"): _LOCK,
    ("_io", "_IOBase"): _FILE,
    ("socket", "socket"): _SOCKET, ("_socket", "socket"): _SOCKET,
    ("builtins", "generator"): _GENERATOR, ("builtins", "coroutine"): _GENERATOR,
    ("builtins", "async_generator"): _GENERATOR,
    ("ipywidgets.widgets.widget", "Widget"): _WIDGET,
    ("torch", "Tensor"): _CUDA,
}
_NOT_FILES = frozenset({("_io", "BytesIO"), ("_io", "StringIO")})
_rules: dict[type, Rule | None] = {}


def _rule_for_type(t: type) -> Rule | None:
    for cls in t.__mro__:
        module = getattr(cls, "__module__", "") or ""
        qualname = getattr(cls, "__qualname__", "") or ""
        key = (module, qualname)
        if key in _NOT_FILES:
            return None
        rule = _BY_TYPE.get(key)
        if rule is not None:
            return rule
        root = module.partition(".")[0]
        if root == "pyspark":
            if qualname in _SPARK_HANDLES:
                return _SPARK_HANDLE
            if qualname in _SPARK_DATAS:
                return _SPARK_DATA
        elif module in ("multiprocessing.synchronize", "asyncio.locks"):
            return _LOCK
        elif root in _DB_ROOTS and any(w in qualname.lower() for w in _DB_WORDS):
            return _DATABASE
    return None


def rule_for(obj: Any) -> Rule | None:
    """The rule that refuses ``obj``, if any (cached per type: the pickler asks about every
    object it meets)."""
    t = type(obj)
    try:
        rule = _rules[t]
    except KeyError:
        if len(_rules) > 10_000:  # notebooks that redefine classes in a loop
            _rules.clear()
        rule = _rules[t] = _rule_for_type(t)
    except TypeError:  # an unhashable metaclass
        rule = _rule_for_type(t)
    if rule is None or (rule.check is not None and not rule.check(obj)):
        return None
    return rule


class Refused(Exception):
    """Raised by the pickler on meeting ``obj``, which ``rule`` refuses."""

    def __init__(self, obj: Any, rule: Rule) -> None:
        super().__init__(rule.what)
        self.obj = obj
        self.rule = rule


def kind_of(value: Any) -> str:
    """What a value is, in a word or a type name: ``function``, ``class``, ``dict``, ..."""
    if isinstance(value, types.FunctionType | types.BuiltinFunctionType):
        return "function"
    if isinstance(value, type):
        return "class"
    if isinstance(value, types.ModuleType):
        return "module"
    return type_name(type(value))


def type_name(t: type) -> str:
    """A type's dotted name, without ``builtins.`` or ``__main__.``."""
    module = getattr(t, "__module__", "") or ""
    qualname = getattr(t, "__qualname__", t.__name__)
    return qualname if module in ("builtins", "__main__", "") else f"{module}.{qualname}"


def refusal(name: str, value: Any, need: Need, exc: Refused, lines: Lines) -> CaptureError:
    """The error for the notebook value ``name``, which holds an object a rule refuses."""
    rule = exc.rule
    kind = type_name(type(exc.obj))
    what = rule.what if kind.lower() in rule.what else f"{rule.what} ({kind})"
    if exc.obj is value:
        held = f"it is {what}"
    else:
        path = _find_path(name, value, exc.obj)
        held = f"it is a {kind_of(value)} that holds {what}" + (f" at {path}" if path else "")
    return CaptureError(
        f"cannot send {name!r} to the ranks: {held}; the cell uses it at "
        f"{lines.where(need.line)}.\n"
        f"Why: {rule.why}.\n"
        f"Instead: {rule.instead}."
    )


def unpicklable(name: str, value: Any, need: Need, exc: Exception, lines: Lines
                ) -> CaptureError:
    """The error for the notebook value ``name``, which cloudpickle failed on with ``exc``."""
    return CaptureError(
        f"cannot send {name!r} to the ranks: it is a {kind_of(value)} that cloudpickle cannot "
        f"serialise ({type(exc).__name__}: {exc}); the cell uses it at "
        f"{lines.where(need.line)}.\n"
        f"Instead: create it inside the cell, so each rank makes its own, or ship the plain "
        f"data it is made from."
    )


def _find_path(name: str, root: Any, target: Any, limit: int = 20_000) -> str:
    """Where ``target`` sits inside ``root``, as an expression (``cfg['db']``,
    ``train → global lock``), by a bounded breadth-first search of what pickling follows."""
    seen = {id(root)}
    queue: deque[tuple[Any, str]] = deque([(root, name)])
    steps = 0
    while queue and steps < limit:
        obj, path = queue.popleft()
        steps += 1
        for child, sub in _children(obj, path):
            if child is target:
                return sub
            if id(child) not in seen and not isinstance(child, (str, bytes, int, float)):
                seen.add(id(child))
                queue.append((child, sub))
    return ""


def _children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:  # noqa: C901 - one branch per kind of container
    try:
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:1000]:
                yield v, f"{path}[{k!r}]"
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj[:1000]):
                yield v, f"{path}[{i}]"
        elif isinstance(obj, set | frozenset):
            for v in list(obj)[:1000]:
                yield v, f"{path} (an element)"
        elif isinstance(obj, types.FunctionType):
            for g in sorted(_code_globals(obj.__code__)):
                if g in obj.__globals__:
                    yield obj.__globals__[g], f"{path} → global {g}"
            for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
                try:
                    yield cell.cell_contents, f"{path} → closure {var}"
                except ValueError:
                    pass
            for i, d in enumerate(obj.__defaults__ or ()):
                yield d, f"{path} → default {i}"
        elif isinstance(obj, types.MethodType):
            yield obj.__self__, f"{path}.__self__"
            yield obj.__func__, path
        elif isinstance(obj, type):
            if obj.__module__ == "__main__":
                for k, v in vars(obj).items():
                    if not k.startswith("__"):
                        yield v, f"{path}.{k}"
        else:
            func = getattr(obj, "func", None)  # functools.partial
            if callable(func) and hasattr(obj, "keywords"):
                yield func, f"{path}.func"
                yield from ((a, f"{path}.args[{i}]") for i, a in enumerate(obj.args))
                yield from ((v, f"{path}.keywords[{k!r}]") for k, v in obj.keywords.items())
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                for k, v in attrs.items():
                    yield v, f"{path}.{k}"
    except Exception:  # a diagnostic must not fail the capture: give up on this branch
        return


def _code_globals(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_globals(const)
    return names



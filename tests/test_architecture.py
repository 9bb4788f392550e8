"""docs/architecture.md's module table tells the truth about the imports, and the layout holds:
no module reaches into another's private names, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbdist"
#: Packages whose modules the table describes as one (their insides are their own business).
WHOLE = ("capture", "views")
#: Packages whose modules each have their own row.
SUBPACKAGES = ("launch", "rank")


def _unit(module: str) -> str:
    """The table's name for a module: ``job.py``, ``capture/``, ``launch/local.py``."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if parts[0] in WHOLE:
        return parts[0] + "/"
    if parts[0] in SUBPACKAGES:
        return f"{parts[0]}/" + (parts[1] if len(parts) > 1 else "__init__") + ".py"
    return parts[0] + ".py"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _runtime_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node, except what sits under ``if TYPE_CHECKING:`` (never imported at run time)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(typing: bool = True) -> dict[str, dict[str, set[str]]]:
    """For each module of nbdist: the nbdist modules it imports (anywhere in it: at the top,
    inside a function, or, with ``typing``, only for type checking), and the names it imports
    from each."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        imports: dict[str, set[str]] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree) if typing else _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "nbdist":
                        imports.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] == "nbdist":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if _is_module(sub):
                        imports.setdefault(sub, set())
                    else:
                        imports.setdefault(node.module, set()).add(alias.name)
        found[_module_name(path)] = imports
    return found


def _graph(typing: bool = True) -> dict[str, set[str]]:
    """Table name → the table names it imports (the package face, ``import nbdist``, is
    ``__init__.py`` like any other module)."""
    graph: dict[str, set[str]] = {}
    for module, imports in _imports(typing).items():
        unit = _unit(module)
        graph.setdefault(unit, set())
        graph[unit] |= {_unit(m) for m in imports if _unit(m) != unit}
    return graph


def _column(title: str) -> dict[str, str]:
    """One column of docs/architecture.md's module table: module → the cell's text."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    header = next(line for line in text.splitlines() if line.startswith("| module |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    at = columns.index(title)
    column: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            column[name] = cells[at]
    return column


def _table() -> dict[str, set[str]]:
    """The module table of docs/architecture.md: module → its "imports" column."""
    return {name: set(re.findall(r"`([^`]+)`", cell)) for name, cell in _column("imports").items()}


#: The engine and its launchers: what neither the views nor the rank side import.
ENGINE = {"job.py", "session.py", "elastic.py", "magics.py"}


def _launchers(graph: dict[str, set[str]]) -> set[str]:
    return {m for m in graph if m.startswith("launch/")}


#: What a module's "must not" cell says it never imports, as a test of its "imports" cell: a
#: phrase of the cell → the modules it rules out (None: any module of nbdist).
MUST_NOT: dict[str, set[str] | None] = {
    "import anything of nbdist": None,
    "import anything but the standard library": None,
    "import anything of the driver or the rank side": None,
    "import launchers": {"launch/"},
    "import the job layer": {"job.py", "session.py", "elastic.py"},
    "import the engine": {"job.py", "session.py", "elastic.py", "launch/"},
    "import IPython or widgets": {"magics.py", "views/"},
    "know about widgets": {"views/"},
    "render anything": {"views/"},
    "import Spark, widgets or launchers": {"launch/", "views/"},
    "import the kernel's Spark backend": {"launch/spark.py"},
    "depend on the backend that started it": {"launch/"},
    "know how a backend starts processes": {"launch/local.py", "launch/spark.py"},
    "know how it is displayed": {"views/"},
}


#: What the views may read: the driver's model of jobs and what it is made of.
MODEL = {"state.py", "series.py", "timeline.py", "protocol.py", "lines.py", "resources.py"}


def test_the_imports_column_matches_the_real_imports() -> None:
    """Each module in the table imports exactly the modules its "imports" column names."""
    graph, table = _graph(), _table()
    assert set(table) == set(graph), {"not in the table": sorted(set(graph) - set(table)),
                                      "not in nbdist": sorted(set(table) - set(graph))}
    wrong = {m: {"imported, not in the column": sorted(graph[m] - table[m]),
                 "in the column, not imported": sorted(table[m] - graph[m])}
             for m in graph if table[m] != graph[m]}
    assert not wrong, wrong


def test_no_module_imports_another_modules_private_names() -> None:
    """A name starting with ``_`` is only used in its own module (or its own package)."""
    found = []
    for module, imports in _imports().items():
        for source, names in imports.items():
            if _unit(source) == _unit(module):
                continue
            found += [f"{module} imports {source}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__")]
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {a.asname or a.name for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   for a in node.names
                   if (isinstance(node, ast.Import) and a.name.startswith("nbdist"))
                   or (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                       "nbdist") and _is_module(f"{node.module}.{a.name}"))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in aliases and node.attr.startswith("_") and \
                    not node.attr.startswith("__"):
                found.append(f"{_module_name(path)} uses {node.value.id}.{node.attr}")
    assert not found, found


def test_there_is_no_import_cycle() -> None:
    """The modules import each other one way only: data flows from the magics down to the
    ranks, and from the events up to the views (a cycle only type checking reads never runs)."""
    graph = _graph(typing=False)
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            if state.get(dep) == 1:
                cycles.append(" → ".join([*path[path.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[unit] = 2

    for unit in sorted(graph):
        if unit not in state:
            visit(unit, [unit])
    assert not cycles, cycles


def test_every_module_says_where_it_runs_and_the_rank_side_imports_no_kernel_module() -> None:
    """Each module's "runs on" is kernel, rank or both; every module in ``nbdist/rank/`` runs on
    a rank; and a module that runs on a rank (alone or also in the kernel) imports no module
    that runs only in the kernel, so a rank never loads the kernel's machinery."""
    sides, graph = _column("runs on"), _graph()
    assert set(sides.values()) <= {"kernel", "rank", "both"}, sides
    assert {m for m in graph if m.startswith("rank/")} <= {m for m, s in sides.items()
                                                            if s == "rank"}
    wrong = {m: sorted(d for d in graph[m] if sides[d] == "kernel")
             for m in graph if sides[m] != "kernel"}
    assert not any(wrong.values()), {m: d for m, d in wrong.items() if d}


def test_the_views_read_only_the_model() -> None:
    """``views/`` renders the driver's model (state, its series, timeline, resources and the
    protocol's types), never the job, session, restart or launch layers that feed it."""
    assert _graph()["views/"] <= MODEL, sorted(_graph()["views/"] - MODEL)


def test_the_package_face_is_imported_by_no_module_of_the_library() -> None:
    """No module of nbdist imports ``nbdist`` itself (its version is ``_version.py``), so what
    runs on a rank's host never loads the package face and what it pulls in."""
    wrong = sorted(m for m, deps in _graph().items()
                   if m != "__init__.py" and "__init__.py" in deps)
    assert not wrong, wrong


def test_the_views_import_neither_the_engine_nor_the_launchers() -> None:
    """Not even for type checking: a view reads what it renders by its shape."""
    graph = _graph()
    assert not graph["views/"] & (ENGINE | _launchers(graph)), sorted(graph["views/"])


def test_the_must_not_column_agrees_with_the_imports_column() -> None:
    """What a module's "must not" cell rules out importing, its "imports" cell does not name
    (and so, by the test above, the code does not import)."""
    must_not, table = _column("must not"), _table()
    wrong = {}
    for module, cell in must_not.items():
        if cell == "import anything":  # the whole cell: nothing of nbdist at all
            cell = "import anything of nbdist"
        for phrase, banned in MUST_NOT.items():
            if phrase not in cell:
                continue
            hits = table[module] if banned is None else {
                d for d in table[module] if d in banned or any(
                    b.endswith("/") and d.startswith(b) for b in banned)}
            if hits:
                wrong[module] = (phrase, sorted(hits))
    assert not wrong, wrong


def test_jobs_session_cells_and_restarting_jobs_share_one_result_handle() -> None:
    """Job, SessionCell and ElasticJob are ``handle.Handle`` (the type ``nbdist.run`` returns,
    exported as ``nbdist.Handle``) and none of them writes what the base writes once (result,
    results, error, retained_bytes, drop_values, done, and ``_settle``, the one way each ends)
    again."""
    import nbdist
    from nbdist.elastic import ElasticJob
    from nbdist.handle import Handle
    from nbdist.job import Job
    from nbdist.session import SessionCell

    assert nbdist.Handle is Handle
    once = {"result", "results", "exception", "error", "lost_output", "retained_bytes",
            "drop_values", "done", "_settle", "settled"}
    for cls in (Job, SessionCell, ElasticJob):
        assert issubclass(cls, Handle), cls
        assert not once & set(vars(cls)), (cls, sorted(once & set(vars(cls))))

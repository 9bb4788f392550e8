"""Which names the cell takes from the notebook: Python's scoping rules, along every path.

A name the cell binds on every path before reading it is the cell's own; a name read before
any binding is the notebook's (*needed*); a name the cell binds on some paths only, or reads
under ``except NameError``, is shipped when it can be and otherwise left to the cell
(*optional*). Reads inside a function the cell defines happen when the function is used, so
they are resolved where the cell first uses the function's name.

:class:`Flow` walks the cell's top level (and class bodies, which run when defined) in source
order; ``_Resolver`` resolves the reads of nested scopes (functions, lambdas, comprehensions)
as Python does. Both walk every node of the cell, so each dispatches on node types inline, the
commonest first, instead of through ``ast.NodeVisitor`` or helpers: that walk is most of
capture's cost (docs/capture.md, "Cost"). While walking they also hand each call to
:func:`~nbdist.capture._syntax.check_call`, and raise the refusals of code that cannot run on a
rank where they find it, so the tree is walked once.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass

from nbdist.capture._syntax import Lines, await_error, check_call, relative_error, yield_error
from nbdist.errors import CaptureError

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_TRY = (ast.Try, getattr(ast, "TryStar", ast.Try))  # ``except*`` is Python 3.11+
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


@dataclass
class Need:
    """A read of a notebook name: its first line, and whether the cell can do without it."""

    line: int
    optional: bool


class _Scope:
    """A nested scope (function, class body or comprehension) and the names it binds."""

    __slots__ = ("kind", "names", "globals", "nonlocals")

    def __init__(
        self, kind: str, names: set[str], glob: set[str] | None = None,
        nonloc: set[str] | None = None,
    ) -> None:
        self.kind = kind
        self.globals = glob or set()
        self.nonlocals = nonloc or set()
        self.names = names - self.globals - self.nonlocals


def _bound_in(body: Iterable[ast.AST]) -> tuple[set[str], set[str], set[str]]:  # noqa: C901 - one branch per binding statement
    """(names bound, names declared global, names declared nonlocal) in one scope's code,
    without entering nested scopes (but with the walrus targets of its comprehensions)."""
    names: set[str] = set()
    glob: set[str] = set()
    nonloc: set[str] = set()
    stack = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                names.add(node.id)
            continue
        if isinstance(node, FUNCS):
            names.add(node.name)
            stack.extend(node.decorator_list)
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)
            continue
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            stack.extend(node.decorator_list)
            stack.extend(node.bases)
            stack.extend(k.value for k in node.keywords)
            continue
        if isinstance(node, ast.Lambda):
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)
            continue
        if isinstance(node, _COMPS):
            # the comprehension's targets are its own; := inside binds in this scope
            for sub in _walk_scope(node):
                if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
                    names.add(sub.target.id)
            stack.append(node.generators[0].iter)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar):
            if node.name:
                names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, ast.Global):
            glob.update(node.names)
        elif isinstance(node, ast.Nonlocal):
            nonloc.update(node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names, glob, nonloc


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not enter function, lambda or class bodies."""
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        if cur is not node and isinstance(cur, (*FUNCS, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(cur))


def _comp_scope(node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> _Scope:
    names: set[str] = set()
    for gen in node.generators:
        _target_names(gen.target, names)
    return _Scope("comprehension", names)


def _target_names(node: ast.expr, names: set[str]) -> None:
    """Add the names an assignment target binds: ``a, (b, *c)``; not ``d`` nor ``k`` in
    ``d[k]`` or ``d.k``, which it reads."""
    if type(node) is ast.Name:
        names.add(node.id)
    elif isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            _target_names(elt, names)
    elif isinstance(node, ast.Starred):
        _target_names(node.value, names)


def _function_scope(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> _Scope:
    a = node.args
    params = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    params.update(x.arg for x in (a.vararg, a.kwarg) if x is not None)
    body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
    names, glob, nonloc = _bound_in(body)
    return _Scope("function", names | params, glob, nonloc)


class _Resolver:
    """Global names read inside nested scopes, resolved as Python resolves them.

    ``reads`` are (name, line) in source order; ``global_binds`` are names a function assigns
    after ``global name``; ``module_binds`` are := targets of comprehensions at module level.
    """

    def __init__(self, future_annotations: bool, lines: Lines) -> None:
        self.future = future_annotations
        self.lines = lines
        self.reads: list[tuple[str, int]] = []
        self.global_binds: set[str] = set()
        self.module_binds: set[str] = set()

    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                 chain: list[_Scope]) -> None:
        """The body of a function or lambda (its decorators and defaults are the caller's)."""
        inner = [*chain, _function_scope(node)]
        if isinstance(node, ast.Lambda):
            self.visit(node.body, inner)
        else:
            for stmt in node.body:
                self.visit(stmt, inner)

    def comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp,
                      chain: list[_Scope]) -> None:
        """A comprehension, except its first iterable (evaluated in the enclosing scope)."""
        inner = [*chain, _comp_scope(node)]
        for i, gen in enumerate(node.generators):
            if i:
                self.visit(gen.iter, inner)
            self.visit(gen.target, inner)
            for cond in gen.ifs:
                self.visit(cond, inner)
        if isinstance(node, ast.DictComp):
            self.visit(node.key, inner)
            self.visit(node.value, inner)
        else:
            self.visit(node.elt, inner)

    def _arguments(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                   chain: list[_Scope]) -> None:
        a = node.args
        for d in (*a.defaults, *a.kw_defaults):
            if d is not None:
                self.visit(d, chain)
        if not self.future and not isinstance(node, ast.Lambda):
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    self.visit(arg.annotation, chain)
            if node.returns is not None:
                self.visit(node.returns, chain)

    def visit(self, node: ast.AST, chain: list[_Scope]) -> None:  # noqa: C901 - one branch per syntax node
        t = type(node)
        if t is ast.Name:
            assert isinstance(node, ast.Name)
            if isinstance(node.ctx, ast.Store):
                if node.id in chain[-1].globals:
                    self.global_binds.add(node.id)
            else:
                self._resolve(node.id, node.lineno, chain)
            return
        if t is ast.Constant:
            return
        if t is ast.Attribute:
            self.visit(node.value, chain)  # type: ignore[attr-defined]
            return
        fields = _EXPR_FIELDS.get(t)
        if fields is not None:
            for name in fields:
                sub = getattr(node, name)
                if type(sub) is list:
                    for item in sub:
                        if item is not None:
                            self.visit(item, chain)
                elif sub is not None:
                    self.visit(sub, chain)
            return
        if t is ast.Call:
            assert isinstance(node, ast.Call)
            for name in check_call(node, self.lines):
                self._resolve(name, node.lineno, chain)
            self.visit(node.func, chain)
            for arg in node.args:
                self.visit(arg, chain)
            for kw in node.keywords:
                self.visit(kw.value, chain)
            return
        if isinstance(node, FUNCS):
            for d in node.decorator_list:
                self.visit(d, chain)
            self._arguments(node, chain)
            self.function(node, chain)
            return
        if isinstance(node, ast.Lambda):
            self._arguments(node, chain)
            self.function(node, chain)
            return
        if isinstance(node, ast.ClassDef):
            for d in (*node.decorator_list, *node.bases, *(k.value for k in node.keywords)):
                self.visit(d, chain)
            names, glob, nonloc = _bound_in(node.body)
            inner = [*chain, _Scope("class", names, glob, nonloc)]
            for stmt in node.body:
                self.visit(stmt, inner)
            return
        if isinstance(node, _COMPS):
            if any(g.is_async for g in node.generators) and not _in_function(chain):
                raise await_error(node.lineno, self.lines)
            self.visit(node.generators[0].iter, chain)
            self.comprehension(node, chain)
            return
        if isinstance(node, ast.NamedExpr):
            self.visit(node.value, chain)
            name = node.target.id
            target = next((s for s in reversed(chain) if s.kind != "comprehension"), None)
            if target is None:
                self.module_binds.add(name)
            elif name in target.globals:
                self.global_binds.add(name)
            return
        if isinstance(node, ast.AnnAssign):
            # annotations of a function's local variables are never evaluated
            if not self.future and chain[-1].kind == "class":
                self.visit(node.annotation, chain)
            self.visit(node.target, chain)
            if node.value is not None:
                self.visit(node.value, chain)
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            raise relative_error(node, self.lines)
        if isinstance(node, ast.Await | ast.Yield | ast.YieldFrom) and not _in_function(chain):
            # inside a comprehension of the cell's top level
            error = await_error if isinstance(node, ast.Await) else yield_error
            raise error(node.lineno, self.lines)
        for child in ast.iter_child_nodes(node):
            self.visit(child, chain)

    def _resolve(self, name: str, line: int, chain: list[_Scope]) -> None:
        cur = chain[-1]
        if name in cur.globals:
            self.reads.append((name, line))
            return
        if name in cur.names or name in cur.nonlocals:
            return
        for scope in reversed(chain[:-1]):
            if scope.kind == "class":
                continue  # a class body's names are not visible in its methods
            if name in scope.globals:
                break
            if name in scope.names or name in scope.nonlocals:
                return
        self.reads.append((name, line))


#: Sub-expressions of plain expression nodes, in evaluation order: walking these directly is
#: several times faster than ``ast.iter_child_nodes`` (which also yields ``ctx`` and operator
#: objects), and capture walks every node of the cell.
_EXPR_FIELDS: dict[type, tuple[str, ...]] = {
    ast.Subscript: ("value", "slice"), ast.BinOp: ("left", "right"),
    ast.Compare: ("left", "comparators"), ast.Tuple: ("elts",), ast.List: ("elts",),
    ast.Set: ("elts",), ast.UnaryOp: ("operand",), ast.keyword: ("value",),
    ast.Starred: ("value",), ast.JoinedStr: ("values",),
    ast.FormattedValue: ("value", "format_spec"), ast.Slice: ("lower", "upper", "step"),
    ast.Dict: ("keys", "values"), ast.Expr: ("value",), ast.Return: ("value",),
}


def _in_function(chain: list[_Scope]) -> bool:
    return any(scope.kind == "function" for scope in chain)


@dataclass
class _Deferred:
    """A function, class or lambda the cell defines: the globals its code reads when called."""

    reads: list[tuple[str, int]]
    global_binds: set[str]
    index: int  # the top-level statement that defines it
    definite: frozenset[str]  # names surely bound when it was defined
    activated: bool = False


class _Frame:
    """Binding state of the module (or of a class body being run) at one point of the flow."""

    __slots__ = ("definite", "maybe", "live", "deferred")

    def __init__(self) -> None:
        self.definite: set[str] = set()
        self.maybe: set[str] = set()
        self.live = True
        self.deferred: _Deferred | None = None  # a class body: its methods' reads


_State = tuple[set[str], set[str], bool]


class Flow:
    """Which notebook names the cell reads: a definite-assignment analysis of the cell's
    top level (and of class bodies, which run when defined), in source order.

    Only names of the notebook (``universe``) can be needs, and whether a name is bound never
    depends on other names, so the module's binding state tracks those alone: the cell's own
    variables, usually most of its names, are not copied at every branch and loop.
    """

    def __init__(self, lines: Lines, future_annotations: bool, filename: str,
                 universe: Container[str]) -> None:
        self.lines = lines
        self.filename = filename
        self.future = future_annotations
        self.universe = universe
        self.mod = _Frame()
        self.frame = self.mod
        self.needs: dict[str, Need] = {}
        self.defs: dict[str, _Deferred] = {}
        self.all_defs: list[_Deferred] = []
        self.optional = 0  # depth inside ``try`` bodies that catch NameError
        self.cond = 0  # depth inside conditional parts of expressions (and/or, x if c else y)
        self.loops: list[tuple[list[_State], list[_State]]] = []  # (breaks, continues)
        self.activating: set[str] = set()
        self.index = 0
        self.body: list[ast.stmt] = []

    def run(self, tree: ast.Module) -> dict[str, Need]:
        self.body = tree.body
        for i, stmt in enumerate(tree.body):
            self.index = i
            if not self.frame.live:
                break
            self.stmt(stmt)
        self._fallback()
        return dict(sorted(self.needs.items(), key=lambda kv: kv[1].line))

    # -- reads and binds ---------------------------------------------------------------------
    def read(self, name: str, line: int, *, skip_class: bool = False) -> None:
        frame = self.frame
        if frame is not self.mod and not skip_class and name in frame.definite:
            return
        mod = self.mod
        if name not in mod.definite and name in self.universe:
            optional = name in mod.maybe or self.optional > 0
            need = self.needs.get(name)
            if need is None:
                self.needs[name] = Need(line, optional)
            elif need.optional and not optional:
                need.optional = False
                need.line = line
        d = self.defs.get(name)
        if d is not None and name not in self.activating:
            self._activate(name, d)

    def _activate(self, name: str, d: _Deferred) -> None:
        """The cell uses a function it defined: its global reads happen now."""
        d.activated = True
        self.activating.add(name)
        saved, self.frame = self.frame, self.mod
        try:
            for n, line in d.reads:
                self.read(n, line)
            for n in d.global_binds:
                self._bind_module(n)
        finally:
            self.frame = saved
            self.activating.discard(name)

    def bind(self, name: str, *, definite: bool = True) -> None:
        frame = self.frame
        if frame is self.mod:
            self.defs.pop(name, None)
            if name not in self.universe:
                return
        # a class body tracks all its names: each hides the module's from the reads after it
        if definite and not self.cond:
            frame.definite.add(name)
        frame.maybe.add(name)

    def _bind_module(self, name: str) -> None:
        if name in self.universe:
            self.mod.definite.add(name)
            self.mod.maybe.add(name)

    def define(self, name: str, d: _Deferred) -> None:
        """``name`` is bound to a function/class/lambda with deferred reads ``d``."""
        frame = self.frame
        self.bind(name)
        if frame is self.mod:
            self.defs[name] = d
            self.all_defs.append(d)
        elif frame.deferred is not None:  # a method: part of the class
            frame.deferred.reads.extend(d.reads)
            frame.deferred.global_binds |= d.global_binds

    def _deferred(self) -> _Deferred:
        return _Deferred([], set(), self.index, frozenset(self.mod.definite))

    # -- branches ----------------------------------------------------------------------------
    def fork(self) -> _State:
        f = self.frame
        return set(f.definite), set(f.maybe), f.live

    def restore(self, state: _State) -> None:
        f = self.frame
        f.definite, f.maybe, f.live = set(state[0]), set(state[1]), state[2]

    def join(self, *states: _State) -> None:
        f = self.frame
        live = [s for s in states if s[2]]
        maybe: set[str] = set()
        for s in states:
            maybe |= s[1]
        f.maybe = maybe
        if live:
            definite = set(live[0][0])
            for s in live[1:]:
                definite &= s[0]
            f.definite, f.live = definite, True
        else:
            f.live = False

    def block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            if not self.frame.live:
                return
            self.stmt(stmt)

    # -- statements --------------------------------------------------------------------------
    def stmt(self, node: ast.stmt) -> None:  # noqa: C901 - one branch per statement
        if isinstance(node, ast.AsyncFor | ast.AsyncWith):
            raise await_error(node.lineno, self.lines)
        if isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
            if (len(node.targets) == 1 and isinstance(target, ast.Name)
                    and isinstance(node.value, ast.Lambda)):
                self._arguments(node.value)
                self.define(target.id, self._function_reads(node.value))
                return
            self.expr(node.value)
            for t in node.targets:
                self.target(t)
        elif isinstance(node, ast.AugAssign):
            if isinstance(node.target, ast.Name):
                self.read(node.target.id, node.lineno)
            self.expr(node.value)
            self.target(node.target)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.expr(node.value)
            if not self.future:
                self.expr(node.annotation)
            if isinstance(node.target, ast.Name):
                if node.value is not None:
                    self.bind(node.target.id)
            else:
                self.target(node.target)
        elif isinstance(node, FUNCS):
            for d in node.decorator_list:
                self.expr(d)
            self._arguments(node)
            self.define(node.name, self._function_reads(node))
        elif isinstance(node, ast.ClassDef):
            self._class(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                self.bind((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            self._import_from(node)
        elif isinstance(node, ast.If):
            self.expr(node.test)
            start = self.fork()
            self.block(node.body)
            after_body = self.fork()
            self.restore(start)
            self.block(node.orelse)
            self.join(after_body, self.fork())
        elif isinstance(node, ast.For):
            self.expr(node.iter)
            self._loop(node, forever=False)
        elif isinstance(node, ast.While):
            self.expr(node.test)
            forever = isinstance(node.test, ast.Constant) and bool(node.test.value)
            self._loop(node, forever=forever)
        elif isinstance(node, _TRY):
            self._try(node)
        elif isinstance(node, ast.With):
            for item in node.items:
                self.expr(item.context_expr)
                if item.optional_vars is not None:
                    self.target(item.optional_vars)
            self.block(node.body)
        elif isinstance(node, ast.Match):
            self._match(node)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self.read(t.id, t.lineno)
                else:
                    self.target(t)
        elif isinstance(node, ast.Break | ast.Continue):
            if not self.loops:  # what compile() would say, found without compiling
                what = "'break' outside loop" if isinstance(node, ast.Break) else \
                    "'continue' not properly in loop"
                raise self._syntax_error(what, node)
            self.loops[-1][isinstance(node, ast.Continue)].append(self.fork())
            self.frame.live = False
        elif isinstance(node, ast.Return):
            raise self._syntax_error("'return' outside function", node)
        elif isinstance(node, ast.Raise):
            self.expr(node.exc)
            self.expr(node.cause)
            self.frame.live = False

        elif isinstance(node, ast.Global | ast.Nonlocal | ast.Pass):
            pass
        else:  # Assert, TypeAlias, ...: their expressions, in order
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def _syntax_error(self, message: str, node: ast.stmt) -> SyntaxError:
        text = self.lines.text(node.lineno)
        return SyntaxError(message, (self.filename, node.lineno, node.col_offset + 1, text))

    def target(self, node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            self.bind(node.id)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self.target(elt)
        elif isinstance(node, ast.Starred):
            self.target(node.value)
        elif isinstance(node, ast.Attribute):
            self.expr(node.value)
        elif isinstance(node, ast.Subscript):
            self.expr(node.value)
            self.expr(node.slice)

    def _arguments(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        for d in (*a.defaults, *a.kw_defaults):
            if d is not None:
                self.expr(d)
        if not self.future and not isinstance(node, ast.Lambda):
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None and arg.annotation is not None:
                    self.expr(arg.annotation)
            if node.returns is not None:
                self.expr(node.returns)

    def _function_reads(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
                        ) -> _Deferred:
        r = _Resolver(self.future, self.lines)
        r.function(node, [])
        d = self._deferred()
        d.reads, d.global_binds = r.reads, r.global_binds
        return d

    def _class(self, node: ast.ClassDef) -> None:
        for d in (*node.decorator_list, *node.bases, *(k.value for k in node.keywords)):
            self.expr(d)
        outer = self.frame
        frame = _Frame()
        frame.deferred = self._deferred()
        self.frame = frame
        saved_loops, self.loops = self.loops, []
        try:
            self.block(node.body)
        finally:
            self.frame = outer
            self.loops = saved_loops
        self.define(node.name, frame.deferred)

    def _import_from(self, node: ast.ImportFrom) -> None:
        if node.level:
            raise relative_error(node, self.lines)
        if node.module == "__future__":
            if any(a.name == "annotations" for a in node.names):
                self.future = True
        for alias in node.names:
            if alias.name == "*":
                for name in _star_names(node.module or "", node.lineno, self.lines):
                    self.bind(name)
            else:
                self.bind(alias.asname or alias.name)

    def _loop(self, node: ast.For | ast.AsyncFor | ast.While, *, forever: bool) -> None:
        start = self.fork()
        if isinstance(node, ast.For | ast.AsyncFor):
            self.target(node.target)
        self.loops.append(([], []))
        self.block(node.body)
        breaks, continues = self.loops.pop()
        if forever:  # ``while True``: the only way out is a break
            if breaks:
                self.join(*breaks)
            else:
                self.frame.live = False
            return
        self.join(start, self.fork(), *continues)  # the body may run zero times
        self.block(node.orelse)
        self.join(self.fork(), *breaks)

    def _try(self, node: ast.Try) -> None:
        handles_name_error = any(_catches_name_error(h.type) for h in node.handlers)
        start = self.fork()
        self.optional += handles_name_error
        try:
            self.block(node.body)
        finally:
            self.optional -= handles_name_error
        after_body = self.fork()
        ends: list[_State] = []
        for handler in node.handlers:
            # the exception may come before any statement of the body ran
            self.restore((start[0], start[1] | after_body[1], start[2]))
            if handler.type is not None:
                self.expr(handler.type)
            if handler.name:
                self.bind(handler.name)
            self.block(handler.body)
            ends.append(self.fork())
        self.restore(after_body)
        self.block(node.orelse)
        self.join(self.fork(), *ends)
        if node.finalbody:
            normal = self.fork()
            self.restore((start[0] & normal[0], normal[1], start[2]))
            entry = set(self.frame.definite)
            self.block(node.finalbody)
            final = self.fork()
            added = final[0] - entry
            self.restore((normal[0] | added, final[1], normal[2] and final[2]))

    def _match(self, node: ast.Match) -> None:
        self.expr(node.subject)
        start = self.fork()
        ends: list[_State] = []
        exhaustive = False
        for case in node.cases:
            self.restore(start)
            self._pattern(case.pattern)
            if case.guard is not None:
                self.expr(case.guard)
            self.block(case.body)
            ends.append(self.fork())
            if case.guard is None and isinstance(case.pattern, ast.MatchAs) \
                    and case.pattern.pattern is None:
                exhaustive = True  # ``case _:`` or ``case name:``
        if not exhaustive:
            ends.append(start)
        self.join(*ends)

    def _pattern(self, node: ast.pattern) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.MatchValue):
                self.expr(sub.value)
            elif isinstance(sub, ast.MatchClass):
                self.expr(sub.cls)
            elif isinstance(sub, ast.MatchMapping):
                for key in sub.keys:
                    self.expr(key)
                if sub.rest:
                    self.bind(sub.rest)
            elif isinstance(sub, ast.MatchAs | ast.MatchStar) and sub.name:
                self.bind(sub.name)

    # -- expressions -------------------------------------------------------------------------
    def expr(self, node: ast.AST | None) -> None:  # noqa: C901 - one branch per expression
        # the commonest nodes first, tested by exact type (parsed trees have no subclasses)
        if type(node) is ast.Name:
            if type(node.ctx) is not ast.Store:
                self.read(node.id, node.lineno)
            return
        if type(node) is ast.Call:
            shell_names = check_call(node, self.lines)
            if shell_names:  # expanded when the command runs, if they exist: optional
                self.optional += 1
                for name in shell_names:
                    self.read(name, node.lineno)
                self.optional -= 1
            self.expr(node.func)
            for arg in node.args:
                self.expr(arg)
            for kw in node.keywords:
                self.expr(kw.value)
            return
        t = type(node)
        if node is None or t is ast.Constant:
            return
        if t is ast.Attribute:
            self.expr(node.value)  # type: ignore[attr-defined]
            return
        fields = _EXPR_FIELDS.get(t)
        if fields is not None:
            for name in fields:
                sub = getattr(node, name)
                if type(sub) is list:
                    for item in sub:
                        self.expr(item)
                else:
                    self.expr(sub)
            return
        if isinstance(node, ast.NamedExpr):
            self.expr(node.value)
            self.bind(node.target.id)
            return
        if isinstance(node, ast.BoolOp):
            self.expr(node.values[0])
            self.cond += 1
            for value in node.values[1:]:
                self.expr(value)
            self.cond -= 1
            return
        if isinstance(node, ast.IfExp):
            self.expr(node.test)
            self.cond += 1
            self.expr(node.body)
            self.expr(node.orelse)
            self.cond -= 1
            return
        if isinstance(node, ast.Lambda):
            # not bound to a name: assume it is used right away (sorted(key=...), map(...))
            self._arguments(node)
            for name, line in self._function_reads(node).reads:
                self.read(name, line)
            return
        if isinstance(node, _COMPS):
            if any(g.is_async for g in node.generators):
                raise await_error(node.lineno, self.lines)
            self.expr(node.generators[0].iter)
            r = _Resolver(self.future, self.lines)
            r.comprehension(node, [])
            # a comprehension in a class body does not see the class's names
            for name, line in r.reads:
                self.read(name, line, skip_class=True)
            for name in r.module_binds:
                self.bind(name, definite=False)
            return
        if isinstance(node, ast.Await):
            raise await_error(node.lineno, self.lines)
        if isinstance(node, ast.Yield | ast.YieldFrom):
            raise yield_error(node.lineno, self.lines)
        assert node is not None
        for child in ast.iter_child_nodes(node):
            self.expr(child)

    # -- functions the cell never uses by name -----------------------------------------------
    def _fallback(self) -> None:
        """A function the cell defines but never uses by name (a decorator registered it, a
        method called through an instance of a class from the notebook, ...) may run at any
        time: the globals it reads that the cell binds nowhere after it are optional needs."""
        pending = [d for d in self.all_defs if not d.activated and d.reads]
        if not pending:
            return
        later: list[set[str]] = [set() for _ in range(len(self.body) + 1)]
        for i in range(len(self.body) - 1, -1, -1):
            later[i] = later[i + 1] | _bound_in([self.body[i]])[0]
        late_global = set().union(*(d.global_binds for d in self.all_defs))
        for d in pending:
            for name, line in d.reads:
                if name in d.definite or name in later[d.index] or name in late_global:
                    continue
                if name not in self.needs and name in self.universe:
                    self.needs[name] = Need(line, optional=True)


def _catches_name_error(node: ast.expr | None) -> bool:
    if node is None:
        return True  # a bare ``except:``
    if isinstance(node, ast.Tuple):
        return any(_catches_name_error(e) for e in node.elts)
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name == "NameError"


def _star_names(module: str, line: int, lines: Lines) -> list[str]:
    """The names ``from module import *`` binds, found by importing it here."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        raise CaptureError(
            f"{lines.where(line)}: nbdist must know which names `from {module} import *` "
            f"defines, to tell them from the notebook's, but {module!r} does not import in the "
            f"notebook: {type(exc).__name__}: {exc}. Import the names you use explicitly: "
            f"`from {module} import a, b`."
        ) from None
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    return [str(n) for n in names]



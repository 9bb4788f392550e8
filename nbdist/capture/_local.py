"""The notebook's own modules: found, read and packed to travel by value.

A module the cell needs (imported by it or by name from the notebook, or referred to by a
value that is pickled) is the notebook's own when the kernel finds it through the notebook's
working directory or a ``sys.path`` entry that is not part of the installation: a
``helpers.py`` next to the notebook, a ``src/`` folder added to ``sys.path``. The ranks'
hosts may not have that file (a real cluster's executors never do), so it travels with the
payload (``protocol.ShippedCode``), with the other modules of the notebook's it imports, and
a package as its whole folder. Never shipped: installed packages (the standard library,
site-packages, a distribution's top-level names, an editable install's ``.pth`` folders) and
nbdist itself; those are imported by name on the rank, which must have them.

Files are read from disk when the cell is captured (what a fresh ``import`` in the kernel
would load), and cached by path, modification time and size, so a later run of the cell
reads only what changed.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

from nbdist.importscan import source_imports
from nbdist.protocol import ShippedCode, code_digest

#: Never shipped, whatever the path says: nbdist must be the ranks' own (a development
#: checkout is found through a plain ``sys.path`` entry).
_NEVER = frozenset({"nbdist", "__main__", "__future__"})
#: Folders of a package that never travel.
_SKIP_DIRS = frozenset({"__pycache__", ".git", ".ipynb_checkpoints", ".mypy_cache",
                        ".pytest_cache", ".ruff_cache", "node_modules"})
_SKIP_SUFFIXES = (".pyc", ".pyo")

#: path → (mtime_ns, size, content or None, top-level names its source imports). The content
#: of small files only (``CACHE_FILE_BYTES``, ``CACHE_BYTES`` in all): a large package's data
#: is read again at each capture rather than kept in the kernel for its whole life.
_cache: dict[str, tuple[int, int, bytes | None, frozenset[str]]] = {}
CACHE_FILE_BYTES = 256 << 10
CACHE_BYTES = 16 << 20
_cached_bytes = 0


def top_names(modules: Iterable[str]) -> set[str]:
    """The top-level names of dotted module names (``pkg.sub`` → ``pkg``)."""
    return {m.partition(".")[0] for m in modules if m and not m.startswith(".")}


def code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names of a code object and the code nested in it: a superset
    of the modules it imports (``import x`` names ``x`` there), read without disassembling
    it (which costs about a hundred times more); :func:`shipped_code` keeps only those that
    name a module of the notebook's own."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


def objects_modules(objs: Iterable[Any]) -> set[str]:
    """Modules the objects come from: a module's own name, a class's or function's
    ``__module__``, an instance's class's, and what a function's code imports."""
    found: set[str] = set()
    for obj in objs:
        if isinstance(obj, types.ModuleType):
            found.add(obj.__name__)
            continue
        while hasattr(obj, "func") and not hasattr(obj, "__code__"):  # functools.partial
            obj = obj.func
        owner = obj if isinstance(obj, type | types.FunctionType | types.MethodType) \
            else type(obj)
        module = getattr(owner, "__module__", None)
        if isinstance(module, str):
            found.add(module)
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType) and module == "__main__":  # shipped by value
            found |= code_names(code)
    return found


def shipped_code(modules: Iterable[str]) -> ShippedCode | None:
    """The notebook's own modules among ``modules`` (dotted names: their top-level module or
    package travels), with those of the notebook's own they import; None when there are none."""
    roots = _local_roots()
    if not roots:
        return None
    # Only names that the kernel imported or that a local folder holds can be the notebook's
    # own: the rest (most of the names a function's code uses) is never looked up.
    here = _names_in(roots)
    todo = sorted(n for n in top_names(modules) if n in sys.modules or n in here)
    seen: set[str] = set()
    files: dict[str, bytes] = {}
    shipped: list[tuple[str, int, int]] = []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = _local_origin(name, roots)
        if found is None:
            continue
        path, is_package = found
        count = size = 0
        for rel, full in _files(name, path, is_package):
            entry = _read(full)
            if entry is None:
                continue
            data, imports = entry
            files[rel] = data
            count += 1
            size += len(data)
            todo.extend(sorted(imports - seen))
        if count:
            shipped.append((name + ("/" if is_package else ""), count, size))
    if not files:
        return None
    return ShippedCode(code_digest(files.items()), tuple(sorted(files.items())),
                       tuple(sorted(shipped)))


def shadowing(modules: Iterable[str]) -> list[tuple[str, str]]:
    """(name, file) of the modules among ``modules`` that the kernel imported from the
    notebook's own folders although the name is a standard module's or an installed
    distribution's (a ``tqdm.py`` beside the notebook): the ranks would import the installed
    one (nbdist never ships those names, and a rank may have imported it before the cell), so
    the kernel and the ranks would run different code. Capture warns about each."""
    roots = _local_roots()
    here = _names_in(roots) if roots else set()
    found = []
    for name in sorted(top_names(modules) & here):  # a name no local folder holds is not
        if name in _NEVER or not (name in sys.stdlib_module_names
                                  or name in _distributed_names()):
            continue
        module = sys.modules.get(name)
        if module is not None:
            file = getattr(module, "__file__", None)
        else:  # what the kernel would import
            import importlib.util

            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                continue
            file = spec.origin if spec is not None else None
        if not isinstance(file, str):
            continue
        folder = os.path.dirname(file)
        if os.path.basename(file) == "__init__.py":
            folder = os.path.dirname(folder)
        if os.path.realpath(folder) in roots:
            found.append((name, file))
    return found


def _local_roots() -> set[str]:
    """Real paths of the folders the notebook's own modules are found in: its working
    directory and the ``sys.path`` entries that are not part of the installation; worked out
    again only when ``sys.path`` or the working directory changed."""
    return set(_roots_for(tuple(e for e in sys.path if isinstance(e, str)), os.getcwd()))


@functools.lru_cache(maxsize=8)
def _roots_for(path: tuple[str, ...], cwd: str) -> frozenset[str]:
    from nbdist.rank.host import installation_dirs, is_installed

    dirs = installation_dirs()
    skip = _pth_dirs()
    roots = set()
    for entry in [cwd, *path]:
        real = os.path.realpath(entry or cwd)
        if real in skip or not os.path.isdir(real) or is_installed(real, dirs):
            continue
        roots.add(real)
    return frozenset(roots)


#: folder → (mtime_ns, the module and package names in it)
_listings: dict[str, tuple[int, frozenset[str]]] = {}


def _names_in(roots: Iterable[str]) -> set[str]:
    """The names of the modules (``x.py``) and packages (``x/__init__.py``) in ``roots``;
    each folder's listing cached until it changes."""
    names: set[str] = set()
    for root in roots:
        try:
            mtime = os.stat(root).st_mtime_ns
        except OSError:
            continue
        hit = _listings.get(root)
        if hit is None or hit[0] != mtime:
            found = set()
            try:
                with os.scandir(root) as entries:
                    for entry in entries:
                        if entry.name.endswith(".py"):
                            found.add(entry.name[:-3])
                        elif entry.is_dir() and os.path.isfile(
                                os.path.join(entry.path, "__init__.py")):
                            found.add(entry.name)
            except OSError:
                continue
            hit = _listings[root] = (mtime, frozenset(found))
        names |= hit[1]
    return names


@functools.lru_cache(maxsize=1)
def _pth_dirs() -> frozenset[str]:
    """Folders that ``.pth`` files of the site directories put on ``sys.path``: editable
    installs (``pip install -e``), which are installed, not the notebook's own."""
    import site

    found: set[str] = set()
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    for site_dir in sites:
        try:
            names = [n for n in os.listdir(site_dir) if n.endswith(".pth")]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(site_dir, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    found.add(os.path.realpath(os.path.join(site_dir, line)))
    return frozenset(found)


@functools.lru_cache(maxsize=1)
def _distributed_names() -> frozenset[str]:
    """Top-level names that installed distributions provide."""
    import importlib.metadata

    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # a broken distribution's metadata: judge by path alone
        return frozenset()


def _local_origin(name: str, roots: set[str]) -> tuple[str, bool] | None:
    """Where the notebook's own module ``name`` is (its ``.py`` file, or its package's folder),
    and whether it is a package; None when it is installed, built in, compiled or not found."""
    if name in _NEVER or name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return None
    module = sys.modules.get(name)
    file: Any
    search: Any
    if module is not None:
        file = getattr(module, "__file__", None)
        search = getattr(module, "__path__", None)
    else:
        import importlib.util

        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.has_location:
            return None
        file, search = spec.origin, spec.submodule_search_locations
    if not isinstance(file, str):
        return None  # a namespace package, or a module made at run time
    if search is not None:
        if os.path.basename(file) != "__init__.py":
            return None
        path, is_package = os.path.dirname(file), True
    elif file.endswith(".py"):
        path, is_package = file, False
    else:
        return None  # an extension module: built for the kernel's machine, not shipped
    if os.path.realpath(os.path.dirname(path)) not in roots:
        return None
    if name in _distributed_names():
        return None
    return path, is_package


def _files(name: str, path: str, is_package: bool) -> Iterator[tuple[str, str]]:
    """(relative path with "/", full path) of the files of a module or package."""
    if not is_package:
        yield name + ".py", path
        return
    for folder, subdirs, names in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("."))
        rel_folder = os.path.relpath(folder, os.path.dirname(path)).replace(os.sep, "/")
        for file in sorted(names):
            if file.endswith(_SKIP_SUFFIXES) or file.startswith("."):
                continue
            full = os.path.join(folder, file)
            if os.path.isfile(full):
                yield f"{rel_folder}/{file}", full


def _read(path: str) -> tuple[bytes, frozenset[str]] | None:
    """A file's content and the top-level names its source imports; cached until it changes."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    global _cached_bytes
    hit = _cache.get(path)
    fresh = hit is not None and hit[0] == st.st_mtime_ns and hit[1] == st.st_size
    if hit is not None and fresh and hit[2] is not None:
        return hit[2], hit[3]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if hit is not None and fresh:
        return data, hit[3]
    imports: frozenset[str] = frozenset()
    if path.endswith(".py"):
        try:
            imports = frozenset(top_names(source_imports(ast.parse(data))))
        except (SyntaxError, ValueError):
            pass  # the rank reports it when it imports the module, as the kernel would
    if hit is not None and hit[2] is not None:
        _cached_bytes -= len(hit[2])
    keep = len(data) <= CACHE_FILE_BYTES and _cached_bytes + len(data) <= CACHE_BYTES
    if keep:
        _cached_bytes += len(data)
    _cache[path] = (st.st_mtime_ns, st.st_size, data if keep else None, imports)
    return data, imports

"""Children of a rank: notebook code in the processes a cell starts (spawn, forkserver, fork).

A cell that hands a class or function of the notebook to another process (DataLoader workers,
``multiprocessing.Pool``, ``concurrent.futures.ProcessPoolExecutor``,
``torch.multiprocessing.spawn``) has multiprocessing pickle it with its ``ForkingPickler``:
by reference, as ``__main__.Name``. A child started with ``spawn`` or ``forkserver`` is a new
interpreter; it re-creates its parent's ``__main__`` only by importing it again from
``__main__.__file__`` (a script under torchrun), and a rank's cell namespace is no file. So two
things are done on every rank, and in every child that receives notebook code:

- the namespace a cell runs in is a real module, ``sys.modules["__main__"]`` while the cell
  runs (:func:`namespace`, :func:`enter`): a cell's class is found by name in its own process,
  as in a script (``pickle.dumps(obj)``, ``torch.save(model)`` work as under torchrun);
- ``ForkingPickler`` sends classes and functions of a ``__main__`` that a child cannot import
  again (one without ``__file__``) **by value**, through cloudpickle (:func:`install`), as
  nbdist ships them from the notebook to the ranks. The child rebuilds them with
  :func:`_rebuild`, which installs the same rule there, so that what the child sends back (a
  batch holding an instance of a notebook class, a result) travels by value too; cloudpickle
  maps a class sent back to the parent's own class, so ``isinstance`` keeps working.

Everything else (tensors through torch's shared-memory reducers, queues, plain data) is
pickled as before. A script run with ``%distributed train.py`` has a ``__main__`` with a
``__file__``, which children import again as under torchrun: its objects go by name.

Standard library only at import (this module is imported on every rank and in the kernel);
cloudpickle and ``multiprocessing.reduction`` are imported when first needed.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

MAIN = "__main__"

#: The module of each namespace made by :func:`namespace`, by ``id`` of its dict: the latest
#: one-off cell's and a session's (a module must outlive its dict's use as a namespace).
_modules: dict[int, types.ModuleType] = {}
_installed = False
_install_lock = threading.Lock()


def namespace(keep: bool = False) -> dict[str, Any]:
    """A new module ``__main__``'s dict, for a cell to run in (see :func:`enter`).

    ``keep``: a session's namespace, kept for the life of the rank; the others replace one
    another (a warm rank runs one-off cells one after another).
    """
    module = types.ModuleType(MAIN)
    if not keep:
        for key in [k for k, m in _modules.items() if not getattr(m, "_nbdist_keep", False)]:
            del _modules[key]
    else:
        module._nbdist_keep = True  # type: ignore[attr-defined]
    _modules[id(module.__dict__)] = module
    return module.__dict__


def enter(ns: dict[str, Any]) -> None:
    """Make ``ns`` (made by :func:`namespace`) the process's ``__main__``, and teach
    multiprocessing to send its classes and functions to children by value."""
    install()
    module = _modules.get(id(ns))
    if module is not None and module.__dict__ is ns:
        sys.modules[MAIN] = module


def install() -> None:
    """Give multiprocessing's ``ForkingPickler`` the by-value rule (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from multiprocessing.reduction import ForkingPickler

        # ``reducer_override`` is the one hook pickle consults for classes and functions
        # (copyreg's dispatch table never sees them). Set on the class, so that every user
        # of it gets the rule: multiprocessing's queues and connections, torch's
        # multiprocessing, concurrent.futures (they keep a reference to this very class).
        ForkingPickler.reducer_override = _reducer_override  # type: ignore[method-assign]
        _installed = True


def _by_value(obj: Any) -> bool:
    """Whether ``obj`` is a class or function of a ``__main__`` a child cannot import again."""
    if not isinstance(obj, (type, types.FunctionType)):
        return False
    try:
        if obj.__module__ != MAIN:
            return False
    except Exception:  # a metaclass whose attributes raise: pickle's own rules apply
        return False
    main = sys.modules.get(MAIN)
    return getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None


def _reducer_override(self: Any, obj: Any) -> Any:
    """``ForkingPickler.reducer_override``: notebook classes and functions by value."""
    if not _by_value(obj):
        return NotImplemented
    from nbdist import _pickling

    try:
        blob = _pickling.dumps(obj)
    except Exception as exc:
        import pickle

        raise pickle.PicklingError(cannot_send(obj, exc)) from exc
    return _rebuild, (blob,)


def cannot_send(obj: Any, exc: BaseException) -> str:
    """What to say when a notebook class or function cannot go to a child process."""
    kind = "class" if isinstance(obj, type) else "function"
    name = getattr(obj, "__qualname__", None) or repr(obj)
    where = ""
    code = getattr(obj, "__code__", None)
    if code is not None:
        where = f" (defined in {code.co_filename}, line {code.co_firstlineno})"
    return (
        f"nbdist cannot send the notebook's {kind} {name!r}{where} to a child process: "
        f"cloudpickle cannot serialise it ({type(exc).__name__}: {exc}). Create what it "
        f"holds that cannot travel (a lock, an open file, a connection, a Spark handle) inside "
        f"the child (in the function itself, or in a DataLoader's worker_init_fn), or pass "
        f"plain data to it instead; or define it in a module file next to the notebook and "
        f"import it."
    )


def _rebuild(blob: bytes) -> Any:
    """A child's side of :func:`_reducer_override`: the object, and the same rule here."""
    import cloudpickle

    install()
    return cloudpickle.loads(blob)

"""Rich output on a rank: ``display(obj)`` and matplotlib figures, as Jupyter mime bundles.

A rank has no front end, so IPython's ``display`` would print a repr there. This module's
:func:`display` builds the bundle the kernel would publish (``_repr_mimebundle_``, the
``_repr_*_`` methods, a matplotlib figure as PNG) and sends it to the notebook as a
``DisplayEvent`` on the rank's control channel; the views show it in the rank's pane, rank 0's
below the panel too, and its text form in the text view. It stands in for ``display`` in the
cell's namespace, and for ``IPython.display.display`` once the cell's code imports IPython
(:func:`install` patches IPython's module, now or when it is imported).

matplotlib: the rank's backend is ``nbdist.rank.mpl_backend`` (Agg, non-interactive:
``MPLBACKEND``), whose ``plt.show()`` sends the open figures; figures still open at the end of
a cell are sent then (:func:`flush_figures`), as the inline backend does.

Standard library only at module level (it runs on every rank): IPython's formatter is used only
where the cell's own code imported IPython already, matplotlib only where it imported it.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from nbdist.protocol import MAX_DISPLAY_BYTES, DisplayEvent, size_text
from nbdist.rank import reporting

#: The rank's matplotlib backend (``MPLBACKEND``).
BACKEND = "module://nbdist.rank.mpl_backend"
#: Backends that need a notebook front end, which a rank has not (the kernel's own
#: ``MPLBACKEND`` reaches the ranks with its environment): replaced by ``BACKEND``.
_NOTEBOOK_BACKENDS = ("inline", "ipympl", "widget", "nbagg", "notebook")
#: A text form is cut at this many characters.
MAX_TEXT_CHARS = 64 * 1024

#: ``_repr_*_`` methods, in the order IPython's ``DisplayFormatter`` asks them.
_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
    ("application/pdf", "_repr_pdf_"),
)
_BINARY = frozenset({"image/png", "image/jpeg", "application/pdf"})


# -- the bundle --------------------------------------------------------------------------------
def _method(obj: Any, name: str) -> Any:
    """``obj.name`` if it is a method of an instance (not of a class, nor a ``__getattr__``
    that answers every name), else None."""
    if isinstance(obj, type):
        return None
    try:
        found = getattr(obj, name, None)
    except Exception:
        return None
    return found if callable(found) else None


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # as IPython does: a repr that raises is left out, and said
        print(f"nbdist: {getattr(fn, '__qualname__', fn)} raised {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return None


def _is_figure(obj: Any) -> bool:
    return type(obj).__module__.startswith("matplotlib.figure") and hasattr(obj, "savefig")


def figure_bundle(fig: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A matplotlib figure as the inline backend shows it: a PNG, cut to what is drawn."""
    import io

    buf = io.BytesIO()
    fig.canvas.print_figure(buf, format="png", bbox_inches="tight")
    return {"image/png": buf.getvalue(), "text/plain": repr(fig)}, {}


def _ipython_bundle(obj: Any, include: Any, exclude: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """IPython's own formatter (objects registered with it, IPython's pretty printer)."""
    formatters = sys.modules["IPython.core.formatters"]
    global _formatter
    if _formatter is None:
        _formatter = formatters.DisplayFormatter()
    data, metadata = _formatter.format(obj, include=include, exclude=exclude)
    return dict(data), dict(metadata)


_formatter: Any = None


def _own_bundle(obj: Any, include: Any, exclude: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    data: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    bundle = _method(obj, "_repr_mimebundle_")
    if bundle is not None:
        got = _call(bundle, include=include, exclude=exclude)
        if isinstance(got, tuple) and len(got) == 2:
            got, more = got
            metadata.update(more or {})
        if isinstance(got, dict):
            data.update(got)
    for mime, name in _METHODS:
        if mime in data or (include and mime not in include) or (exclude and mime in exclude):
            continue
        method = _method(obj, name)
        if method is None:
            continue
        got = _call(method)
        if isinstance(got, tuple) and len(got) == 2:
            got, more = got
            if more:
                metadata[mime] = more
        if got is not None:
            data[mime] = got
    if "text/plain" not in data:
        try:
            data["text/plain"] = repr(obj)
        except Exception as exc:
            data["text/plain"] = f"<{type(obj).__name__}: its repr raised {exc!r}>"
    return data, metadata


def mime_bundle(obj: Any, include: Sequence[str] | None = None,
                exclude: Sequence[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``obj``'s representations: mime type → data (binary data as bytes), and metadata."""
    if _is_figure(obj):
        return figure_bundle(obj)
    if "IPython.core.formatters" in sys.modules:
        try:
            return _ipython_bundle(obj, include, exclude)
        except Exception:  # an IPython without a usable formatter here: ours
            pass
    return _own_bundle(obj, include, exclude)


def _encoded(data: dict[str, Any]) -> dict[str, Any]:
    """The bundle as Jupyter's messages carry it: binary types in base64, text as str."""
    out: dict[str, Any] = {}
    for mime, value in data.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
            if mime in _BINARY or mime.startswith("image/") and mime != "image/svg+xml":
                out[mime] = base64.b64encode(raw).decode("ascii")
            else:
                out[mime] = raw.decode("utf-8", "replace")
        elif isinstance(value, str) or mime == "application/json" or mime.endswith("+json"):
            out[mime] = value
        else:
            out[mime] = str(value)
    return out


def _weight(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    try:
        return len(json.dumps(value, default=str))
    except (TypeError, ValueError, RecursionError):
        return MAX_DISPLAY_BYTES + 1


def bound(data: dict[str, Any], limit: int = MAX_DISPLAY_BYTES) -> tuple[dict[str, Any], str]:
    """The bundle within ``limit`` bytes: its largest representations left out (the text form
    stays, cut to ``MAX_TEXT_CHARS``) until it fits, and a note that says what went."""
    data = dict(data)
    text = data.get("text/plain")
    if isinstance(text, str) and len(text) > MAX_TEXT_CHARS:
        data["text/plain"] = text[:MAX_TEXT_CHARS] + "…"
    weights = {mime: _weight(value) for mime, value in data.items()}
    total = sum(weights.values())
    if total <= limit:
        return data, ""
    dropped = []
    for mime in sorted(weights, key=weights.__getitem__, reverse=True):
        if total <= limit:
            break
        if mime == "text/plain":
            continue
        del data[mime]
        total -= weights[mime]
        dropped.append(f"{mime} ({size_text(weights[mime])} as sent)")
    note = (f"[nbdist: this display's {', '.join(dropped)} is over the limit of "
            f"{size_text(limit)} for one display and was left out; save it to a file "
            f"(plt.savefig, Image.save) or make it smaller]")
    plain = data.get("text/plain")
    data["text/plain"] = f"{plain}\n{note}" if isinstance(plain, str) and plain else note
    return data, note


def publish(data: dict[str, Any], metadata: dict[str, Any] | None = None) -> None:
    """Send one mime bundle to the notebook (outside a rank: print its text form)."""
    data, note = bound(_encoded(data))
    channel = reporting.channel
    if channel is None:
        print(data.get("text/plain", ""))
        return
    event: DisplayEvent = {"t": "display", "data": data, "metadata": dict(metadata or {}),
                           "size": sum(_weight(v) for v in data.values())}
    if note:
        event["note"] = note
    for stream in (sys.stdout, sys.stderr):  # what it printed before comes first, as it can
        try:
            stream.flush()
        except Exception:
            pass
    channel.event(event)


class DisplayHandle:
    """What ``display(..., display_id=...)`` returns; a rank's display cannot be replaced in
    the notebook, so ``update`` shows the new object as one more display."""

    def __init__(self, display_id: Any = None) -> None:
        self.display_id = display_id

    def display(self, obj: Any, **kwargs: Any) -> None:
        display(obj, **kwargs)

    def update(self, obj: Any, **kwargs: Any) -> None:
        display(obj, **kwargs)


def display(*objs: Any, include: Sequence[str] | None = None,
            exclude: Sequence[str] | None = None, metadata: dict[str, Any] | None = None,
            transient: Any = None, display_id: Any = None, raw: bool = False,
            clear: bool = False, **kwargs: Any) -> DisplayHandle | None:
    """IPython's ``display`` on a rank: each object's rich representations reach the notebook,
    labelled with this rank (``raw=True``: the objects are mime bundles already)."""
    for obj in objs:
        if raw:
            publish(dict(obj), metadata)
            continue
        own = _method(obj, "_ipython_display_")
        if own is not None:
            _call(own)
            continue
        data, more = mime_bundle(obj, include, exclude)
        if not data:
            continue
        publish(data, {**more, **(metadata or {})})
    if display_id is not None:
        return DisplayHandle(display_id)
    return None


# -- IPython's display, once the cell's code imports it ----------------------------------------
#: IPython's modules whose ``display`` is this one's on a rank.
_IPYTHON_MODULES = ("IPython.core.display_functions", "IPython.core.display", "IPython.display")


def _patch_ipython() -> None:
    for name in _IPYTHON_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "display", None) is not display:
            try:
                module.display = display  # type: ignore[attr-defined]
            except Exception:  # a module object that refuses attributes: leave it
                pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``IPython.core.display_functions`` as it is imported (the others import its
    ``display`` by name right after), so ``from IPython.display import display`` in a cell
    gets this module's."""

    _busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _IPYTHON_MODULES[0] or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        spec = None
        try:  # whichever finder would find it (a path, an editable install's finder)
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.display = display  # type: ignore[attr-defined]

        loader.exec_module = exec_module
        return spec


_hook = _AfterImport()


# -- matplotlib ---------------------------------------------------------------------------------
def _notebook_backend(name: str) -> bool:
    low = name.lower()
    return any(word in low for word in _NOTEBOOK_BACKENDS)


def install() -> None:
    """Before each payload: IPython's ``display`` is this module's (now, or once imported),
    and matplotlib draws with ``BACKEND`` unless the cell asked for another non-notebook one
    (``--env MPLBACKEND=Agg``)."""
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
    _patch_ipython()
    wanted = os.environ.get("MPLBACKEND", "")
    if not wanted or _notebook_backend(wanted):
        os.environ["MPLBACKEND"] = BACKEND
    mpl = sys.modules.get("matplotlib")
    if mpl is None or os.environ["MPLBACKEND"] != BACKEND:
        return
    try:  # imported before (a warm interpreter): its backend came from the kernel's variable
        current = dict.__getitem__(mpl.rcParams, "backend")
        auto = current is getattr(mpl.rcsetup, "_auto_backend_sentinel", None)
        if not auto and not _notebook_backend(str(current)):
            return
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None:
            pyplot.switch_backend(BACKEND)
        else:
            mpl.rcParams["backend"] = BACKEND
    except Exception as exc:
        print(f"nbdist: matplotlib's backend could not be set to nbdist's: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)


def show_figures(close: bool = True) -> None:
    """Send every open figure (``plt.show()``), then close them (as the inline backend)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    from matplotlib._pylab_helpers import Gcf

    managers = Gcf.get_all_fig_managers()
    for manager in managers:
        publish(*figure_bundle(manager.canvas.figure))
    if close and managers:
        pyplot.close("all")


def flush_figures() -> None:
    """At a cell's end: the figures still open, when the rank draws with ``BACKEND``. Never
    raises (a cell's end must go on)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    try:
        if str(pyplot.get_backend()) != BACKEND:
            return
        show_figures()
    except Exception as exc:
        print(f"nbdist: the cell's open figures could not be sent: {type(exc).__name__}: {exc}",
              file=sys.stderr)

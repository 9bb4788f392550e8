"""The notebook's root logging configuration, carried to the ranks as the environment is.

A rank is a fresh interpreter: ``logging.basicConfig(level=logging.INFO, ...)`` done in an
earlier cell does nothing there, so every ``logger.info`` of the rank's code vanishes and
warnings lose their format (under torchrun the script configures its own process). So a cell's
payload carries :class:`CarriedLogging`, taken in the kernel by :func:`snapshot`: the root
logger's level and its handlers that write to stdout or stderr (their level and format).
:func:`apply` sets them up on the rank before the cell runs, marked as carried.

The rank's own configuration wins: ``logging.basicConfig(...)`` in the cell replaces the carried
handlers and level, as if nothing had been carried (``basicConfig`` is wrapped to drop them
first: otherwise it does nothing when the root logger has handlers); ``dictConfig`` and
``fileConfig`` replace them anyway. In a session, once a cell configured logging itself, later
cells leave its configuration alone. Handlers that write elsewhere (files, sockets, queues),
filters, and loggers other than the root are not carried: a file handler's path may not exist
where the ranks run.

Standard library only: this module is imported on every rank.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Literal

from nbdist.protocol import CarriedHandler, CarriedLogging

#: The attribute that marks a handler nbdist added from the notebook's configuration.
CARRIED = "_nbdist_carried"
_STYLES: dict[type[Any], Literal["%", "{", "$"]] = {
    logging.PercentStyle: "%", logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$",
}


def snapshot() -> CarriedLogging | None:
    """The kernel's root logging configuration, or None where it is Python's default."""
    root = logging.getLogger()
    streams = {id(sys.stdout): "stdout", id(sys.__stdout__): "stdout",
               id(sys.stderr): "stderr", id(sys.__stderr__): "stderr"}
    handlers = []
    for h in root.handlers:
        stream = streams.get(id(getattr(h, "stream", None)))
        if not isinstance(h, logging.StreamHandler) or stream is None:
            continue  # a file, a socket, a queue: nothing the ranks can write to
        fmt = h.formatter
        handlers.append(CarriedHandler(
            "stdout" if stream == "stdout" else "stderr", h.level,
            fmt._fmt if fmt is not None else None, fmt.datefmt if fmt is not None else None,
            _STYLES.get(type(fmt._style), "%") if fmt is not None else "%",
        ))
    if not handlers and root.level == logging.WARNING:
        return None
    return CarriedLogging(root.level, tuple(handlers))


#: The root level :func:`apply` set, while nothing else changed it.
_level: int | None = None


def apply(config: CarriedLogging | None) -> None:
    """Set the notebook's configuration up on this rank, unless the rank's code made its own."""
    root = logging.getLogger()
    _wrap_basic_config()
    if any(not getattr(h, CARRIED, False) for h in root.handlers):
        return  # configured on the rank (an earlier cell of a session): that wins
    _undo(root)
    if config is None:
        return
    global _level
    if root.level == logging.WARNING:  # Python's default: the notebook's level applies
        root.setLevel(config.level)
        _level = config.level
    for c in config.handlers:
        h = logging.StreamHandler(sys.stdout if c.stream == "stdout" else sys.stderr)
        h.setLevel(c.level)
        h.setFormatter(logging.Formatter(c.fmt, c.datefmt, c.style))
        setattr(h, CARRIED, True)
        root.addHandler(h)


def _undo(root: logging.Logger) -> None:
    """Remove the carried handlers, and the carried level if nothing changed it since."""
    global _level
    for h in list(root.handlers):
        if getattr(h, CARRIED, False):
            root.removeHandler(h)
    if _level is not None and root.level == _level:
        root.setLevel(logging.WARNING)
    _level = None


def _wrap_basic_config() -> None:
    """Make ``logging.basicConfig`` on the rank replace the carried configuration."""
    original = logging.basicConfig
    if getattr(original, CARRIED, False):
        return

    @functools.wraps(original)
    def basicConfig(**kwargs: Any) -> None:  # noqa: N802 - logging's own name
        root = logging.getLogger()
        if root.handlers and all(getattr(h, CARRIED, False) for h in root.handlers):
            _undo(root)
        original(**kwargs)

    setattr(basicConfig, CARRIED, True)
    logging.basicConfig = basicConfig

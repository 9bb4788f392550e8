"""``%dist_session``'s report: rich in notebooks, plain text in terminals."""

from __future__ import annotations

import time
from html import escape
from typing import Protocol

from nbdist.state import JobState


class _Launcher(Protocol):
    @property
    def name(self) -> str: ...


class _Cell(Protocol):
    @property
    def id(self) -> str: ...


class SessionModel(Protocol):
    """What the report reads of a session (``session.Session`` is one): the views read the
    model, never the session layer itself."""

    @property
    def id(self) -> str: ...
    @property
    def np(self) -> int: ...
    @property
    def state(self) -> JobState: ...
    @property
    def rss(self) -> dict[int, int]: ...
    @property
    def broken(self) -> str | None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def busy(self) -> _Cell | None: ...
    @property
    def idle_since(self) -> float: ...
    @property
    def idle_timeout(self) -> float | None: ...
    @property
    def warning(self) -> str: ...
    @property
    def launcher(self) -> _Launcher: ...
    def defined_names(self) -> set[str]: ...


class SessionReport:
    """``%dist_session``: the session's ranks, hosts, GPUs, memory, names and idle time."""

    def __init__(self, session: SessionModel) -> None:
        self.session = session

    def rows(self) -> list[tuple[str, ...]]:
        s = self.session
        rows: list[tuple[str, ...]] = []
        for r in s.state.ranks:
            rss = s.rss.get(r.rank)
            rows.append((str(r.rank), r.host or "?", str(r.pid or "?"), r.gpu or "-",
                         f"{rss / 1e6:.0f} MB" if rss else "?"))
        return rows

    def header(self) -> str:
        s = self.session
        how = (f"broken: {s.broken}" if s.broken else "live" if s.alive else "ended")
        busy = s.busy
        doing = f"running {busy.id}" if busy is not None else (
            f"idle for {time.time() - s.idle_since:.0f} s")
        limit = f", idle timeout {s.idle_timeout:g} s" if s.idle_timeout else ""
        return f"session {s.id}: {s.np} ranks on {s.launcher.name}, {how}, {doing}{limit}"

    def __repr__(self) -> str:
        names = ", ".join(sorted(self.session.defined_names())) or "none yet"
        lines = [self.header(), "rank  host  pid  gpu  memory"]
        lines += ["  ".join(row) for row in self.rows()]
        lines.append(f"defined on the ranks: {names}")
        if self.session.warning:
            lines.append(f"warning: {self.session.warning}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        cells = "".join(
            "<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row) + "</tr>"
            for row in self.rows()
        )
        names = escape(", ".join(sorted(self.session.defined_names())) or "none yet")
        warning = (f"<p><b>warning:</b> {escape(self.session.warning)}</p>"
                   if self.session.warning else "")
        return (f"<div class='nbdist-session'><p>{escape(self.header())}</p><table><tr>"
                "<th>rank</th><th>host</th><th>pid</th><th>GPU</th><th>memory</th></tr>"
                f"{cells}</table><p>defined on the ranks: <code>{names}</code></p>{warning}"
                "</div>")

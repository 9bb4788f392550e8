"""What the text view and the panel share: rendering from a thread of their own (``--bg``)."""

from __future__ import annotations

import contextvars
import threading


class BackgroundRenderer:
    """``start()`` renders from a thread until the job is over; ``close()`` renders it final.

    Subclasses implement ``_loop`` (render until told to stop or the job ends, then
    ``_finish``) and ``_finish`` (the final render, once).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Render from a background thread until the job is over, then render it final."""
        if self._thread is None:
            # In the caller's context: ipykernel keeps the cell an output belongs to in a
            # context variable, so what this thread displays or prints lands in the cell that
            # started the job, not in whichever cell runs when the job ends (--bg).
            ctx = contextvars.copy_context()
            self._thread = threading.Thread(target=ctx.run, args=(self._loop,), daemon=True,
                                            name=self._name)
            self._thread.start()

    def close(self) -> None:
        """Stop the background thread and render the final state (once)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._finish()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

"""Ctrl-C that waits for the step to finish: a step is all-or-nothing, and the host updates it has begun
cannot be undone, so a SIGINT during it is held until the step's end and raised there.

A second SIGINT while one is held raises at once (the user insists); the strategy then aborts the step
and, if updates of it had run, refuses to save the mixed state. Only on the main thread, where Python
delivers signals; elsewhere (and where SIGINT is not Python's default handler) this does nothing.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class DeferredInterrupt:
    """``arm()`` at a step's start, ``release()`` at its end (nestable): a SIGINT in between is held, and
    raised as ``KeyboardInterrupt`` by :meth:`deliver`, which the strategy calls where Lightning has
    finished the step's bookkeeping (its global step counted): the next batch's start, validation's, or
    the end of training."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending = False
        self._previous: Any = None

    def arm(self) -> None:
        if self._depth == 0:
            if threading.current_thread() is not threading.main_thread():
                return
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                return  # someone else handles SIGINT (Lightning's shutdown ignores it, a debugger...)
            self._previous = signal.signal(signal.SIGINT, self._hold)
        self._depth += 1

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        if self._pending:  # a second Ctrl-C: now
            raise KeyboardInterrupt
        self._pending = True

    def release(self) -> None:
        """End of the (outermost) step: the handler goes back; a held SIGINT waits for :meth:`deliver`."""
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            signal.signal(signal.SIGINT, self._previous)

    def deliver(self) -> None:
        """Raise the held SIGINT, if any, as ``KeyboardInterrupt`` (outside any step)."""
        if self._pending and self._depth == 0:
            self._pending = False
            raise KeyboardInterrupt

    def drop(self) -> None:
        """An exception ended the step: a held SIGINT is moot (the exception is already on its way)."""
        self._pending = False

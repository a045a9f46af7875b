"""Ctrl-C and SIGTERM for a long run: the first asks to stop after the step in progress, the second
ends the process at once — at any moment, even inside a compilation or a device computation.

Python runs a signal handler only when the main thread returns to the interpreter, which a long XLA
compilation does not do for seconds, and an exception raised from a handler lands wherever that
happens (inside a garbage-collection callback it is printed as "Exception ignored in:
_xla_gc_callback" and lost). So the Python handlers here do nothing; the C-level handler also writes
each signal's number to a pipe (:func:`signal.set_wakeup_fd`), and a watcher thread reading that pipe
counts the signals while the main thread is busy in compiled code (which releases the GIL). On the
second signal the watcher calls ``on_hard_exit`` (which writes the log kept so far), removes
temporary files and the lock, prints one line and leaves with :func:`os._exit` (status 130): no
exception travels through JAX.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from . import _lock, _output

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_STATUS = 130


class Interrupts:
    """Counts Ctrl-C/SIGTERM from :meth:`install` to :meth:`restore` (a context manager).

    Args:
        prog: the command's name, for the messages (``"vmcgrad vmc"``).
        first_message: printed on the first signal.
        on_hard_exit: called on the second signal before the process ends (keep it short; it runs
            in the watcher thread while the main thread may be anywhere).

    Attributes:
        requested: True once a first signal came: the caller stops at its next safe point.
    """

    def __init__(self, prog: str, first_message: str, on_hard_exit: Callable[[], str | None]):
        self.prog, self.first_message, self.on_hard_exit = prog, first_message, on_hard_exit
        self.requested = False
        self._count = 0
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self) -> Interrupts:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def install(self) -> None:
        """Installs the handlers and starts the watcher (call from the main thread)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._previous = {sig: signal.signal(sig, _ignore) for sig in SIGNALS}
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="vmcgrad-interrupts", daemon=True).start()

    def restore(self) -> None:
        """Puts the previous handlers back and stops the watcher."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._previous.items():
            # once a stop was asked for, the process is on its way out: a late second signal during
            # shutdown stays ignored (the default handler would raise KeyboardInterrupt in JAX's atexit)
            signal.signal(sig, _ignore if self.requested else handler)
        w = self._pipe[1]
        self._pipe = None
        os.close(w)  # the watcher's read returns b"" and it ends; it closes r

    def _watch(self, r: int) -> None:
        try:
            while data := os.read(r, 64):
                for signum in data:
                    if signum in SIGNALS:
                        self._signal()
        finally:
            os.close(r)

    def _signal(self) -> None:
        self._count += 1
        if self._count == 1:
            self.requested = True
            sys.stderr.write(f"\n{self.first_message}\n")
            sys.stderr.flush()
            return
        note = None
        try:
            note = self.on_hard_exit()
        except BaseException as error:  # whatever happens, the process ends now
            note = f"could not keep the output: {type(error).__name__}: {error}"
        finally:
            _output.remove_temporaries()
            _lock.release_all()
            sys.stderr.write(
                f"\n{self.prog}: stopped at once (second interrupt){'; ' + note if note else ''}\n"
            )
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(EXIT_STATUS)


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing (the watcher thread acts on the signal)."""

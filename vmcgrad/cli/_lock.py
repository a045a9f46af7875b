"""One run per output directory: a lock file ``DIR/.vmcgrad.lock`` held for the whole run.

The lock is an advisory ``flock`` on that file, which records the holder's process id. The kernel
drops a ``flock`` when its process ends, however it ends (even ``kill -9``), so a lock file left by a
dead process is simply taken over: a stale lock never blocks a new run. A second run into a directory
whose lock is held refuses at once, naming the process that holds it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

LOCK_NAME = ".vmcgrad.lock"

#: Locks this process holds; released by :func:`release_all` before a hard exit.
_HELD: list[OutDirLock] = []


class Busy(Exception):
    """The output directory is locked by a running process; the message is one line."""


class OutDirLock:
    """The held lock of one output directory (see the module docstring).

    Attributes:
        path: the lock file.
        stale_pid: the process id a stale lock file named (its process had ended), or None.
    """

    def __init__(self, path: Path, fd: int, stale_pid: int | None):
        self.path, self._fd, self.stale_pid = path, fd, stale_pid

    @classmethod
    def acquire(cls, out: Path) -> OutDirLock:
        """Locks ``out`` (an existing directory) for this process.

        Raises:
            Busy: if another running process holds the lock.
            OSError: if the lock file cannot be created or written (it is then removed).
        """
        import fcntl

        path = out / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"process {holder}" if holder else "another process"
                raise Busy(
                    f"{str(out)!r} is in use by another vmcgrad run ({who}, lock file {path})"
                ) from None
            # The holder may have removed the file between our open and our flock: then we locked
            # an unlinked file, and must lock the one that is there now.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = _read_pid(fd)
        try:
            os.ftruncate(fd, 0)
            if os.pwrite(fd, f"{os.getpid()}\n".encode(), 0) == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # a full disk: leave no lock file behind (ours now, or a stale one)
            _remove(path)
            os.close(fd)
            raise
        lock = cls(path, fd, stale if stale and stale != os.getpid() else None)
        _HELD.append(lock)
        return lock

    def release(self) -> None:
        """Removes the lock file and drops the lock (idempotent)."""
        if self._fd is None:
            return
        _remove(self.path)
        os.close(self._fd)
        self._fd = None
        if self in _HELD:
            _HELD.remove(self)


def release_all() -> None:
    """Releases every lock this process holds."""
    for lock in list(_HELD):
        lock.release()


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None

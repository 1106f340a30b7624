"""The log's only access to the file system, so that tests can record calls or make them fail.

``Disk`` does plain blocking calls (the Trio shell runs writes and fsyncs in a worker
thread). File descriptors stay bounded however many segments the log holds: one append
descriptor per file being written (the log seals a segment once it is full, which closes
its descriptor) and a small least-recently-used set of read descriptors. ``fsync`` of a file
without an append descriptor opens it for the call: Linux reports a writeback error that
nobody has seen yet to a descriptor opened after it happened, so nothing is missed.
``FaultyDisk`` raises ``OSError(EIO)`` or ``OSError(ENOSPC)`` on demand, or holds fsyncs
until it is told to let them go (a slow disk, made observable).
Standard library only; no trio.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import OrderedDict

READ_FDS = 8  # read descriptors kept open (least recently used closed first)


def _deleted(path: str) -> OSError:
    return OSError(errno.ENOENT, f"{os.path.basename(path)} was deleted while the broker ran "
                   "(what was written to it is gone); restart the broker")


class Disk:
    """Blocking file operations on segment files, with bounded descriptor caches."""

    def __init__(self, read_fds: int = READ_FDS) -> None:
        self._fds: dict[str, int] = {}  # append descriptors
        self._readers: OrderedDict[str, int] = OrderedDict()
        self._read_fds = max(1, read_fds)
        self._lock = threading.Lock()  # reads run on the event loop, undo in a worker thread
        self._gone: set[str] = set()  # segment files deleted while being written

    def listdir(self, directory: str) -> list[str]:
        return sorted(os.listdir(directory))

    def reserve(self, path: str, size: int) -> int:
        """Make ``path`` a file of ``size`` bytes written to disk (zeros, synced), or of an
        eighth of the free space (counting its own) if that is less; one as big already
        is left as it is, and a smaller one is made again only to double it or reach
        ``size`` (not a flash write at every change of the free space). Returns its size
        (0: none; something other than a regular file at ``path`` is left alone)."""
        try:
            st_file = os.lstat(path)
        except FileNotFoundError:
            have = 0
        else:
            if not stat.S_ISREG(st_file.st_mode):
                return 0
            have = st_file.st_size
        st = os.statvfs(os.path.dirname(path) or ".")
        can = min(size, (st.f_bavail * st.f_frsize + have) // 8)
        if can <= have or (have and can < 2 * have and can < size):
            return have
        size = can
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, bytes(size))
            os.fsync(fd)
        except OSError:
            os.close(fd)
            os.remove(path)
            raise
        os.close(fd)
        return size

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def pread(self, path: str, pos: int, size: int) -> bytes:
        with self._lock:
            fd = self._readers.get(path)
            if fd is None:
                fd = self._readers[path] = os.open(path, os.O_RDONLY)
                if len(self._readers) > self._read_fds:
                    os.close(self._readers.popitem(last=False)[1])
            else:
                self._readers.move_to_end(path)
            return os.pread(fd, size, pos)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return fd

    def append(self, path: str, data: bytes) -> None:
        if path in self._gone:
            raise _deleted(path)
        fd = self._fd(path)
        if not os.fstat(fd).st_nlink:  # somebody deleted the file under the broker
            # refused from now on: opened again, it would be a new file without its header
            self._gone.add(path)
            del self._fds[path]
            os.close(fd)
            raise _deleted(path)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def fsync(self, path: str) -> None:
        fd = self._fds.get(path)
        if fd is not None:
            os.fsync(fd)
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def seal(self, path: str) -> None:
        """No more appends to ``path``: close its append descriptor."""
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def write_file(self, path: str, data: bytes) -> None:
        """Create (or replace the content of) ``path`` with ``data`` and fsync it."""
        self.forget(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(path, size)

    def rename(self, src: str, dst: str) -> None:
        self.forget(src)
        self.forget(dst)
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        self.forget(path)
        os.remove(path)

    def forget(self, path: str) -> None:
        """Close every descriptor held on ``path``."""
        self.seal(path)
        with self._lock:
            fd = self._readers.pop(path, None)
        if fd is not None:
            os.close(fd)

    @property
    def open_fds(self) -> int:
        return len(self._fds) + len(self._readers)

    def close(self) -> None:
        for path in [*self._fds, *self._readers]:
            self.forget(path)


class FaultyDisk(Disk):
    """A Disk whose writes, fsyncs and truncates fail while ``fail_writes`` / ``fail_fsync`` /
    ``fail_truncate`` are set, and whose fsyncs wait between ``hold_fsync`` and
    ``release_fsync`` (``fsync_held`` is set once one waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_writes = False
        self.fail_fsync = False
        self.fail_truncate = False
        self.partial = 0  # bytes a failing write still puts on disk (a torn write)
        self._gate = threading.Event()  # fsyncs pass while it is set
        self._gate.set()
        self.fsync_held = threading.Event()

    def hold_fsync(self) -> None:
        """From now on every fsync waits (in its worker thread) for ``release_fsync``."""
        self.fsync_held.clear()
        self._gate.clear()

    def release_fsync(self) -> None:
        self._gate.set()

    def append(self, path: str, data: bytes) -> None:
        if self.fail_writes:
            if self.partial:
                super().append(path, data[: self.partial])
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        super().append(path, data)

    def truncate(self, path: str, size: int) -> None:
        if self.fail_truncate:
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().truncate(path, size)

    def fsync(self, path: str) -> None:
        if not self._gate.is_set():
            self.fsync_held.set()
            self._gate.wait()
        if self.fail_fsync:
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().fsync(path)

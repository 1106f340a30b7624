"""The log's only access to the file system, so that tests can make the disk fail.

``Disk`` does plain blocking calls (the Trio shell runs writes and fsyncs in a worker
thread); ``FaultyDisk`` raises ``OSError(EIO)`` or ``OSError(ENOSPC)`` on demand.
Standard library only; no trio.
"""

from __future__ import annotations

import errno
import os


class Disk:
    """Blocking file operations on segment files, with one cached append handle per file."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def listdir(self, directory: str) -> list[str]:
        return sorted(os.listdir(directory))

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def pread(self, path: str, pos: int, size: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, size, pos)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return fd

    def append(self, path: str, data: bytes) -> None:
        fd = self._fd(path)
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]

    def fsync(self, path: str) -> None:
        os.fsync(self._fd(path))

    def fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(path, size)

    def rename(self, src: str, dst: str) -> None:
        self.forget(src)
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        self.forget(path)
        os.remove(path)

    def forget(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for path in list(self._fds):
            self.forget(path)


class FaultyDisk(Disk):
    """A Disk whose writes, fsyncs and truncates fail while ``fail_writes`` / ``fail_fsync`` /
    ``fail_truncate`` are set."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_writes = False
        self.fail_fsync = False
        self.fail_truncate = False
        self.partial = 0  # bytes a failing write still puts on disk (a torn write)

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
        if self.fail_fsync:
            raise OSError(errno.EIO, "Input/output error (injected)")
        super().fsync(path)

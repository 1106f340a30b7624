"""The log's only access to the file system, so that tests can record calls or make them fail.

``Disk`` does plain blocking calls (the Trio shell runs writes and fsyncs in a worker
thread). File descriptors stay bounded however many segments the log holds: one append
descriptor per file being written (the log seals a segment once it is full, which closes
its descriptor) and a small least-recently-used set of read descriptors. ``fsync`` of a file
without an append descriptor opens it for the call: Linux reports a writeback error that
nobody has seen yet to a descriptor opened after it happened, so nothing is missed.

Files can be deleted under the running broker (``rm -rf data/wal``, a tmp cleaner). On Linux
an open, unlinked file still takes writes and fsyncs, so success says nothing about what a
restart will read: ``intact`` (one ``stat`` per file open for appends) says whether each is
still at its path, and ``restore`` makes the directory again and writes such files back from
their descriptors (docs/WAL.md, "Files deleted under the broker").
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
from typing import NamedTuple

READ_FDS = 8  # read descriptors kept open (least recently used closed first)
_COPY = 1 << 20  # bytes ``restore`` copies at a time
# appends; read too: should the file be deleted, ``restore`` reads it back from there
_APPEND = os.O_RDWR | os.O_APPEND


class Restored(NamedTuple):
    """What ``Disk.restore`` put back after files of the log were deleted under it."""

    made: bool  # the log's directory was gone and is made again
    names: tuple[str, ...] = ()  # segment files written back (from descriptors or memory)
    size: int = 0  # bytes written back

    def joined(self, other: Restored | None) -> Restored:
        """This restore and an earlier one of the same batch, as one report."""
        if other is None:
            return self
        return Restored(self.made or other.made, other.names + self.names,
                        self.size + other.size)


class Disk:
    """Blocking file operations on segment files, with bounded descriptor caches."""

    def __init__(self, read_fds: int = READ_FDS) -> None:
        self._fds: dict[str, int] = {}  # append descriptors
        self._readers: OrderedDict[str, int] = OrderedDict()
        self._read_fds = max(1, read_fds)
        self._lock = threading.Lock()  # reads run on the event loop, undo in a worker thread
        self._ids: dict[str, tuple[int, int]] = {}  # (device, inode) of each append descriptor
        self._made = False  # a directory made again that no ``Restored`` reported yet

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
            fd = self._register(path, os.open(path, _APPEND | os.O_CREAT, 0o644))
        return fd

    def _register(self, path: str, fd: int) -> int:
        st = os.fstat(fd)
        self._fds[path] = fd
        self._ids[path] = (st.st_dev, st.st_ino)
        return fd

    def open(self, path: str) -> None:
        """Open the existing file ``path`` for appends now, not at its first write."""
        if path not in self._fds:
            self._register(path, os.open(path, _APPEND))

    def is_open(self, path: str) -> bool:
        """Whether ``path`` has an append descriptor."""
        return path in self._fds

    def intact(self) -> bool:
        """Whether every file open for appends is still at its path (one ``stat`` each;
        the log holds one, two while it rotates): a file deleted, or its directory deleted
        or moved, takes writes and fsyncs all the same, where no restart looks."""
        for path, ident in list(self._ids.items()):  # retention may close one meanwhile
            try:
                st = os.stat(path)
            except OSError:
                return False
            if (st.st_dev, st.st_ino) != ident:
                return False
        return True

    def restore(self, directory: str) -> Restored:
        """After files were deleted under the log: make ``directory`` again if it is gone,
        and write every file open for appends that is no longer at its path back there
        from its descriptor (which still holds all of it), each fsynced, then the
        directory. Raises OSError when that cannot be done (then nothing written through
        these descriptors may be confirmed; the next call tries again)."""
        made = self._make_dir(directory)
        names: list[str] = []
        size = 0
        for path in [p for p in list(self._fds) if not self._at_path(p)]:
            written = self._write_back(path)
            if written is not None:
                size += written
                names.append(os.path.basename(path))
        if names or made:
            self.fsync_dir(directory)
        made, self._made = made or self._made, False
        return Restored(made, tuple(names), size)

    def _at_path(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return path not in self._ids  # closed meanwhile (retention): not to write back
        return (st.st_dev, st.st_ino) == self._ids.get(path)

    def _make_dir(self, directory: str) -> bool:
        """Make ``directory`` (and its parents) if it is gone, each new entry fsynced in its
        parent; whether it was gone."""
        missing: list[str] = []
        at = os.path.abspath(directory)
        while not os.path.isdir(at):
            missing.append(at)
            at = os.path.dirname(at)
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if not os.path.isdir(path):
                    raise OSError(errno.ENOTDIR, f"{directory} was deleted while the broker "
                                  f"ran and cannot be made again: {path} is not a "
                                  "directory") from None
            except OSError as exc:
                raise OSError(exc.errno, f"{directory} was deleted while the broker ran and "
                              f"cannot be made again: {exc.strerror}") from None
            self.fsync_dir(os.path.dirname(path))
            self._made = True
        return bool(missing)

    def _write_back(self, path: str) -> int | None:
        """Copy the file behind ``path``'s append descriptor to ``path`` (fsynced) and append
        through the copy from now on; returns its size (None: no descriptor any more).
        Written in place, not renamed into it: a crash halfway leaves a shorter segment, a
        torn tail at worst, that the next start cuts to whole records."""
        old = self._fds.get(path)
        if old is None:
            return None
        size = os.fstat(old).st_size
        new = os.open(path, _APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            at = 0
            while at < size:
                chunk = os.pread(old, min(_COPY, size - at), at)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(new, view):]
                at += len(chunk)
            os.fsync(new)
        except OSError:
            os.close(new)
            raise
        self._register(path, new)
        os.close(old)
        with self._lock:  # a read descriptor there reads the deleted file, not this one
            fd = self._readers.pop(path, None)
        if fd is not None:
            os.close(fd)
        return at

    def append(self, path: str, data: bytes) -> None:
        fd = self._fd(path)
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
            del self._ids[path]
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

    def free(self, directory: str) -> tuple[int, int]:
        """Bytes free for this process on ``directory``'s file system, and its block size."""
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize, st.f_frsize

    def overwrite(self, path: str, pos: int, data: bytes) -> None:
        """Write ``data`` over the bytes of ``path`` at ``pos`` and fsync it (recovery's
        repair of a segment header, in place)."""
        self.forget(path)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, pos)
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, path: str, size: int) -> None:
        """Cut ``path`` to ``size`` bytes: through its append descriptor if it has one (the
        file may be gone from its directory, and written back from that descriptor later)."""
        fd = self._fds.get(path)
        if fd is not None:
            os.ftruncate(fd, size)
        else:
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

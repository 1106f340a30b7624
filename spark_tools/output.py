"""The export's output directory, through Hadoop's FileSystem (a local path or any URL
Spark writes to): how a table's partitions are replaced so that a reader, or the export
after one that was killed, finds the old or the new partition of each device, never none
and never both.

- Each table is written whole into a hidden directory of its own (``.new-*``: Spark's
  reader, pyarrow's and pandas' skip names starting with a dot), with no overwrite and so
  none of Spark's partition renames. Only once that write has committed are its partitions
  swapped in, one at a time: the old one is moved aside (``.replaced-*``), the new one
  renamed into its place. A device's aggregates are replaced whole: an exported device the
  new table has no rows for any more (damage gone, groups deleted) loses its old partition
  too. Records replace only the (date, device) partitions the new export has.
- When every partition is in place, a ``_written`` file in ``.replaced-*`` says so and the
  old partitions are deleted, the file last.
- A killed export is settled when the next one into that directory starts (``clean``):
  without ``_written``, a set-aside partition whose place is empty is renamed back, one
  whose place holds the new partition (only a swap puts one there, by a rename: whole) is
  deleted; with it, every set-aside partition is deleted. ``.new-*`` and Spark's
  ``.spark-staging-*`` are deleted. One export at a time into one directory.

Renames are atomic on a local filesystem and HDFS; on an object store (``s3a://``) a
rename is a copy, and these guarantees hold only as far as its renames go.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pyspark.sql import SparkSession

ASIDE, NEW, STAGING = ".replaced-", ".new-", ".spark-staging-"
WRITTEN = "_written"  # in a .replaced-* directory: every new partition is in place


@dataclass(frozen=True, slots=True)
class Cleaned:
    restored: tuple[str, ...]  # set-aside partitions put back (their replacement never came)
    removed: tuple[str, ...]  # leftovers deleted


class Output:
    def __init__(self, spark: SparkSession, root: str) -> None:
        jvm = spark.sparkContext._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self.root = self._path(root)
        self.fs = self.root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self.token = uuid.uuid4().hex[:12]
        # a partition value as Spark names its directory (``device=a%2Fb``)
        self.escape = jvm.org.apache.spark.sql.catalyst.catalog.ExternalCatalogUtils.escapePathName

    def _join(self, base: object, *parts: str) -> object:
        for part in parts:
            base = self._path(base, part)
        return base

    def replace(self, table: str, depth: int, write: Callable[[str], None],
                devices: Iterable[str] = ()) -> None:
        """``write(path)`` the new ``table`` (``depth`` partition levels), then swap its
        partitions in; also drop the old partitions of ``devices`` it has none for."""
        where = self._join(self.root, table)
        new = self._join(where, NEW + self.token)
        aside = self._join(where, ASIDE + self.token)
        try:
            write(new.toString())
        except BaseException:
            self.fs.delete(new, True)  # nothing was moved yet: the old table stands
            raise
        parts = set(self._parts(new, depth))
        parts |= {(f"device={self.escape(d)}",) for d in devices}
        try:
            for part in sorted(parts):
                place = self._join(where, *part)
                if self.fs.exists(place):
                    self._move(place, self._join(aside, *part))
                fresh = self._join(new, *part)
                if self.fs.exists(fresh):
                    self._move(fresh, place)
        except BaseException:
            self._settle(where, aside, depth, written=False)
            self.fs.delete(new, True)
            raise
        if self.fs.exists(aside):
            self.fs.createNewFile(self._join(aside, WRITTEN))
        self._settle(where, aside, depth, written=True)
        self.fs.delete(new, True)  # what is left: Spark's _SUCCESS

    def clean(self) -> Cleaned:
        """Settle what a killed export left in the output (above)."""
        restored: list[str] = []
        removed: list[str] = []
        aggregates = self._join(self.root, "aggregates")
        tables = [(self._join(self.root, "records"), 2)]
        if self.fs.exists(aggregates):
            tables += [(s.getPath(), 1) for s in self.fs.listStatus(aggregates)
                       if s.isDirectory()]
        for where, depth in tables:
            if not self.fs.exists(where):
                continue
            for status in self.fs.listStatus(where):
                if status.getPath().getName().startswith(ASIDE):
                    back, gone = self._settle(where, status.getPath(), depth)
                    restored += back
                    removed += gone
        for where in (self.root, aggregates, *(w for w, _ in tables)):
            if not self.fs.exists(where):
                continue
            for status in self.fs.listStatus(where):
                if status.getPath().getName().startswith((NEW, STAGING, ASIDE)):
                    self.fs.delete(status.getPath(), True)
                    removed.append(status.getPath().toString())
        return Cleaned(tuple(restored), tuple(removed))

    def _settle(self, where: object, aside: object, depth: int,
                written: bool | None = None) -> tuple[list[str], list[str]]:
        """Put back each partition of ``aside`` whose place is empty, unless the swap got
        to its end (``written``: asked, or the file); delete the others, the file last."""
        if not self.fs.exists(aside):
            return [], []
        if written is None:
            written = self.fs.exists(self._join(aside, WRITTEN))
        restored, removed = [], []
        for part in self._parts(aside, depth):
            old, place = self._join(aside, *part), self._join(where, *part)
            if not written and not self.fs.exists(place):
                self._move(old, place)
                restored.append(place.toString())
            else:
                self.fs.delete(old, True)
                removed.append(old.toString())
        self.fs.delete(aside, True)
        return restored, removed

    def _parts(self, under: object, depth: int) -> list[tuple[str, ...]]:
        """The partition directories ``depth`` levels of ``name=value`` below ``under``."""
        if depth == 0:
            return [()]
        if not self.fs.exists(under):
            return []
        found = []
        for status in self.fs.listStatus(under):
            name = status.getPath().getName()
            if status.isDirectory() and "=" in name and not name.startswith((".", "_")):
                found += [(name, *rest) for rest in self._parts(status.getPath(), depth - 1)]
        return found

    def _move(self, src: object, dst: object) -> None:
        self.fs.mkdirs(dst.getParent())
        if not self.fs.rename(src, dst):
            raise OSError(f"could not move {src.toString()} to {dst.toString()}")

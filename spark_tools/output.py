"""The export's output directory, through Hadoop's FileSystem (a local path or any URL
Spark writes to): what dynamic partition overwrite does not do by itself.

- A device's aggregates are replaced whole: dynamic overwrite replaces only the partitions
  the new frame has rows for, so a device whose damage (groups, dead letters...) is gone
  would keep its old rows. Before an aggregate is written, the exported devices' old
  partitions are moved aside (``.replaced-*``, hidden from readers), and dropped once it is.
- Spark's ``.spark-staging-*`` directories (and our ``.replaced-*``) left by an export that
  was killed are removed when the next export into that directory starts. One export at a
  time into one directory.
"""

from __future__ import annotations

import uuid

from pyspark.sql import SparkSession

LEFTOVERS = (".spark-staging-", ".replaced-")


class Output:
    def __init__(self, spark: SparkSession, root: str) -> None:
        jvm = spark.sparkContext._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        self.root = self._path(root)
        self.fs = self.root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
        self.token = uuid.uuid4().hex[:12]
        # a partition value as Spark names its directory (``device=a%2Fb``)
        self.escape = jvm.org.apache.spark.sql.catalyst.catalog.ExternalCatalogUtils.escapePathName

    def _join(self, *parts: str) -> object:
        path = self.root
        for part in parts:
            path = self._path(path, part)
        return path

    def clean(self) -> list[str]:
        """Remove what a killed export left in the output: returns the paths removed."""
        removed: list[str] = []
        for parent in (self.root, self._join("records"), self._join("aggregates"),
                       *self._children("aggregates")):
            if not self.fs.exists(parent):
                continue
            for status in self.fs.listStatus(parent):
                name = status.getPath().getName()
                if name.startswith(LEFTOVERS):
                    self.fs.delete(status.getPath(), True)
                    removed.append(str(status.getPath()))
        return removed

    def _children(self, name: str) -> list[object]:
        where = self._join(name)
        if not self.fs.exists(where):
            return []
        return [s.getPath() for s in self.fs.listStatus(where) if s.isDirectory()]

    def set_aside(self, table: str, devices: list[str]) -> list[tuple[object, object]]:
        """Move the partitions of ``devices`` under ``table`` aside: returns (moved, where
        it was) pairs, for ``drop`` or ``restore``."""
        moved = []
        for device in devices:
            part = f"device={self.escape(device)}"
            where = self._join(table, part)
            if self.fs.exists(where):
                aside = self._join(table, f".replaced-{self.token}", part)
                self.fs.mkdirs(aside.getParent())
                if self.fs.rename(where, aside):
                    moved.append((aside, where))
        return moved

    def drop(self, table: str) -> None:
        aside = self._join(table, f".replaced-{self.token}")
        if self.fs.exists(aside):
            self.fs.delete(aside, True)

    def restore(self, table: str, moved: list[tuple[object, object]]) -> None:
        """The write failed: put back what it did not replace."""
        for aside, where in moved:
            if not self.fs.exists(where):
                self.fs.rename(aside, where)
        self.drop(table)


"""The ``blipmq-wal`` PySpark data source: dumps and data directories as a DataFrame.

``spark.read.format("blipmq-wal").load(path)``, or in SQL
``CREATE TEMPORARY VIEW w USING `blipmq-wal` OPTIONS (path '...')``. ``path`` (or ``paths``,
comma-separated) is a dump, a directory of dumps, a data directory or a segment file. One
input partition per segment, or per group of small segments of about ``partitionBytes``
(default 64 MiB). Each task reads its files, checks them with the log's code and yields
Arrow record batches (``batches.py``). A device is named by its dump's manifest, else by the
directory holding the log.

Paths a plain Python reader cannot open (``hdfs://``, ``s3a://``, ...) go through Spark's
``binaryFile`` source and ``mapInArrow`` with the same decoder (``read_wal`` picks).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from blipmq_server.errors import WalError
from blipmq_server.wal import reader
from spark_tools.batches import SCHEMA, segment_batches

NAME = "blipmq-wal"
PARTITION_BYTES = 64 * 1024 * 1024

DDL = ("device string, segment string, position bigint, offset bigint, timestamp timestamp, "
       "kind string, topic string, qos tinyint, ttl_ms bigint, key binary, payload binary, "
       "payload_size bigint, dead_deliveries int, dead_reason string, group_name string, "
       "group_op string, group_id bigint, group_start bigint, ack_floor bigint, "
       "acked array<bigint>, problem string")


@dataclass(frozen=True, slots=True)
class Piece:
    """One segment file to read: whose it is, and whether it may still be growing."""

    device: str
    path: str
    open_tail: bool


class Files(InputPartition):
    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(pieces)
        self.pieces = pieces


def device_of(log: reader.LogFiles) -> str:
    if log.dump:
        try:
            with open(os.path.join(log.root, reader.MANIFEST), encoding="utf-8") as f:
                return str(json.load(f)["device_id"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    root = os.path.abspath(log.root)
    if os.path.isfile(root):  # a lone segment: name it after its directory's owner
        root = os.path.dirname(root)
        if os.path.basename(root) == reader.WAL_DIR:
            root = os.path.dirname(root)
    return os.path.basename(root.rstrip("/")) or "unknown"


def plan(paths: list[str], partition_bytes: int = PARTITION_BYTES) -> list[list[Piece]]:
    """Segments grouped into partitions of about ``partition_bytes`` (never split)."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for path in paths:
        for log in reader.find_logs(path):
            device = device_of(log)
            for i, seg in enumerate(log.segments):
                seg_size = os.path.getsize(seg) if os.path.exists(seg) else 0
                if current and size + seg_size > partition_bytes:
                    groups.append(current)
                    current, size = [], 0
                current.append(Piece(device, seg, i == len(log.segments) - 1))
                size += seg_size
    if current:
        groups.append(current)
    return groups


def read_pieces(pieces: list[Piece]) -> Iterator[pa.RecordBatch]:
    for piece in pieces:
        try:
            with open(piece.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        name = os.path.basename(piece.path)
        checked = reader.check(data, name, open_tail=piece.open_tail)
        yield from segment_batches(data, checked, piece.device, name)


class WalReader(DataSourceReader):
    def __init__(self, paths: list[str], partition_bytes: int) -> None:
        self.paths = paths
        self.partition_bytes = partition_bytes

    def partitions(self) -> list[InputPartition]:
        return [Files(group) for group in plan(self.paths, self.partition_bytes)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_pieces(partition.value)


class WalSource(DataSource):
    """``format("blipmq-wal")``: options ``path`` or ``paths`` (comma-separated), and
    ``partitionBytes``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return DDL

    def reader(self, schema: object) -> DataSourceReader:
        opts = self.options
        raw = opts.get("paths") or opts.get("path") or ""
        paths = [p for p in raw.split(",") if p]
        if not paths:
            raise WalError("blipmq-wal: give a path (load(path) or option path)")
        size = int(opts.get("partitionBytes", PARTITION_BYTES))
        return WalReader([local(p) for p in paths], size)


def local(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def read_wal(spark: SparkSession, paths: list[str], partition_bytes: int = PARTITION_BYTES,
             via: str = "auto") -> DataFrame:
    """The records of every log under ``paths``. Local paths: ``via="tasks"`` (the default)
    plans the partitions here and decodes them with ``mapInArrow``, ``via="source"`` goes
    through the data source (the same plan and reader; Spark's Python processes that look up,
    create and plan a Python data source cost about 4 CPU-seconds more, docs/PERFORMANCE.md).
    Other paths, or ``via="binaryFile"``: ``binaryFile`` + ``mapInArrow``."""
    if via == "auto":
        via = "tasks" if all(is_local(p) for p in paths) else "binaryFile"
    if via == "source":
        return (spark.read.format(NAME).option("paths", ",".join(paths))
                .option("partitionBytes", str(partition_bytes)).load())
    if via == "tasks":
        groups = plan([local(p) for p in paths], partition_bytes)
        if not groups:
            return spark.createDataFrame([], DDL)
        ids = spark.range(len(groups), numPartitions=len(groups))
        return ids.mapInArrow(_Tasks(groups), DDL)
    files = (spark.read.format("binaryFile").option("pathGlobFilter", "*.seg")
             .option("recursiveFileLookup", "true").load(paths).select("path", "content"))
    return files.mapInArrow(_decode_files, DDL)


class _Tasks:
    """``mapInArrow`` over partition numbers: each reads its group of the plan."""

    def __init__(self, groups: list[list[Piece]]) -> None:
        self.groups = groups

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for i in batch.column(0).to_pylist():
                yield from read_pieces(self.groups[i])


def _decode_files(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` over (path, content) rows of ``binaryFile``: the same decoder. The
    device is the directory holding the segment's ``wal/`` directory."""
    for batch in batches:
        for path, content in zip(batch.column("path").to_pylist(),
                                 batch.column("content").to_pylist(), strict=True):
            parts = path.rstrip("/").split("/")
            name = parts[-1]
            owner = parts[-3] if len(parts) >= 3 and parts[-2] == reader.WAL_DIR else parts[-2]
            checked = reader.check(content, name, open_tail=True)
            for out in segment_batches(content, checked, owner, name):
                yield out.cast(SCHEMA) if out.schema != SCHEMA else out

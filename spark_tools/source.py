"""The ``blipmq-wal`` PySpark data source: dumps and data directories as a DataFrame.

``spark.read.format("blipmq-wal").load(path)``, or in SQL
``CREATE TEMPORARY VIEW w USING `blipmq-wal` OPTIONS (path '...')``. ``path`` (one path), or
``paths`` (``load([a, b])``'s JSON array, or comma-separated) is a dump, a directory of
dumps, a data directory or a segment file. One input partition per segment, or per group
of small segments of about ``partitionBytes`` (default 64 MiB), each read up to its size
when planned. Each task reads its files, checks them with the log's code and yields Arrow
record batches (``batches.py``). A device is named by its dump's manifest, else by the
directory holding the log (``devices.py``: one log per device, each log once).

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
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from blipmq_server.errors import WalError
from blipmq_server.wal import reader
from blipmq_server.wal.segment import offset_named
from spark_tools import devices
from spark_tools.batches import SCHEMA, damage_batch, segment_batches

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
    crc: int | None = None  # a dump segment's CRC-32C in its manifest (checked when read)
    notes: tuple[reader.Missing, ...] = ()  # damage known without reading (a lost segment)
    skip: bool = False  # nothing to read: a missing segment, a file that is not a segment
    # bytes to read, pinned when planned: every read of one plan (the export decodes twice)
    # sees the same bytes of a log that is still being written. None: the whole file.
    size: int | None = None


class Files(InputPartition):
    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(pieces)
        self.pieces = pieces


def dump_damage(log: reader.LogFiles) -> list[reader.Missing]:
    """The damage ``blipmq wal dump`` met on the device and did not copy, as its manifest
    counts it: one note per segment (``damaged_bytes``), and the rest of the dump's total
    if the segments' add up to less."""
    if not log.dump:
        return []
    manifest, _ = reader.load_manifest(log.root)
    return manifest_damage(manifest) if manifest is not None else []


def manifest_damage(manifest: dict) -> list[reader.Missing]:
    out: list[reader.Missing] = []
    listed = 0
    for entry in manifest.get("segments", []):
        try:
            name, n = str(entry["name"]), int(entry.get("damaged_bytes") or 0)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if n > 0:
            listed += n
            out.append(reader.Missing(name, n, DUMPED_DAMAGE.format(n=n)))
    try:
        rest = int(manifest.get("damaged_bytes") or 0) - listed
    except (TypeError, ValueError):
        rest = 0
    if rest > 0:
        out.append(reader.Missing(reader.MANIFEST, rest, DUMPED_DAMAGE.format(n=rest)))
    return out


DUMPED_DAMAGE = ("damaged on the device: {n:,} bytes not copied by blipmq wal dump "
                 "(counted in the dump's manifest)")


def plan(paths: list[str], partition_bytes: int = PARTITION_BYTES) -> list[list[Piece]]:
    """Segments grouped into partitions of about ``partition_bytes`` (never split), each
    with its size now: reads stop there. Refuses (WalError) a log given twice and two logs
    of one device (``devices.logs``)."""
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for device, log in devices.logs(paths):
        problems, crcs = reader.log_problems(log)
        problems += dump_damage(log)
        where = os.path.dirname(log.segments[0]) if log.segments else log.root
        if problems:  # rows of their own, read with the first partition
            current.append(Piece(device, os.path.join(where, "-"), False,
                                 notes=tuple(problems), skip=True))
        for i, seg in enumerate(log.segments):
            try:
                seg_size = os.path.getsize(seg)
            except OSError:  # gone meanwhile (retention): reading it says nothing
                seg_size = 0
            if current and size + seg_size > partition_bytes:
                groups.append(current)
                current, size = [], 0
            name = os.path.basename(seg)
            current.append(Piece(device, seg, not log.dump and i == len(log.segments) - 1,
                                 crc=(crcs or {}).get(name), size=seg_size))
            size += seg_size
    if current:
        groups.append(current)
    return groups


def read_pieces(pieces: list[Piece]) -> Iterator[pa.RecordBatch]:
    for piece in pieces:
        for note in piece.notes:
            yield damage_batch((reader.Damage(0, note.bytes, note.problem),), piece.device,
                               note.segment)
        if piece.skip:
            continue
        name = os.path.basename(piece.path)
        if not reader.regular(piece.path):
            yield damage_batch((reader.Damage(0, 0, reader.ODD),), piece.device, name)
            continue
        try:
            with open(piece.path, "rb") as f:
                data = f.read() if piece.size is None else f.read(piece.size)
        except FileNotFoundError:
            continue
        checked = reader.check(data, name, open_tail=piece.open_tail)
        if not checked.damage and (bad := reader.crc_problem(data, piece.crc)) is not None:
            yield damage_batch((reader.Damage(0, 0, bad),), piece.device, name)
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
    """``format("blipmq-wal")``: options ``path`` (one path) or ``paths`` (a JSON array, as
    ``load([a, b])`` gives it, or comma-separated), and ``partitionBytes``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> str:
        return DDL

    def reader(self, schema: object) -> DataSourceReader:
        opts = self.options
        paths = option_paths(opts.get("path"), opts.get("paths"))
        if not paths:
            raise WalError("blipmq-wal: give a path (load(path) or option path)")
        size = int(opts.get("partitionBytes", PARTITION_BYTES))
        return WalReader([local(p) for p in paths], size)


def option_paths(path: str | None, paths: str | None) -> list[str]:
    """The paths of the options: ``path`` is one path (commas and all); ``paths`` is what
    ``load([a, b])`` passes (a JSON array), else a comma-separated list."""
    out = [path] if path else []
    if paths:
        try:
            listed = json.loads(paths)
        except ValueError:
            listed = None
        if isinstance(listed, list) and all(isinstance(p, str) for p in listed):
            out += listed
        else:
            out += [p for p in paths.split(",") if p]
    return out


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
        return (spark.read.format(NAME).option("paths", json.dumps(paths))
                .option("partitionBytes", str(partition_bytes)).load())
    if via == "tasks":
        groups = plan([local(p) for p in paths], partition_bytes)
        if not groups:
            return spark.createDataFrame([], DDL)
        ids = spark.range(len(groups), numPartitions=len(groups))
        return ids.mapInArrow(_Tasks(groups), DDL)
    files = (spark.read.format("binaryFile").option("pathGlobFilter", "*.seg")
             .option("recursiveFileLookup", "true").load(paths))
    listing = [(r["path"], r["length"]) for r in files.select("path", "length").collect()]
    _distinct(listing)
    # files not named after an offset are not of the log (reader.STRAY): reported, not read
    strays = [p for p, _ in listing if not offset_named(p.rstrip("/").split("/")[-1])]
    listing = [(p, n) for p, n in listing if p not in strays]
    notes, crcs, sealed = _audit_remote(spark, paths, listing)
    notes += [(_owner(p)[1], p.rstrip("/").split("/")[-1], 0, reader.STRAY) for p in strays]
    if strays:
        files = files.where(~F.col("path").isin(strays))
    decoded = files.select("path", "content").mapInArrow(
        _DecodeFiles(crcs, sealed, dict(listing)), DDL)
    if not notes:
        return decoded
    return decoded.unionByName(spark.range(1, numPartitions=1).mapInArrow(_Notes(notes), DDL))


def _owner(path: str) -> tuple[str, str]:
    """(the directory holding a segment's ``wal/`` directory, or its own; the device)."""
    parts = path.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-2] == reader.WAL_DIR:
        return "/".join(parts[:-2]), parts[-3]
    return "/".join(parts[:-1]), parts[-2] if len(parts) >= 2 else "unknown"


def _distinct(listing: list[tuple[str, int]]) -> None:
    """Refuses a segment listed twice (one log given twice) and two logs of one device."""
    seen: set[str] = set()
    roots: dict[str, str] = {}
    for path, _ in listing:
        if path in seen:
            raise WalError(f"{path}: listed twice (one log given twice); give each log once")
        seen.add(path)
        root, device = _owner(path)
        if roots.setdefault(device, root) != root:
            raise WalError(f"{root} and {roots[device]}: two logs of device {device!r}; "
                           "export each device once")


def _audit_remote(spark: SparkSession, paths: list[str], listing: list[tuple[str, int]]
                  ) -> tuple[list[tuple[str, str, int, str]], dict[str, int], set[str]]:
    """The dumps' manifests (read through ``binaryFile`` too) against the segment files
    listed: what is missing or cut short becomes damage rows, what matches gets its CRC
    checked when read. Dump segments are sealed: a cut-off last record is damage."""
    try:
        found = (spark.read.format("binaryFile").option("pathGlobFilter", reader.MANIFEST)
                 .option("recursiveFileLookup", "true").load(paths)
                 .select("path", "content").collect())
    except Exception as exc:  # no manifest anywhere: no dump to audit
        if "PATH_NOT_FOUND" not in str(exc) and "UNABLE_TO_INFER_SCHEMA" not in str(exc):
            raise
        found = []
    sizes: dict[str, dict[str, int]] = {}
    for path, length in listing:
        root, _ = _owner(path)
        sizes.setdefault(root, {})[path.rstrip("/").split("/")[-1]] = length
    notes: list[tuple[str, str, int, str]] = []
    crcs: dict[str, int] = {}
    sealed: set[str] = set()
    for row in found:
        root = row["path"].rstrip("/").rsplit("/", 1)[0]
        device = root.rstrip("/").rsplit("/", 1)[-1]
        manifest, problem = reader.parse_manifest(bytes(row["content"]))
        if problem is not None:
            notes.append((device, reader.MANIFEST, 0, problem))
        if manifest is None:
            continue
        sealed.add(root)
        missing, expected = reader.audit(manifest, sizes.get(root, {}))
        missing += manifest_damage(manifest)
        notes += [(device, m.segment, m.bytes, m.problem) for m in missing]
        crcs |= {f"{root}/{reader.WAL_DIR}/{name}": crc for name, crc in expected.items()}
    return notes, crcs, sealed


class _Notes:
    """``mapInArrow`` over one row: the damage found without reading a segment."""

    def __init__(self, notes: list[tuple[str, str, int, str]]) -> None:
        self.notes = notes

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in batches:
            for device, segment, size, problem in self.notes:
                yield damage_batch((reader.Damage(0, size, problem),), device, segment)


class _Tasks:
    """``mapInArrow`` over partition numbers: each reads its group of the plan."""

    def __init__(self, groups: list[list[Piece]]) -> None:
        self.groups = groups

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for i in batch.column(0).to_pylist():
                yield from read_pieces(self.groups[i])


class _DecodeFiles:
    """``mapInArrow`` over (path, content) rows of ``binaryFile``: the same decoder. The
    device is the directory holding the segment's ``wal/`` directory. A dump's segment
    (its root in ``sealed``) is sealed and checked against its manifest's CRC. A file is
    read up to its size when listed (``sizes``): one snapshot of a log still written."""

    def __init__(self, crcs: dict[str, int], sealed: set[str], sizes: dict[str, int]) -> None:
        self.crcs = crcs
        self.sealed = sealed
        self.sizes = sizes

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for path, content in zip(batch.column("path").to_pylist(),
                                     batch.column("content").to_pylist(), strict=True):
                name = path.rstrip("/").split("/")[-1]
                root, owner = _owner(path)
                if (size := self.sizes.get(path)) is not None and len(content) > size:
                    content = content[:size]
                checked = reader.check(content, name, open_tail=root not in self.sealed)
                outs = list(segment_batches(content, checked, owner, name))
                if not checked.damage and (
                        bad := reader.crc_problem(content, self.crcs.get(path))) is not None:
                    outs.append(damage_batch((reader.Damage(0, 0, bad),), owner, name))
                for out in outs:
                    yield out.cast(SCHEMA) if out.schema != SCHEMA else out

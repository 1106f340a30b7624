"""What ``blipmq export`` runs: a session, the source, the aggregates, the output.

Output under ``--output``::

    records/date=YYYY-MM-DD/device=ID/*.parquet    every message, GROUP and ACK record
    aggregates/<name>/device=ID/*.parquet         traffic, rates, devices, sizes, groups,
                                                  dead_letters, damage (analytics.ALL)

Each table is written whole into a hidden directory, then swapped in partition by
partition (``output.py``): re-exporting one device replaces its partitions and leaves the
other devices' alone; a device's aggregates are replaced whole, also where it has no row
any more; an export killed half way is settled by the next one. The summary and the report
are made from the aggregates read back from ``--output`` (so they show the whole fleet
exported there), partition values as text.

The master: ``--master`` if given; under ``spark-submit`` the submitter's; else local
Spark on every core. Spark's own log goes to a file (named on failure), not the terminal.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_tools import analytics
from spark_tools.output import Output
from spark_tools.source import read_wal

LOG4J = """\
rootLogger.level = {level}
rootLogger.appenderRef.file.ref = file
appender.file.type = File
appender.file.name = file
appender.file.fileName = {path}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{HH:mm:ss.SSS}} %p %c{{1}}: %m%n
"""


@dataclass(frozen=True, slots=True)
class ExportOptions:
    inputs: tuple[str, ...]
    output: str
    master: str | None = None
    conf: tuple[tuple[str, str], ...] = ()
    report: str | None = None
    via: str = "auto"  # the reader: auto | tasks | source | binaryFile
    partition_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Exported:
    rows: int  # records written (messages, group and ack records)
    damaged_parts: int
    damaged_bytes: int
    devices: int
    aggregates: dict[str, list[dict]]  # name -> rows, read back from the output (whole fleet)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> wall seconds


def spark_log() -> str:
    """A log4j2 configuration sending Spark's log to a file; returns the file's path."""
    where = tempfile.mkdtemp(prefix="blipmq-export-")
    path = os.path.join(where, "spark.log")
    conf = os.path.join(where, "log4j2.properties")
    with open(conf, "w", encoding="utf-8") as f:
        f.write(LOG4J.format(level=os.environ.get("BLIPMQ_SPARK_LOG_LEVEL", "warn"), path=path))
    return conf


def session(master: str | None, conf: tuple[tuple[str, str], ...], log_conf: str
            ) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run our Python
    builder = SparkSession.builder.appName("blipmq-export")
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # under spark-submit: its master
    if master or not submitted:
        builder = builder.master(master or "local[*]")
    java_opts = f"-Dlog4j2.configurationFile=file:{log_conf}"
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.enabled": "false",
        "spark.driver.extraJavaOptions": java_opts,
        "spark.executor.extraJavaOptions": java_opts,
        "spark.sql.parquet.compression.codec": "zstd",
        # timestamps as Parquet's INT64 microseconds marked UTC, which every reader knows
        # (INT96, Spark's default, reads back naive, and far dates wrong, outside Spark)
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        "spark.sql.shuffle.partitions": str(max(4, 2 * (os.cpu_count() or 1))),
    }
    if (master or "local").startswith("local"):
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        settings["spark.driver.host"] = "127.0.0.1"
    for key, value in {**settings, **dict(conf)}.items():
        builder = builder.config(key, value)
    for name in ("py4j", "pyspark", "SQLQueryContextLogger"):  # errors reach us as exceptions
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    log_file = os.path.join(os.path.dirname(log_conf), "spark.log")
    with _stderr_to(log_file):  # what the JVM prints itself (not through log4j) goes there
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` while the JVM starts (it inherits it), then back."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def export(spark: SparkSession, opts: ExportOptions) -> Exported:
    """Two decodes of the inputs: one kept in Spark's cache without keys and payloads (the
    kind counts and the aggregates read nothing else), one written as the records. Caching
    the payloads cost more than decoding twice (docs/PERFORMANCE.md, the phases)."""
    timings: dict[str, float] = {}
    clock = _Clock(timings)
    out = Output(spark, opts.output)
    out.clean()  # what a killed export left there
    source = read_wal(spark, list(opts.inputs), opts.partition_bytes, opts.via)
    records = source.drop("key", "payload").cache()
    try:
        counts: dict[str, tuple[int, int]] = {}
        exported: set[str] = set()
        for r in records.groupBy("kind", "device").agg(
                F.count("*").alias("n"), F.sum("payload_size").alias("b")).collect():
            n, b = counts.get(r["kind"], (0, 0))
            counts[r["kind"]] = (n + r["n"], b + (r["b"] or 0))
            exported.add(r["device"])
        clock.lap("decode and cache")
        if not sum(n for kind, (n, _) in counts.items() if kind != "damage"):
            from blipmq_server.errors import WalError  # damage only is no record either
            parts, damaged = counts.get("damage", (0, 0))
            raise WalError(f"{', '.join(opts.inputs)}: the logs hold no records"
                           + (f" (damage only: {parts} part(s), {damaged or 0:,} bytes)"
                              if parts else ""))
        rows = sum(n for kind, (n, _) in counts.items() if kind != "damage")
        out.replace("records", 2, lambda path: write_records(source, path))
        clock.lap("records")
        for name, fn in analytics.ALL.items():
            def write(path: str, name: str = name, fn: Callable = fn) -> None:
                if name != "groups" or "group" in counts:  # no GROUP record, no group (and
                    fn(records).write.partitionBy("device").parquet(path)  # its joins cost)
            # a device's aggregate is replaced whole, also where it has no row any more
            out.replace(os.path.join("aggregates", name), 1, write, sorted(exported))
            clock.lap(name)
    finally:
        records.unpersist()
    aggregates = read_back(spark, opts.output)
    clock.lap("read back")
    parts, damaged = counts.get("damage", (0, 0))
    devices = len(aggregates["devices"])
    return Exported(rows, parts, damaged or 0, devices, aggregates, timings)


class _Clock:
    """Wall seconds per phase of an export, for bench/analytics.py."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into = into
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = now - self.last
        self.last = now


def write_records(records: DataFrame, path: str) -> None:
    """Parquet by date and device (topic stays a column: one directory per topic would
    make thousands of small files). No shuffle: a task holds whole segments, so it writes
    one file per date and device it holds (a repartition by date and device first would
    shuffle every record once more)."""
    (records.where(F.col("kind") != "damage").drop("problem")
     .withColumn("date", F.to_date("timestamp"))
     .write.partitionBy("date", "device").parquet(path))


INFERENCE = "spark.sql.sources.partitionColumnTypeInference.enabled"


def read_back(spark: SparkSession, output: str) -> dict[str, list[dict]]:
    """The aggregates under ``output``; timestamps as aware UTC datetimes (``collect`` would
    give naive ones in this process's local time zone). Partition values stay text: with
    type inference (Spark's default) ``device=007`` would read back as the number 7."""
    before = spark.conf.get(INFERENCE, None)
    spark.conf.set(INFERENCE, "false")
    try:
        return {name: _read(spark, os.path.join(output, "aggregates", name))
                for name in analytics.ALL}
    finally:
        if before is None:
            spark.conf.unset(INFERENCE)
        else:
            spark.conf.set(INFERENCE, before)


def _read(spark: SparkSession, path: str) -> list[dict]:
    try:
        df = spark.read.parquet(path)
    except Exception as exc:  # an aggregate with no rows has no files
        if "UNABLE_TO_INFER_SCHEMA" not in str(exc) and "PATH_NOT_FOUND" not in str(exc):
            raise
        return []
    stamps = [f.name for f in df.schema.fields if f.dataType.typeName() == "timestamp"]
    df = df.select(*[F.unix_micros(c).alias(c) if c in stamps else F.col(c)
                     for c in df.columns])
    return [{k: _utc(v) if k in stamps else v for k, v in r.asDict().items()}
            for r in df.collect()]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _utc(micros: int | None) -> datetime | None:
    return None if micros is None else _EPOCH + timedelta(microseconds=micros)


class _Progress:
    """Spark's task progress as a rich bar on stderr, polled from the status tracker."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Progress:
        if sys.stderr.isatty():
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)

    def _run(self) -> None:
        from rich.console import Console
        from rich.progress import Progress

        tracker = self.spark.sparkContext.statusTracker()
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("spark", total=None)
            while not self.stop.wait(0.2):
                done = total = 0
                for stage in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(stage)
                    if info is not None:
                        done += info.numCompletedTasks
                        total += info.numTasks
                bar.update(task, completed=done, total=total or None,
                           description=f"spark: {done}/{total} tasks")


def main(opts: ExportOptions, say: Callable[[str], None] | None = None) -> int:
    """Run the export as a command: one line and an exit code on any failure."""
    from blipmq_cli.commands import say as cli_say
    from blipmq_cli.exits import Exit
    from blipmq_server.errors import BlipError
    from spark_tools import summary

    say = say or cli_say
    log_conf = spark_log()
    where = os.path.dirname(log_conf)
    log_file = os.path.join(where, "spark.log")
    keep = True  # Spark's log stays where a failure names it; else it goes with the run
    try:
        spark = session(opts.master, opts.conf, log_conf)
    except Exception as exc:
        say(f"Spark did not start: {first_line(exc)} (Spark's log: {log_file})")
        return Exit.JOB_FAILED
    try:
        with _Progress(spark):
            done = export(spark, opts)
        summary.show(done, opts.output)
        if opts.report:
            from spark_tools import report

            try:
                report.write(opts.report, done)
            except OSError as exc:
                say(f"exported, but the report was not written: {opts.report}: "
                    f"{exc.strerror or exc}")
                keep = False
                return Exit.USAGE
            say(f"report written to {opts.report}")
        keep = False
        return Exit.OK
    except BlipError as exc:
        say(str(exc))
        keep = False
        return Exit.USAGE
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except Exception as exc:
        say(f"the Spark job failed: {first_line(exc)} (Spark's log: {log_file})")
        return Exit.JOB_FAILED
    finally:
        spark.stop()
        if not keep:
            shutil.rmtree(where, ignore_errors=True)


def first_line(exc: BaseException) -> str:
    """One line saying why: the root cause of a Java exception (a Py4JJavaError's first line
    is only "An error occurred while calling o99.parquet"), the last line of a Python
    worker's traceback, else the exception's first line."""
    text = _root_cause(exc) or str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:  # a Python worker's: the error is last
        return lines[-1][:300]
    return (lines[0] if lines else type(exc).__name__)[:300]


def _root_cause(exc: BaseException) -> str | None:
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    if java is None:
        return None
    try:
        root = java
        for _ in range(100):  # a cause chain may loop
            cause = root.getCause()
            if cause is None or cause.equals(root):
                break
            root = cause
        message = root.getMessage()
        name = root.getClass().getName()
    except Exception:  # the JVM is gone: what Python has will do
        return None
    return f"{message}" if message else name

"""``blipmq export``: WAL dumps -> Spark -> Parquet, aggregates, a summary and an HTML report.

This module checks what it can without Spark (the inputs hold logs, the spark extra and
Java are installed, a ``spark://`` master answers) so that each problem is one line with
what to do and a documented exit code; only then does it import ``spark_tools.job``, which
does the work. Exit codes: 2 bad input (missing, empty or foreign directory, a log given
twice, two logs of one device, an --output or --report that cannot be written, bad option),
3 the master is unreachable, 10 the spark extra or Java is missing, 11 the Spark job
failed (its first error line is printed; Spark's log is in a file named on stderr).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
from typing import Annotated

import typer

from blipmq_cli import commands
from blipmq_cli.exits import Exit
from blipmq_server.errors import BlipError
from blipmq_server.wal import reader

_EXTRA = ("pyspark", "pyarrow", "pandas")


class Refused(BlipError):
    """A problem found before Spark starts: the line to print and the exit code."""

    def __init__(self, message: str, code: Exit) -> None:
        super().__init__(message)
        self.code = code


def check_inputs(paths: list[str]) -> None:
    from spark_tools import devices  # stdlib and wal.reader only: no Spark yet

    for path in paths:
        try:
            reader.find_logs(path)
        except BlipError as exc:
            raise Refused(str(exc), Exit.USAGE) from None
    try:  # each log once, one log per device, device ids that can name a partition
        devices.logs(paths)
    except BlipError as exc:
        raise Refused(str(exc), Exit.USAGE) from None


def check_targets(output: str, report: str | None) -> None:
    from spark_tools import targets  # stdlib only: no Spark yet

    why = targets.output_problem(output) or (report and targets.report_problem(report))
    if why:
        raise Refused(why, Exit.USAGE)


def check_extra() -> None:
    missing = [m for m in _EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise Refused(f"the spark extra is not installed (no {', '.join(missing)}): "
                      "pip install 'blipmq[spark]'", Exit.MISSING)


def java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def check_java() -> None:
    if java() is None:
        raise Refused("Java is not installed (blipmq export runs Spark, which needs Java 17 "
                      "or later): apt-get install openjdk-17-jre-headless, or set JAVA_HOME",
                      Exit.MISSING)


def check_master(master: str | None) -> None:
    """A standalone master must answer before Spark is asked (it would retry for minutes)."""
    if not master or not master.startswith("spark://"):
        return
    for hostport in master[len("spark://"):].split(","):
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            raise Refused(f"--master {master}: expected spark://HOST:PORT", Exit.USAGE)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError as exc:
            problem = exc.strerror or str(exc)
    raise Refused(f"the Spark master {master} is unreachable ({problem}): start it, or leave "
                  "out --master to run Spark locally", Exit.UNREACHABLE)


def parse_conf(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise Refused(f"--conf {item!r}: expected KEY=VALUE", Exit.USAGE)
        out.append((key.strip(), value))
    return out


def run(dumps: list[str], output: str | None, master: str | None, conf: list[str],
        report: str | None, print_submit: bool) -> int:
    try:
        settings = parse_conf(conf)
        if not print_submit:
            check_extra()  # first: without Spark nothing else matters (the edge executable)
        if not output:
            raise Refused("--output DIR is required", Exit.USAGE)
        if print_submit:
            check_inputs(dumps)
            from spark_tools import submit

            sys.stdout.write(submit.line(dumps, output, settings, report) + "\n")
            return Exit.OK
        check_java()
        check_inputs(dumps)
        check_targets(output, report)
        check_master(master)
    except Refused as exc:
        commands.say(str(exc))
        return exc.code
    from spark_tools import job

    return job.main(job.ExportOptions(tuple(dumps), output, master, tuple(settings), report))


def command(
    dumps: Annotated[list[str], typer.Argument(
        help="Dumps (blipmq wal dump), directories of dumps (one per device), or data dirs")],
    output: Annotated[str | None, typer.Option(
        "--output", help="Output directory (Parquet tables) \\[required]")] = None,
    master: Annotated[str | None, typer.Option(
        "--master", help="Spark master URL \\[default: local Spark, or spark-submit's]")] = None,
    conf: Annotated[list[str] | None, typer.Option(
        "--conf", help="Spark setting KEY=VALUE (repeatable)")] = None,
    report: Annotated[str | None, typer.Option(
        "--report", help="Write a self-contained HTML report here")] = None,
    print_submit: Annotated[bool, typer.Option(
        "--print-submit", help="Print a spark-submit line for this export (YARN, Kubernetes)")
    ] = False,
) -> None:
    """Export WAL dumps with Spark: Parquet by date and device, fleet aggregates, a report."""
    raise typer.Exit(commands.guarded(
        lambda: run(dumps, output, master, conf or [], report, print_submit)))

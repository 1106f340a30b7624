"""`blipmq export` as a user runs it: refusals before Spark starts, the HTML report in a real
headless chromium, and the same job on a separate executor process (a standalone master and
worker started here on 127.0.0.1 and stopped by PID)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

import pytest
from conftest import BLIPMQ, kill_brokers, launch_broker
from fleet import CONFIG, drive

from blipmq_cli.exits import Exit

# One worker runs every Spark test (pytest-xdist, make test): they share one local Spark
# session and the module fixtures' broker runs, and three JVMs at once would only fight for the
# two cores.
pytestmark = pytest.mark.xdist_group("spark")


def export(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[bytes]:
    full = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", **env}
    return subprocess.run([BLIPMQ, "export", *args], capture_output=True, timeout=timeout,
                           env=full)


def export_on_terminal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    """``blipmq export`` with stderr on a pseudo-terminal (100x30) and stdout on a pipe;
    ``stderr`` holds what the terminal showed."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    shown = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every copy of the follower is closed
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen([BLIPMQ, "export", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=follower, env=env)
        os.close(follower)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        reader.join(30)
    finally:
        os.close(leader)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, bytes(shown))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("cli-fleet")
    started: list = []
    try:
        for device in ("east", "west"):
            b = launch_broker(where, started, CONFIG)
            drive(b, device, readings=25, orders=4, alerts=1)
            res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out",
                        str(where / "dumps" / device), "--device-id", device)
            assert res.returncode == 0, res.stderr
    finally:
        kill_brokers(started)
    return where / "dumps"


def _one_line(res: subprocess.CompletedProcess[bytes]) -> str:
    assert res.stderr.count(b"\n") == 1, res.stderr
    assert b"Traceback" not in res.stderr and b"at org." not in res.stderr
    return res.stderr.decode()


def test_refusals_are_one_line_with_their_code(dumps, tmp_path) -> None:
    res = export(str(tmp_path / "missing"), "--output", str(tmp_path / "o"))
    assert res.returncode == Exit.USAGE and "no such file" in _one_line(res)
    (tmp_path / "empty").mkdir()
    res = export(str(tmp_path / "empty"), "--output", str(tmp_path / "o"))
    assert res.returncode == Exit.USAGE and "holds no BlipMQ log" in _one_line(res)
    res = export(str(dumps), "--output", str(tmp_path / "o"), "--conf", "novalue")
    assert res.returncode == Exit.USAGE and "KEY=VALUE" in _one_line(res)
    bare = {"PATH": "/usr/bin/nonexistent", "JAVA_HOME": str(tmp_path / "no-java")}
    res = export(str(dumps), "--output", str(tmp_path / "o"), **bare)
    assert res.returncode == Exit.MISSING and "Java is not installed" in _one_line(res)
    from tests.upstream import free_port

    port = free_port()  # a port nobody listens on (of this worker's own)
    res = export(str(dumps), "--output", str(tmp_path / "o"), "--master",
                 f"spark://127.0.0.1:{port}")
    assert res.returncode == Exit.UNREACHABLE and "unreachable" in _one_line(res)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_report_renders_in_a_headless_browser(dumps, tmp_path) -> None:
    """Also: with stderr on a real terminal, Spark's progress is a bar there, without
    Spark's log lines (stdout, the summary, stays a pipe)."""
    report = tmp_path / "fleet.html"
    res = export_on_terminal(str(dumps), "--output", str(tmp_path / "out"), "--master",
                             "local[2]", "--report", str(report))
    assert res.returncode == 0, res.stderr
    assert re.search(rb"spark: \d+/[1-9]\d* tasks", res.stderr), res.stderr[-2000:]
    assert b"\x1b[" in res.stderr  # drawn with terminal control sequences
    shown = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", res.stderr)
    for noise in (b"Traceback", b"WARN", b"INFO", b"log4j", b"Setting default log level",
                  b"incubator", b"at org."):
        assert noise not in shown, shown[-2000:]
    text = res.stdout.decode()
    assert "exported" in text and "east" in text and "west" in text
    html = report.read_text()
    assert "<script" not in html and "http://" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert html.count("<svg") == 4 and "sensors/east/temp" in html
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1000,1400", f"file://{report}"],
        capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1000, 1400)
    assert len(png) > 30_000  # charts and tables, not a blank page (that is about 5 KB)


def _wait_for(pattern: str, path: Path, proc: subprocess.Popen, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text(errors="replace")) if path.exists() else None
        if found:
            return found.group(1)
        assert proc.poll() is None, path.read_text(errors="replace")
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {path}:\n{path.read_text(errors='replace')}")


def _spark_class() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")


@pytest.mark.slow
def test_same_job_on_separate_executors(dumps, plain_export, tmp_path) -> None:
    """A standalone master and worker (the executor in a JVM of its own, as on a real
    cluster, our packages shipped to it): the same devices table as in one local JVM
    (``plain_export``)."""
    local = plain_export[0]
    assert local.returncode == 0, local.stderr
    assert len(_devices_table(local.stdout)) == 2, local.stdout  # east and west

    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}
    master_log, worker_log = tmp_path / "master.log", tmp_path / "worker.log"
    procs: list[subprocess.Popen] = []
    try:
        with open(master_log, "wb") as log:
            master = subprocess.Popen(
                [_spark_class(), "org.apache.spark.deploy.master.Master", "--host",
                 "127.0.0.1", "--port", "0", "--webui-port", "0", "--properties-file",
                 str(_props(tmp_path))], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(master)
        port = _wait_for(r"Starting Spark master at spark://127\.0\.0\.1:(\d+)", master_log,
                         master)
        url = f"spark://127.0.0.1:{port}"
        with open(worker_log, "wb") as log:
            worker = subprocess.Popen(
                [_spark_class(), "org.apache.spark.deploy.worker.Worker", "--host",
                 "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", "1", "--memory",
                 "1g", url], stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(worker)
        _wait_for(r"(Successfully registered with master)", worker_log, worker)
        res = export(str(dumps), "--output", str(tmp_path / "sa"), "--master", url,
                     "--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=1")
        assert res.returncode == 0, res.stderr + master_log.read_bytes()[-2000:]
        assert _devices_table(res.stdout) == _devices_table(local.stdout)
        assert "app-" in master_log.read_text()  # the master did run our application
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()


def _props(tmp_path: Path) -> Path:
    props = tmp_path / "master.properties"
    props.write_text("spark.master.rest.enabled false\nspark.ui.enabled false\n")
    return props


def _devices_table(stdout: bytes) -> list[list[str]]:
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in stdout.decode().splitlines()]
    return [r for r in rows if len(r) == 6 and r[0] in ("east", "west")]


def test_print_submit_ships_the_packages(dumps, tmp_path) -> None:
    import shlex
    import zipfile

    res = subprocess.run([BLIPMQ, "export", str(dumps), "--output", str(tmp_path / "o"),
                          "--print-submit", "--conf", "spark.executor.memory=2g"],
                         capture_output=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    args = shlex.split(res.stdout.decode())
    assert args[:2] == ["spark-submit", "--master"] and "spark.executor.memory=2g" in args
    archive = args[args.index("--py-files") + 1]
    names = zipfile.ZipFile(archive).namelist()
    assert {"blipmq_server/wal/record.py", "spark_tools/source.py",
            "pyspark_blipmq_wal/__init__.py"} <= set(names)
    entry = next(a for a in args if a.endswith("entry.py"))
    assert os.path.isfile(entry) and args[args.index(entry) + 1] == str(dumps)


def test_refusals_of_inputs_and_targets_before_spark(dumps, tmp_path) -> None:
    """h30 #6, #11, #12: a log given twice, two logs of one device, an empty device id, an
    --output that is a file, a --report nowhere: one line, exit 2, before Spark starts (it
    said "the Spark job failed: An error occurred while calling o99.parquet" after the job,
    or exported everything twice)."""
    import json
    import shutil

    out = str(tmp_path / "o")
    res = export(str(dumps), str(dumps / "east"), "--output", out)
    assert res.returncode == Exit.USAGE and "given twice" in _one_line(res)
    twin = tmp_path / "twin"
    shutil.copytree(dumps / "west", twin)
    manifest = json.loads((twin / "manifest.json").read_text())
    res = export(str(dumps), str(twin), "--output", out)
    assert res.returncode == Exit.USAGE and "two logs of device 'west'" in _one_line(res)
    manifest["device_id"] = ""
    (twin / "manifest.json").write_text(json.dumps(manifest))
    res = export(str(twin), "--output", out)
    assert res.returncode == Exit.USAGE and "device_id is empty" in _one_line(res)
    (tmp_path / "afile").write_text("x")
    res = export(str(dumps), "--output", str(tmp_path / "afile"))
    assert res.returncode == Exit.USAGE and "not a directory" in _one_line(res)
    res = export(str(dumps), "--output", str(tmp_path / "afile" / "out"))
    assert res.returncode == Exit.USAGE and "cannot be created" in _one_line(res)
    res = export(str(dumps), "--output", out, "--report", str(tmp_path / "no" / "r.html"))
    assert res.returncode == Exit.USAGE and "--report" in _one_line(res)
    res = export(str(dumps), "--output", out, "--report", str(tmp_path))
    assert res.returncode == Exit.USAGE and "is a directory" in _one_line(res)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def plain_export(dumps, tmp_path_factory) -> tuple[subprocess.CompletedProcess[bytes], Path]:
    """One export of the fleet on local[2] with a report, TMPDIR a directory of its own and
    TZ far from UTC: the result and its directory (the tests below share it; an export
    takes 15-45 s of JVM here)."""
    where = tmp_path_factory.mktemp("plain-export")
    tmp = where / "tmp"
    tmp.mkdir()
    res = export(str(dumps), "--output", str(where / "out"), "--master", "local[2]",
                 "--report", str(where / "r.html"), TMPDIR=str(tmp), TZ="Asia/Tokyo")
    return res, where


@pytest.mark.slow
def test_an_export_leaves_no_temporary_directory_and_shows_utc(dumps, plain_export) -> None:
    """h30 #16: every export left /tmp/blipmq-export-*; #8: the summary's times were the
    local time of the machine, unlabelled."""
    import datetime as dt
    import json

    res, where = plain_export
    tmp, report = where / "tmp", where / "r.html"
    assert res.returncode == 0, res.stderr
    assert list(tmp.iterdir()) == []
    first = min(json.loads((dumps / d / "manifest.json").read_text())["first_ms"]
                for d in ("east", "west"))
    utc = dt.datetime.fromtimestamp(first / 1000, dt.UTC)
    assert "first seen (UTC)" in res.stdout.decode()
    assert utc.strftime("%Y-%m-%d %H:%M") in res.stdout.decode()
    assert utc.strftime("%Y-%m-%d %H:%M") + " UTC" in report.read_text()

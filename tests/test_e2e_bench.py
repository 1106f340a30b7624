"""`blipmq bench` end to end: the real CLI, real worker processes, a real broker (its own
temporary one with --start, or the fixture's with --addr). Small runs; the figures are
checked for consistency, never for speed."""

from __future__ import annotations

import json
import os
import socket
import subprocess

from tests.conftest import BLIPMQ

FIELDS = {
    "publishers", "subscribers", "topics", "messages", "size", "qos", "rate", "broker", "log",
    "fsync", "published", "confirmed", "expected_deliveries", "delivered", "duplicates", "lost",
    "seconds", "publish_seconds", "msg_per_s", "deliveries_per_s", "mb_per_s", "latency_us",
    "broker_cpu_s", "broker_cpu_us_per_delivery", "broker_peak_rss_mb",
}


def bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([BLIPMQ, "bench", *args], capture_output=True, timeout=120, env=env)


def report(done: subprocess.CompletedProcess[bytes]) -> dict:
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1, lines
    result = json.loads(lines[0])
    assert set(result) == FIELDS
    return result


def check_latency(result: dict) -> None:
    lat = result["latency_us"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert lat["max"] < result["seconds"] * 1e6 + 1  # nothing arrived before it was sent


def test_start_with_blipmq_addr_set_uses_its_own_broker() -> None:
    """BLIPMQ_ADDR is the default of --addr, not an --addr given: --start still works."""
    env = {**os.environ, "BLIPMQ_ADDR": "127.0.0.1:1"}  # nobody there: it must not be used
    result = report(bench("--start", "--json", "-n", "200", "-p", "1", "-s", "1", env=env))
    assert result["broker"] == "started" and result["lost"] == 0
    done = bench("--start", "--addr", "127.0.0.1:1", "-n", "200", env=env)
    assert done.returncode == 2 and b"not both" in done.stderr


def test_qos1_started_broker_every_message_confirmed_and_delivered_to_each() -> None:
    result = report(bench("--start", "--json", "-n", "2000", "-p", "2", "-s", "2", "--qos", "1",
                          "--size", "200", "--batch", "100"))
    assert result["broker"] == "started" and result["log"] is True
    assert result["fsync"] == "always"
    assert result["published"] == result["confirmed"] == 2000
    assert result["expected_deliveries"] == result["delivered"] == 2 * 2000
    assert result["lost"] == 0 and result["duplicates"] == 0
    assert result["msg_per_s"] > 0
    assert result["deliveries_per_s"] > 0
    assert abs(result["deliveries_per_s"] / result["msg_per_s"] - 2) < 0.01
    assert abs(result["mb_per_s"] - result["deliveries_per_s"] * 200 / 1e6) < 0.01
    check_latency(result)
    # /proc counts CPU in clock ticks (10 ms): so small a run may take less than one
    cpu = result["broker_cpu_s"]
    assert cpu is not None and cpu >= 0
    assert abs(cpu * os.sysconf("SC_CLK_TCK") - round(cpu * os.sysconf("SC_CLK_TCK"))) < 1e-6
    assert result["broker_cpu_us_per_delivery"] == round(cpu / 4000 * 1e6, 3)
    assert result["broker_peak_rss_mb"] > 5


def test_running_broker_topics_and_subscribers(start_broker) -> None:
    broker = start_broker()
    result = report(bench("--json", "-n", "2000", "-s", "3", "--topics", "7", "--size", "16",
                          env=broker.env))  # BLIPMQ_ADDR from the fixture
    assert result["broker"] == broker.addr
    assert result["published"] == 2000 and result["confirmed"] == 0
    assert result["delivered"] == result["expected_deliveries"] == 3 * 2000
    assert result["lost"] == 0
    check_latency(result)
    assert result["broker_cpu_s"] is None  # not our process: no /proc figures
    assert broker.metric("blipmq_messages_published_total") == 2000


def test_log_off_open_loop_rate_and_the_table() -> None:
    done = bench("--start", "--no-log", "-n", "400", "--rate", "2000")
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    assert "deliveries/s" in text and "400 / 400" in text and "p50" in text
    result = report(bench("--start", "--no-log", "--json", "-n", "400", "--rate", "2000"))
    assert result["log"] is False and result["lost"] == 0
    assert result["publish_seconds"] >= 0.19  # 400 messages at 2,000/s take 0.2 s
    # subscribers idle between messages (longer than their 0.1 s poll) keep waiting
    result = report(bench("--start", "--json", "-n", "4", "--rate", "8", "-s", "2"))
    assert result["delivered"] == 8 and result["lost"] == 0


def test_publishers_only_is_not_a_loss() -> None:
    result = report(bench("--start", "--json", "-n", "500", "-s", "0"))
    assert result["expected_deliveries"] == result["delivered"] == result["lost"] == 0
    assert result["published"] == 500
    assert result["latency_us"] == {"p50": None, "p95": None, "p99": None, "max": None}


def test_bad_input_is_one_line_and_its_exit_code() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    cases = [
        (("--addr", f"127.0.0.1:{port}", "-n", "10"), 3, b"cannot connect"),
        (("--log", "-n", "10"), 2, b"--start"),
        (("--start", "--size", "8"), 2, b"--size"),
        (("--start", "--addr", "127.0.0.1:1"), 2, b"not both"),
        (("--start", "--fsync", "sometimes"), 2, b"--fsync"),
        (("--start", "-p", "0"), 2, b"--publishers"),
        (("--start", "--fsync", "every_n:x", "-n", "10"), 2, b"did not start"),
    ]
    for args, code, text in cases:
        done = bench(*args)
        assert done.returncode == code, (args, done.stderr)
        assert done.stderr.count(b"\n") == 1 and text in done.stderr, (args, done.stderr)
        assert b"Traceback" not in done.stderr and done.stdout == b""


def test_the_started_broker_is_this_cli_s_not_the_working_directory_s(tmp_path) -> None:
    """Run from a directory holding other packages of the same names (a checkout of another
    version, say), --start used to run the broker from that directory's code."""
    for package in ("blipmq_cli", "blipmq_server"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(
            "raise SystemExit('the working directory\'s package was imported')\n")
    done = subprocess.run([BLIPMQ, "bench", "--start", "-n", "200", "--json"],
                          capture_output=True, timeout=120, cwd=tmp_path)
    assert report(done)["delivered"] == 200

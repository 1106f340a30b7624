"""End to end: the real `blipmq` CLI through real pipes against a real broker process."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BLIPMQ
from peer import Link, Peer, greet, silent_after_subscribe

from blipmq_cli.client import Client
from blipmq_cli.exits import Exit
from blipmq_server.config import default_text
from blipmq_server.protocol import codec
from blipmq_server.server.app import SAME_SIGNAL_S
from blipmq_server.wal.log import Log


def lines_of(out: bytes) -> list[str]:
    return out.decode().splitlines()


def test_text_lines_arrive_in_order_through_pipes(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "logs", "--count", "2000", "--format", "lines")
    b.wait_subscribers(1)
    pub = b.shell("seq 1 2000 | blipmq pub logs --lines -")
    assert pub.returncode == 0, pub.stderr
    out, err = sub.communicate(timeout=30)
    assert sub.returncode == 0, err
    assert lines_of(out) == [str(i) for i in range(1, 2001)]


def test_binary_file_round_trips_byte_for_byte(start_broker, tmp_path: Path) -> None:
    """The README's promise: `blipmq sub fw -N --count 1 > fw.bin` equals what pubfile sent."""
    b = start_broker()
    blob = os.urandom(5 * 1024 * 1024)
    src, dst = tmp_path / "fw.bin", tmp_path / "out.bin"
    src.write_bytes(blob)
    sub = b.spawn_shell(f"blipmq sub fw -N --count 1 > {dst}")
    b.wait_subscribers(1)
    res = b.cli("pubfile", "fw", str(src))
    assert res.returncode == 0, res.stderr
    _, err = sub.communicate(timeout=30)
    assert sub.returncode == 0, err
    assert dst.read_bytes() == blob


def test_binary_payload_with_every_byte_value(start_broker) -> None:
    b = start_broker()
    blob = bytes(range(256)) * 64 + b"\n\r\x00tail"
    sub = b.spawn("sub", "bin", "-N", "--count", "1")
    b.wait_subscribers(1)
    assert b.cli("pub", "bin", "-", input=blob).returncode == 0
    out, _ = sub.communicate(timeout=15)
    assert out == blob


def test_count_stops_after_n(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "t", "--count", "3", "--format", "lines")
    b.wait_subscribers(1)
    assert b.shell("printf 'a\\nb\\nc\\nd\\ne\\n' | blipmq pub t --lines -").returncode == 0
    out, _ = sub.communicate(timeout=15)
    assert sub.returncode == 0
    assert lines_of(out) == ["a", "b", "c"]


def test_timeout_with_nothing_received_has_its_own_exit_code(start_broker) -> None:
    b = start_broker()
    started = time.monotonic()
    res = b.cli("sub", "quiet", "--timeout", "0.5")
    elapsed = time.monotonic() - started
    assert res.returncode == Exit.TIMEOUT
    assert res.stdout == b""
    assert len(res.stderr.decode().strip().splitlines()) == 1
    assert "timed out" in res.stderr.decode()
    assert 0.4 < elapsed < 5


def test_wildcard_subscriptions(start_broker) -> None:
    b = start_broker()
    plus = b.spawn("sub", "sensors/+/temp", "--count", "2", "--format", "json")
    hash_ = b.spawn("sub", "sensors/#", "--count", "3", "--format", "json")
    b.wait_subscribers(2)
    for topic, value in [("sensors/a/temp", "1"), ("sensors/a/hum", "2"), ("sensors/b/temp", "3")]:
        assert b.cli("pub", topic, value).returncode == 0
    out, _ = plus.communicate(timeout=15)
    got = [json.loads(line) for line in lines_of(out)]
    assert [(m["topic"], m["payload"]) for m in got] == [("sensors/a/temp", "1"),
                                                         ("sensors/b/temp", "3")]
    out, _ = hash_.communicate(timeout=15)
    assert [json.loads(line)["payload"] for line in lines_of(out)] == ["1", "2", "3"]


def test_group_members_share_and_groups_each_get_all(start_broker, tmp_path: Path) -> None:
    b = start_broker()
    # the members run until every message reached one of them (no timeout to race the
    # thirty publishes on a loaded machine), each writing to its own file
    outs = [tmp_path / "w1.out", tmp_path / "w2.out"]
    workers = [b.spawn_shell(f"exec blipmq sub jobs --group workers --format lines > {out}")
               for out in outs]
    audit = b.spawn("sub", "jobs", "--group", "audit", "--count", "300", "--format", "lines")
    b.wait_metric("blipmq_connections_open", 3)
    b.wait_subscribers(2)  # two queues: one per group
    for start in range(0, 300, 10):  # several publishes, so both members get turns
        batch = "".join(f"{i}\n" for i in range(start, start + 10)).encode()
        assert b.cli("pub", "jobs", "--lines", "-", input=batch).returncode == 0
    oa, _ = audit.communicate(timeout=20)
    assert lines_of(oa) == [str(i) for i in range(300)]
    deadline = time.monotonic() + 20
    while sum(len(lines_of(o.read_bytes())) for o in outs) < 300:
        assert time.monotonic() < deadline, "the group's members did not get every message"
        time.sleep(0.02)
    for w in workers:
        w.terminate()
        w.communicate(timeout=10)
    got1, got2 = (lines_of(o.read_bytes()) for o in outs)
    assert got1 and got2, "both members of the group must get work"
    assert sorted(got1 + got2, key=int) == [str(i) for i in range(300)]


def test_group_outlives_its_consumers_until_unsub(start_broker) -> None:
    b = start_broker()
    first = b.cli("sub", "jobs", "--group", "g", "--timeout", "0.3")
    assert first.returncode == Exit.TIMEOUT
    assert b.shell("printf 'x\\ny\\n' | blipmq pub jobs --lines -").returncode == 0
    res = b.cli("sub", "jobs", "--group", "g", "--count", "2", "--format", "lines")
    assert res.returncode == 0 and lines_of(res.stdout) == ["x", "y"]
    assert b.cli("unsub", "jobs", "--group", "g").returncode == 0
    again = b.cli("unsub", "jobs", "--group", "g")
    assert again.returncode == Exit.NOT_FOUND
    assert "no group" in again.stderr.decode()
    assert b.cli("unsub", "jobs").returncode == Exit.USAGE


@pytest.mark.parametrize(
    ("policy", "expected", "reason"),
    [("drop_oldest", ["5", "6", "7", "8", "9"], "drop_oldest"),
     ("drop_new", ["0", "1", "2", "3", "4"], "drop_new"),
     # a group whose consumer left holds nobody back: it keeps its newest messages
     ("block", ["5", "6", "7", "8", "9"], "no_consumer")],
)
def test_overflow_policies(start_broker, policy: str, expected: list[str], reason: str) -> None:
    b = start_broker({"queues": {"capacity": 5, "overflow": policy, "block_timeout_ms": 300}})
    assert b.cli("sub", "q", "--group", "g", "--timeout", "0.2").returncode == Exit.TIMEOUT
    pub = b.shell("seq 0 9 | blipmq pub q --lines -")
    assert pub.returncode == 0, pub.stderr
    res = b.cli("sub", "q", "--group", "g", "--count", "5", "--format", "lines")
    assert lines_of(res.stdout) == expected
    assert b.metric("blipmq_messages_dropped_total", reason=reason) == 5


def test_block_policy_waits_for_a_slow_consumer(start_broker) -> None:
    b = start_broker({"queues": {"capacity": 10, "overflow": "block", "block_timeout_ms": 5000}})
    sub = b.spawn("sub", "q", "--count", "5000", "--format", "lines")
    b.wait_subscribers(1)
    pub = b.shell("seq 1 5000 | blipmq pub q --lines -")
    assert pub.returncode == 0, pub.stderr
    out, _ = sub.communicate(timeout=30)
    assert lines_of(out) == [str(i) for i in range(1, 5001)]
    assert b.metric("blipmq_connections_closed_total", reason="slow_consumer") == 0


def test_ttl_expired_messages_are_never_delivered(start_broker) -> None:
    b = start_broker({"queues": {"expiry_interval_ms": 50}})
    assert b.cli("sub", "t", "--group", "g", "--timeout", "0.2").returncode == Exit.TIMEOUT
    assert b.cli("pub", "t", "stale", "--ttl", "100").returncode == 0
    assert b.cli("pub", "t", "fresh").returncode == 0
    b.wait_metric("blipmq_messages_dropped_total", 1, reason="ttl")
    res = b.cli("sub", "t", "--group", "g", "--count", "2", "--timeout", "1", "--format", "lines")
    assert lines_of(res.stdout) == ["fresh"]
    assert res.returncode == Exit.TIMEOUT


def test_default_ttl_from_config(start_broker) -> None:
    b = start_broker({"queues": {"default_ttl_ms": 100, "expiry_interval_ms": 50}})
    assert b.cli("sub", "t", "--group", "g", "--timeout", "0.2").returncode == Exit.TIMEOUT
    assert b.cli("pub", "t", "gone").returncode == 0
    b.wait_metric("blipmq_messages_dropped_total", 1, reason="ttl")
    assert b.cli("sub", "t", "--group", "g", "--timeout", "0.5").returncode == Exit.TIMEOUT


def test_auth_refusal_and_acceptance(start_broker) -> None:
    b = start_broker({"auth": {"api_keys": ["s3cret"]}})
    res = b.cli("pub", "t", "x")
    assert res.returncode == Exit.AUTH
    assert res.stderr.decode().count("\n") == 1 and "refused" in res.stderr.decode()
    assert b.cli("pub", "t", "x", "--api-key", "wrong").returncode == Exit.AUTH
    assert b.cli("pub", "t", "x", "--api-key", "s3cret").returncode == 0
    assert b.cli("pub", "t", "x", BLIPMQ_API_KEY="s3cret").returncode == 0
    assert b.metric("blipmq_auth_failures_total") == 2


def test_oversize_and_bad_names_are_refused(start_broker, tmp_path: Path) -> None:
    b = start_broker({"server": {"max_message_bytes": 1000}})
    big = b.cli("pub", "t", "-", input=b"x" * 2000)
    assert big.returncode == Exit.TOO_LARGE and b"1000" in big.stderr
    (tmp_path / "big.bin").write_bytes(b"y" * 5000)
    assert b.cli("pubfile", "t", str(tmp_path / "big.bin")).returncode == Exit.TOO_LARGE
    assert b.cli("pub", "t", "-", input=b"x" * 1000).returncode == 0
    bad = b.cli("pub", "a/+/b", "x")
    assert bad.returncode == Exit.BAD_NAME and b"wildcard" in bad.stderr
    assert b.cli("sub", "a/#/b", "--timeout", "1").returncode == Exit.BAD_NAME
    assert b.cli("sub", "a", "--group", "bad name", "--timeout", "1").returncode == Exit.BAD_NAME
    for res in (big, bad):
        assert b"Traceback" not in res.stderr and res.stderr.count(b"\n") == 1


def test_unreachable_broker(tmp_path: Path, start_broker) -> None:
    b = start_broker()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    res = b.cli("pub", "t", "x", "--addr", f"127.0.0.1:{free}")
    assert res.returncode == Exit.UNREACHABLE
    assert b"cannot connect" in res.stderr and b"Traceback" not in res.stderr
    assert b.cli("pub", "t", "x", "--addr", "h:x").returncode == Exit.USAGE
    assert b.cli("pub", "t", "x", "--addr", "nonsense.invalid").returncode == Exit.UNREACHABLE


def _handshake(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(codec.encode(codec.Hello(codec.VERSION, "raw", 1)) + codec.encode(codec.Auth("", 2)))
    dec = codec.Decoder()
    frames: list = []
    while len(frames) < 2:
        dec.feed(s.recv(65536))
        frames += dec.frames()
    assert isinstance(frames[1], codec.AuthOk)
    return s


def _read_until_closed(s: socket.socket) -> list:
    dec = codec.Decoder()
    while chunk := s.recv(65536):
        dec.feed(chunk)
    return dec.frames()


def test_garbage_on_one_socket_does_not_disturb_others(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "t", "--count", "1")
    b.wait_subscribers(1)
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        s.sendall(b"\x00\x00\x00\x09\xee\x00\x00\x00\x01garbage!")
        frames = _read_until_closed(s)
    assert isinstance(frames[-1], codec.Error) and frames[-1].code == codec.ErrorCode.PROTOCOL
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as s:
        s.sendall(b"\xff\xff\xff\xff")  # a length beyond max_frame
        frames = _read_until_closed(s)
    assert frames[-1].code == codec.ErrorCode.FRAME_TOO_LARGE
    assert b.cli("pub", "t", "still here").returncode == 0
    out, _ = sub.communicate(timeout=10)
    assert out == b"still here\n"


def test_max_connections(start_broker) -> None:
    b = start_broker({"server": {"max_connections": 2}})
    held = [_handshake(b.port), _handshake(b.port)]
    res = b.cli("pub", "t", "x")
    assert res.returncode == Exit.REFUSED and b"max_connections" in res.stderr
    assert b.metric("blipmq_connections_refused_total") == 1
    held.pop().close()
    b.wait_metric("blipmq_connections_open", 1)
    assert b.cli("pub", "t", "x").returncode == 0
    held[0].close()


def test_sigterm_drains_and_exits_zero(start_broker, tmp_path: Path) -> None:
    b = start_broker({"server": {"shutdown_grace_ms": 3000}})
    received = tmp_path / "received.txt"
    # to a file, not a pipe nobody reads yet: the drain needs a subscriber that keeps reading
    sub = b.spawn_shell(f"blipmq sub t --no-reconnect > {received}")
    b.wait_subscribers(1)
    assert b.shell("seq 1 20000 | blipmq pub t --lines -").returncode == 0
    started = time.monotonic()
    assert b.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 3.5
    _, err = sub.communicate(timeout=10)
    assert lines_of(received.read_bytes()) == [str(i) for i in range(1, 20001)]
    assert sub.returncode == 0, err


def test_sub_into_head_ends_quietly(start_broker) -> None:
    b = start_broker()
    pipeline = b.spawn_shell("blipmq sub t --format lines | head -1")
    b.wait_subscribers(1)
    assert b.shell("seq 1 50000 | blipmq pub t --lines -").returncode == 0
    out, err = pipeline.communicate(timeout=20)
    assert pipeline.returncode == 0, err
    assert out == b"1\n"
    assert err == b""


def test_ctrl_c_ends_sub_quietly(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "t")
    b.wait_subscribers(1)
    sub.send_signal(signal.SIGINT)
    _, err = sub.communicate(timeout=10)
    assert sub.returncode == Exit.INTERRUPTED
    assert err == b""


def test_lines_stream_as_they_come(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "logs", "--format", "lines")
    b.wait_subscribers(1)
    pub = b.spawn("pub", "logs", "--lines", "-")
    assert pub.stdin is not None and sub.stdout is not None
    for word in ("first", "second"):
        pub.stdin.write(word.encode() + b"\n")
        pub.stdin.flush()
        assert sub.stdout.readline() == word.encode() + b"\n"  # before stdin closes
    pub.stdin.close()
    assert pub.wait(10) == 0
    sub.send_signal(signal.SIGINT)
    sub.wait(10)


def test_bad_config_refuses_to_start(start_broker) -> None:
    b = start_broker({"queues": {"overflow": "sometimes"}}, expect_ready=False)
    assert b.proc.wait(20) == 2
    assert b.log_ended.wait(10)
    lines = [line for line in b.log if line.strip()]
    assert len(lines) == 1 and "queues.overflow" in lines[0]


def test_second_broker_on_same_data_dir_is_refused(start_broker) -> None:
    b = start_broker()
    res = b.cli("start", "--config", str(b.config_path), "--data-dir", str(b.data_dir))
    assert res.returncode == 1 and b"in use" in res.stderr


def test_second_broker_is_refused_after_the_lock_file_was_deleted(start_broker) -> None:
    """A stale-lock cleanup deletes ``blipmq.lock`` under a running broker: the lock was
    only an flock on that file, so a second broker started on the same directory and both
    appended to the same segment (confirmed messages were lost at the next start). The
    directory itself is locked too, and it cannot be deleted and made again under it."""
    b = start_broker()
    (b.data_dir / "blipmq.lock").unlink()
    second = start_broker(expect_ready=False, data_dir=b.data_dir)  # ports of its own
    try:
        second.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass  # it runs (the fixture kills it)
    assert second.proc.poll() == 1, "a second broker runs on the same data directory"
    assert second.log_ended.wait(10)
    assert any("in use" in line for line in second.log), second.log
    assert b.cli("pub", "t", "still", "--qos", "1").returncode == 0
    assert b.stop() == 0


def test_config_init_writes_the_commented_default(tmp_path: Path) -> None:
    target = tmp_path / "my.toml"
    res = subprocess.run([BLIPMQ, "config", "init", str(target)], capture_output=True)
    assert res.returncode == 0 and target.read_text() == default_text()
    again = subprocess.run([BLIPMQ, "config", "init", str(target)], capture_output=True)
    assert again.returncode == Exit.USAGE and b"already exists" in again.stderr


def test_bad_environment_override_names_the_variable(start_broker) -> None:
    b = start_broker()
    res = b.cli("start", "--config", str(b.config_path), "--data-dir", str(b.data_dir) + "-x",
                BLIPMQ_QUEUES_OVERFLOW="sometimes")
    assert res.returncode == 2
    assert res.stderr.decode().strip() == (
        "blipmq: config error: BLIPMQ_QUEUES_OVERFLOW: 'sometimes' is not one of "
        "drop_oldest, drop_new, block"
    )


def test_a_misspelled_section_name_is_logged_and_exec_names_are_left_alone(
        tmp_path: Path) -> None:
    """``BLIPMQ_SERVR_PORT`` gets a warning line naming the setting meant (it was ignored
    without a word); ``BLIPMQ_DELIVERY_COUNT``, which ``sub --exec`` gives its children, is
    not taken for a setting (the broker refused to start, exit 2)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
    env.update(BLIPMQ_SERVR_PORT="7000", BLIPMQ_DELIVERY_COUNT="1", BLIPMQ_TOPIC="t")
    proc = subprocess.Popen(
        [BLIPMQ, "start", "--bind", "127.0.0.1:0", "--metrics-bind", "127.0.0.1:0", "--data-dir",
         str(tmp_path / "data"), "--log-format", "plain"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:  # ends at the ready line, or when the broker exits
            lines.append(raw.decode().rstrip())
            if "listening on" in lines[-1]:
                break
    finally:
        proc.kill()
        proc.wait()
    assert any("listening on" in line for line in lines), lines
    warned = [line for line in lines if "BLIPMQ_SERVR_PORT" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "WARNING blipmq: config: BLIPMQ_SERVR_PORT is not a setting and is ignored; did you "
        "mean BLIPMQ_SERVER_PORT?"), lines
    assert not any("DELIVERY_COUNT" in line for line in lines)


def test_a_host_no_resolver_takes_is_a_config_error(tmp_path: Path) -> None:
    """A label over 63 characters (the file, ``--bind``), or bytes that are not UTF-8 from
    the environment: one config error line and exit 2 (it was a 57-line traceback from the
    listener's address lookup, exit 1)."""
    long_name = "a" * 70 + ".example"
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'[server]\nhost = "{long_name}"\n')
    runs = [
        ([BLIPMQ, "start", "--config", str(config_file)], {}, "server.host"),
        ([BLIPMQ, "start", "--bind", f"{long_name}:7878"], {}, "server.host"),
        ([BLIPMQ, "start", "--metrics-bind", f"{long_name}:9090"], {}, "metrics.host"),
        ([BLIPMQ, "start"], {"BLIPMQ_MQTT_HOST": b"\xff"}, "BLIPMQ_MQTT_HOST"),
    ]
    for argv, extra, key in runs:
        env = {**os.environb, **{k.encode(): v for k, v in extra.items()},
               b"BLIPMQ_STORAGE_DATA_DIR": str(tmp_path / "data").encode()}
        res = subprocess.run(argv, capture_output=True, env=env, timeout=30)
        lines = res.stderr.decode(errors="replace").splitlines()
        assert res.returncode == 2 and len(lines) == 1, res
        assert lines[0].startswith(f"blipmq: config error: {key}: ") and (
            "is not a host name or an IP address" in lines[0]), lines


def test_second_signal_exits_at_once(start_broker) -> None:
    b = start_broker({"server": {"shutdown_grace_ms": 30000},
                      "queues": {"capacity": 100000, "overflow": "drop_new"}})
    stuck = _handshake(b.port)  # subscribes, then never reads: the drain cannot finish
    stuck.sendall(codec.encode(codec.Subscribe("big", "", 0, 0, request_id=3)))
    b.wait_subscribers(1)
    payload = os.urandom(4096)
    with Client(b.addr) as c:
        c.publish_many(("big", payload) for _ in range(5000))
    b.proc.send_signal(signal.SIGTERM)
    b.wait_log("shutting down: draining")
    assert b.proc.poll() is None, "still draining towards the stuck subscriber"
    time.sleep(SAME_SIGNAL_S)  # sooner, it would count as the first one delivered twice
    started = time.monotonic()
    assert b.stop(signal.SIGTERM, timeout=5) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 2
    stuck.close()


def test_health_ready_and_unknown_paths(start_broker) -> None:
    import urllib.error
    import urllib.request

    b = start_broker()
    base = f"http://127.0.0.1:{b.metrics_port}"
    for path, body in (("/health", b"ok\n"), ("/ready", b"ready\n")):
        with urllib.request.urlopen(base + path, timeout=5) as resp:
            assert resp.status == 200 and resp.read() == body
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert info.value.code == 404


def test_qos1_publish_needs_the_log(start_broker) -> None:
    b = start_broker({"wal": {"enabled": False}})
    res = b.cli("pub", "t", "x", "--qos", "1")
    assert res.returncode == Exit.REFUSED and b"QoS 1 needs the write-ahead log" in res.stderr
    res = b.cli("sub", "t", "--qos", "1", "--timeout", "1")
    assert res.returncode == Exit.REFUSED and b"QoS 1" in res.stderr


def _log_bodies(data_dir: Path) -> list[bytes]:
    """Payloads in the broker's log, read with the log's own reader (broker stopped)."""
    wal = Log(str(data_dir / "wal"))
    wal.open()
    records = wal.read(0, max_records=10**7, max_bytes=1 << 40)
    return [codec.decode_one(codec.encode_publish([r.body])).decoded()[0].payload
            for r in records]


def test_qos1_lines_are_confirmed_and_survive_sigkill(start_broker) -> None:
    b = start_broker()
    res = b.shell("seq 1 3000 | blipmq pub t --qos 1 --lines -")
    assert res.returncode == 0, res.stderr
    assert b.cli("pub", "t", "single", "--qos", "1").returncode == 0
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    bodies = _log_bodies(b.data_dir)
    assert bodies == [str(i).encode() for i in range(1, 3001)] + [b"single"]


def test_restart_continues_the_log(start_broker) -> None:
    b = start_broker()
    assert b.shell("seq 1 10 | blipmq pub t --lines -").returncode == 0
    assert b.stop() == 0
    b2 = start_broker(data_dir=b.data_dir)
    assert any("wal: 10 record(s)" in line for line in b2.log)
    sub = b2.spawn("sub", "t", "--count", "1", "--format", "json")
    b2.wait_subscribers(1)
    assert b2.cli("pub", "t", "eleventh", "--qos", "1").returncode == 0
    out, _ = sub.communicate(timeout=10)
    assert json.loads(out)["offset"] == 11
    assert b2.stop() == 0
    assert _log_bodies(b.data_dir)[-1] == b"eleventh"


def test_key_and_ttl_travel_with_the_message(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "t", "--count", "1", "--format", "json")
    b.wait_subscribers(1)
    assert b.cli("pub", "t", "v", "--key", "dev-7", "--ttl", "60000").returncode == 0
    out, _ = sub.communicate(timeout=10)
    msg = json.loads(out)
    assert msg["key"] == "dev-7" and msg["ttl_ms"] == 60000 and msg["payload"] == "v"
    assert "key_encoding" not in msg  # only a key that is not UTF-8 comes as base64
    assert msg["offset"] >= 1 and msg["delivery_count"] == 1


def test_pubfile_shows_progress_on_a_terminal(start_broker, tmp_path: Path) -> None:
    import pty

    b = start_broker()
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024))
    sub = b.spawn("sub", "fw", "-N", "--count", "1")
    b.wait_subscribers(1)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([BLIPMQ, "pubfile", "fw", str(src)], stderr=follower,
                            stdout=subprocess.DEVNULL, env=b.env)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(20) == 0
    os.close(leader)
    assert b"sending big.bin" in seen
    out, _ = sub.communicate(timeout=20)
    assert out == src.read_bytes()


def test_torn_tail_is_cut_and_reported_on_restart(start_broker) -> None:
    b = start_broker()
    assert b.shell("seq 1 100 | blipmq pub t --qos 1 --lines -").returncode == 0
    assert b.metric("blipmq_wal_records_total") == 100
    assert b.metric("blipmq_wal_fsyncs_total") >= 1
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    segment = next((b.data_dir / "wal").glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[:-10])  # the last record loses its tail
    b2 = start_broker(data_dir=b.data_dir)
    assert any("torn tail cut" in line for line in b2.log)
    assert b2.metric("blipmq_wal_recovery_torn_bytes") > 0
    assert b2.metric("blipmq_wal_recovery_quarantined") == 0
    assert b2.stop() == 0
    assert _log_bodies(b.data_dir) == [str(i).encode() for i in range(1, 100)]


def test_corrupt_record_is_quarantined_and_the_broker_starts(start_broker) -> None:
    b = start_broker()
    assert b.shell("seq 1 100 | blipmq pub t --qos 1 --lines -").returncode == 0
    assert b.stop() == 0
    segment = next((b.data_dir / "wal").glob("*.seg"))
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x40
    segment.write_bytes(bytes(data))
    b2 = start_broker(data_dir=b.data_dir)
    assert b2.metric("blipmq_wal_recovery_quarantined") == 1
    assert any("set aside" in line for line in b2.log)
    assert b2.cli("pub", "t", "still works", "--qos", "1").returncode == 0
    assert b2.stop() == 0
    bodies = _log_bodies(b.data_dir)
    assert bodies[-1] == b"still works"
    # every record but the damaged one: those after the damage are kept too
    originals = [str(i).encode() for i in range(1, 101)]
    assert len(bodies) == 100 and set(bodies[:-1]) < set(originals)
    assert bodies[:-1] == [x for x in originals if x in bodies]
    assert list((b.data_dir / "wal").glob("*.corrupt"))


def test_durable_group_survives_sigkill_and_restart(start_broker) -> None:
    b = start_broker()
    first = b.cli("sub", "jobs", "--group", "g", "--qos", "1", "--timeout", "0.3")
    assert first.returncode == Exit.TIMEOUT  # creates the durable group
    assert b.shell("seq 1 10 | blipmq pub jobs --qos 1 --lines -").returncode == 0
    got = b.cli("sub", "jobs", "--group", "g", "--qos", "1", "--count", "4", "--format", "lines")
    assert lines_of(got.stdout) == ["1", "2", "3", "4"]
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    b2 = start_broker(data_dir=b.data_dir)
    rest = b2.cli("sub", "jobs", "--group", "g", "--qos", "1", "--count", "6", "--timeout", "10",
                  "--format", "lines")
    assert rest.returncode == 0, rest.stderr
    assert lines_of(rest.stdout) == [str(i) for i in range(5, 11)]
    assert b2.cli("unsub", "jobs", "--group", "g").returncode == 0
    assert b2.stop() == 0
    b3 = start_broker(data_dir=b.data_dir)
    assert b3.cli("unsub", "jobs", "--group", "g").returncode == Exit.NOT_FOUND




# ------------------------------------------------- a silent broker (tests/peer.py stands in)


def _run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[bytes], float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
    started = time.monotonic()
    res = subprocess.run([BLIPMQ, *args], capture_output=True, timeout=30,
                         env={**clean, **env})
    return res, time.monotonic() - started


def test_sub_against_a_silent_listener_exits_unreachable() -> None:
    with Peer(None) as peer:
        res, elapsed = _run("sub", "t", "--no-reconnect", "--addr", peer.addr,
                            BLIPMQ_TIMEOUT="0.5")
    assert res.returncode == Exit.UNREACHABLE, res.stderr
    assert res.stderr.decode() == (
        f"blipmq: cannot connect to {peer.addr}: the broker did not finish the handshake "
        "within 0.5 s\n"
    )
    assert elapsed < 5


def test_sub_on_a_broker_gone_silent_gives_up_after_twice_the_timeout() -> None:
    with Peer(silent_after_subscribe) as peer:
        res, elapsed = _run("sub", "t", "--no-reconnect", "--addr", peer.addr, BLIPMQ_TIMEOUT="0.5")
    assert res.returncode == Exit.UNREACHABLE, res.stderr
    assert res.stderr.decode() == f"blipmq: no answer from the broker at {peer.addr} for 1 s\n"
    assert res.stdout == b""
    assert 1 <= elapsed < 6
    assert sum(isinstance(f, codec.Ping) for f in peer.frames()) == 1


def test_a_quiet_sub_keeps_its_link_to_a_real_broker_alive(start_broker) -> None:
    b = start_broker()
    res = b.cli("sub", "quiet", "--timeout", "1.5", BLIPMQ_TIMEOUT="0.2")
    assert res.returncode == Exit.TIMEOUT, res.stderr  # probes answered: no false alarm
    assert "timed out after 1.5 s" in res.stderr.decode()


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan"])
def test_a_bad_timeout_setting_is_a_usage_error(value: str) -> None:
    res, _ = _run("pub", "t", "x", BLIPMQ_TIMEOUT=value)  # refused before connecting
    assert res.returncode == Exit.USAGE
    assert res.stderr.decode() == (
        f"blipmq: BLIPMQ_TIMEOUT: {value!r} is not a positive number of seconds\n"
    )


def test_pub_lines_answers_pings_while_stdin_is_quiet() -> None:
    def pongs(frame: codec.Frame, link: Link) -> None:
        greet(frame, link)
        if isinstance(frame, codec.Ping):  # the client's own: its final flush
            link.send(codec.Pong(frame.data, frame.request_id))

    def has(kind: type, rid: int | None = None) -> Callable[[list[codec.Frame]], bool]:
        return lambda frames: any(isinstance(f, kind) and rid in (None, f.request_id)
                                  for f in frames)

    with Peer(pongs) as peer:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
        pub = subprocess.Popen([BLIPMQ, "pub", "t", "--lines", "-", "--addr", peer.addr],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=clean)
        assert pub.stdin is not None
        try:
            pub.stdin.write(b"one\n")
            pub.stdin.flush()
            peer.wait_for(has(codec.Publish))  # past the handshake, back to waiting on stdin
            peer.links[0].send(codec.Ping(b"still there?", 4242))
            peer.wait_for(has(codec.Pong, 4242))  # answered with no new line on stdin
            pub.stdin.write(b"two\n")
            pub.stdin.close()
            assert pub.wait(20) == 0, pub.communicate()[1]
        finally:
            if pub.poll() is None:
                pub.kill()
                pub.wait()
    pongs_seen = [(type(f), f) for f in peer.frames() if isinstance(f, codec.Pong)]
    assert pongs_seen == [(codec.Pong, codec.Pong(b"still there?", 4242))]
    published = [m.payload for f in peer.frames() if isinstance(f, codec.Publish)
                 for m in f.decoded()]
    assert published == [b"one", b"two"]


def test_sub_closed_by_the_broker_for_silence_exits_unreachable() -> None:
    def timed_out(frame: codec.Frame, link: Link) -> None:
        silent_after_subscribe(frame, link)
        if isinstance(frame, codec.Subscribe):  # as a broker whose keepalive PING went unread
            link.send(codec.Goodbye(codec.ErrorCode.TIMEOUT, "no answer to keepalive PING"))
            link.hang_up()

    with Peer(timed_out) as peer:
        res, _ = _run("sub", "t", "--addr", peer.addr)
    assert res.returncode == Exit.UNREACHABLE
    assert res.stderr.decode() == "blipmq: no answer to keepalive PING\n"


def test_stats_watch_into_a_pipe_prints_each_refresh_and_ends_with_its_reader(
        start_broker) -> None:
    """Not a terminal: one table per refresh, written at once; `| head -1` ends it, exit 0."""
    b = start_broker()
    watch = b.spawn("stats", "--watch", "--interval", "0.1")
    assert watch.stdout is not None
    try:
        out = b""
        deadline = time.monotonic() + 20
        while out.count(b"\nbroker ") < 2:  # two refreshes, each a table
            left = deadline - time.monotonic()
            assert left > 0 and select.select([watch.stdout], [], [], left)[0], out
            chunk = os.read(watch.stdout.fileno(), 1 << 16)
            assert chunk, "stats --watch ended"
            out += chunk
        assert out.startswith(b"broker ")
    finally:
        watch.kill()
        watch.wait()
    res = b.shell("timeout 15 blipmq stats --watch --interval 0.1 | head -1", timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(b"broker ") and res.stdout.count(b"\n") == 1
    assert res.stderr == b""


@pytest.mark.parametrize(("command", "error"), [
    ("blipmq --help > /dev/full", "No space left on device"),
    ("blipmq pub --help > /dev/full", "No space left on device"),
    ("blipmq --help >&-", "stdout is closed"),
    ("blipmq sub out/t --from earliest -C 1 >&-", "stdout is closed"),
    ("blipmq stats --json >&-", "stdout is closed"),
    ("blipmq version >&-", "stdout is closed"),
])
def test_an_unwritable_stdout_is_one_line_and_exit_2(start_broker, command: str,
                                                      error: str) -> None:
    b = start_broker()
    assert b.cli("pub", "out/t", "x").returncode == 0
    res = b.shell(command, timeout=30)
    assert res.returncode == Exit.USAGE, res.stderr
    assert res.stderr.decode() == f"blipmq: {error}\n"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_qos1_lines_says_how_many_were_confirmed(start_broker, sig) -> None:
    """Ctrl-C, or SIGTERM (a supervisor, ``timeout``): the last line says how far it got
    (SIGTERM said nothing), then exit 130 for Ctrl-C, death by the signal for SIGTERM."""
    b = start_broker()
    with Client(b.addr) as watcher:
        sub = watcher.subscribe("int/t")
        pub = b.spawn("pub", "int/t", "-l", "-q", "1")
        assert pub.stdin is not None
        pub.stdin.write(b"".join(b"%d\n" % i for i in range(1000)))
        pub.stdin.flush()  # and left open: more could come
        got = 0
        while got < 1000:  # bounded: each wait raises after 10 s
            got += len(sub.next_batch(timeout=10) or ())
    pub.send_signal(sig)
    _, err = pub.communicate(timeout=10)
    assert pub.returncode == (Exit.INTERRUPTED if sig == signal.SIGINT else -signal.SIGTERM)
    text = err.decode()
    said = "interrupted" if sig == signal.SIGINT else "terminated"
    assert text.startswith(f"blipmq: {said}; ") and text.endswith(
        " of 1000 line(s) confirmed\n") and text.count("\n") == 1, text


def test_pub_lines_notices_a_silent_link_and_says_how_far_it_got(start_broker) -> None:
    """`pub -q 1 -l` whose link goes silent (no FIN, no RST) while stdin is quiet: the
    keepalive finds it within 2 x BLIPMQ_TIMEOUT, and it exits 3 saying how many lines
    were confirmed, instead of waiting for ever for stdin or the broker. (With
    ``--reconnect-for 0``; by default it would dial again: tests/test_e2e_cli_reconnect.py.)"""
    from tests.faultproxy import FaultProxy

    b = start_broker()
    with FaultProxy(("127.0.0.1", b.port)) as proxy:
        env = {**os.environ, "BLIPMQ_TIMEOUT": "1"}
        proc = subprocess.Popen([BLIPMQ, "pub", "silent/t", "-q", "1", "-l", "--reconnect-for",
                                 "0", "--addr", f"127.0.0.1:{proxy.port}"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(b"one\ntwo\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while b.metric("blipmq_messages_published_total") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proxy.blackhole()
        try:
            assert proc.wait(10) == 3
        finally:
            proc.kill()
            proc.stdin.close()
        err = proc.stderr.read().decode() if proc.stderr else ""
        # the broker logged both; their confirms may have been on the way when the link
        # went silent, and a confirm that never came is not counted
        assert "no answer from the broker" in err and re.search(
            r"\b[0-2] of 2 line\(s\) confirmed", err), err
        assert b.metric("blipmq_messages_published_total") == 2


def test_progress_shows_a_file_name_as_literal_text(start_broker, tmp_path: Path) -> None:
    # h29: the bar's description is rich markup: a file's name was drawn as markup (styled,
    # a link; '[/]' in a directory's name made pub fail), an escape sequence in it reached
    # the terminal as it was
    from terminal import stderr_on_terminal

    b = start_broker()
    blob = tmp_path / "[bold red]\x1b[2Jbig.bin"
    blob.write_bytes(os.urandom(1 << 20))
    status, text = stderr_on_terminal([BLIPMQ, "pubfile", "fw", str(blob)], b.env)
    assert status == 0, text[-500:]
    assert "sending [bold red]\\x1b[2Jbig.bin" in text and "\x1b[2Jbig" not in text, text[-500:]

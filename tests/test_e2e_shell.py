"""The shell toolkit as people with mosquitto and NATS habits use it: output forms, short
options, durations, `sub --exec`, background subscribers, reconnects. Real broker, real CLI,
real pipes."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from pathlib import Path

import pytest

from blipmq_cli.exits import Exit


def _wait_for(check, timeout: float = 20, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.02)


def test_output_forms_and_several_filters(start_broker) -> None:
    b = start_broker()
    verbose = b.spawn("sub", "a", "b/+", "-v", "-C", "3")
    template = b.spawn("sub", "-t", "a", "-C", "2", "-F", r"%t|%o|%p|{size}\t%%")
    as_json = b.spawn("sub", "a", "-C", "2", "--format", "json")
    lines = b.spawn("sub", "a", "-C", "2")
    b.wait_subscribers(5)
    assert b.cli("pub", "a", "hello", "--key", "dev-7").returncode == 0
    assert b.cli("pub", "-t", "b/1", "-m", "world").returncode == 0
    assert b.shell("printf 'x\\n' | blipmq pub a -l").returncode == 0  # no '-' needed
    out, err = verbose.communicate(timeout=10)
    assert (verbose.returncode, out) == (0, b"a hello\nb/1 world\na x\n"), err
    out, _ = template.communicate(timeout=10)
    first, second = out.decode().splitlines()
    assert re.fullmatch(r"a\|\d+\|hello\|5\t%", first) and second.startswith("a|")
    out, _ = as_json.communicate(timeout=10)
    record = json.loads(out.splitlines()[0])
    assert record["key"] == "dev-7" and "key_encoding" not in record
    assert lines.communicate(timeout=10)[0] == b"hello\nx\n"


def test_usage_errors_are_one_line_with_exit_code_2(start_broker) -> None:
    b = start_broker()
    for args in (("pub", "t", "x", "--ttl", "-5"), ("pub", "t", "x", "--ttl", "5 parsecs"),
                 ("sub", "t", "-W", "0"), ("sub", "t", "--format", "{nope}"),
                 ("sub", "t", "-v", "-N"), ("sub",), ("pub",), ("pub", "t"),
                 ("sub", "t", "--exec", "true", "--jobs", "0")):
        res = b.cli(*args)
        assert res.returncode == Exit.USAGE, (args, res.stderr)
        assert res.stderr.count(b"\n") == 1 and b"Traceback" not in res.stderr, args
    assert b.cli("pub", "t", "x", "--ttl", "5m").returncode == 0
    res = b.cli("sub", "t", "-W", "300ms")
    assert res.returncode == Exit.TIMEOUT and b"0.3 s" in res.stderr


def test_pub_from_a_file_or_stdin_and_a_host_without_port(start_broker, tmp_path: Path) -> None:
    b = start_broker()
    sub = b.spawn("sub", "f", "-N", "-C", "3")
    b.wait_subscribers(1)
    src = tmp_path / "blob"
    src.write_bytes(b"\x00\x01binary")
    assert b.cli("pub", "f", "-f", str(src)).returncode == 0
    assert b.cli("pubfile", "f", "-", input=b"from stdin").returncode == 0
    assert b.cli("pub", "f", "-s", input=b"all of it").returncode == 0
    out, _ = sub.communicate(timeout=10)
    assert out == b"\x00\x01binaryfrom stdinall of it"
    res = b.cli("pub", "t", "x", "--addr", "localhost")  # port 7878
    assert res.returncode == 0 or b"cannot connect to localhost:7878" in res.stderr
    sub = b.spawn("sub", "h", "-C", "1")
    b.wait_subscribers(1)
    assert b.cli("pub", "h", "x", "--addr", f"localhost:{b.port}").returncode == 0
    assert sub.communicate(timeout=10)[0] == b"x\n"


def test_sub_into_head_exits_with_head(start_broker) -> None:
    b = start_broker()
    pipeline = b.spawn_shell("blipmq sub t | head -1")
    b.wait_subscribers(1)
    assert b.cli("pub", "t", "first").returncode == 0
    # no second message: sub notices its reader is gone by itself
    out, err = pipeline.communicate(timeout=10)
    assert (pipeline.returncode, out, err) == (0, b"first\n", b"")


def test_background_sub_is_live_when_it_returns(start_broker, tmp_path: Path) -> None:
    b = start_broker()
    out, err = tmp_path / "w.txt", tmp_path / "w.err"
    res = b.shell(f"blipmq sub jobs --group w -b > {out} 2> {err}")
    assert res.returncode == 0, err.read_text()
    m = re.search(r"subscribed to 'jobs' in group 'w', in the background \(pid (\d+)\)",
                  err.read_text())
    assert m, err.read_text()
    pid = int(m.group(1))
    try:
        assert b.shell("seq 1 5 | blipmq pub jobs -l").returncode == 0  # no wait needed
        _wait_for(lambda: out.read_bytes() == b"1\n2\n3\n4\n5\n", 10, "the 5 lines")
    finally:
        os.kill(pid, signal.SIGTERM)


def _handler(tmp_path: Path) -> tuple[Path, Path]:
    """A handler that records each payload and fails (exit 3) on payloads containing 7."""
    handled = tmp_path / "handled.txt"
    script = tmp_path / "handle.sh"
    script.write_text(
        "#!/bin/sh\n"
        "read -r line\n"
        f'echo "$line $BLIPMQ_TOPIC $BLIPMQ_DELIVERY_COUNT" >> {handled}\n'
        'case "$line" in *7*) exit 3;; esac\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, handled


def _handled(path: Path) -> list[str]:
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_exec_acks_success_and_dead_letters_failures_across_crash_and_restart(
    start_broker, tmp_path: Path
) -> None:
    config = {"delivery": {"max_retries": 2}}
    b = start_broker(config)
    script, handled = _handler(tmp_path)
    assert b.shell("seq 1 30 | blipmq pub jobs -l -q 1").returncode == 0
    args = ("sub", "jobs", "--group", "g", "-q", "1", "--from", "earliest", "--exec",
            str(script), "--jobs", "3", "--retry-delay", "50ms")
    worker = b.spawn(*args)
    _wait_for(lambda: len(_handled(handled)) >= 8, what="8 handled")
    worker.kill()  # the worker crashes mid-way
    worker.wait()
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL  # and so does the broker
    b2 = start_broker({**config, "server": {"port": b.port}}, data_dir=b.data_dir)
    worker = b2.spawn(*args)
    good = {str(i) for i in range(1, 31) if "7" not in str(i)}
    try:
        _wait_for(lambda: good <= set(_handled(handled)), what="every good message handled")
        b2.wait_metric("blipmq_messages_dead_lettered_total", 3)  # 7, 17, 27
    finally:
        worker.send_signal(signal.SIGINT)
        worker.communicate(timeout=10)
    dlq = b2.cli("sub", "$dlq/jobs", "--from", "earliest", "-C", "3", "--format", "json")
    dead = [json.loads(line) for line in dlq.stdout.splitlines()]
    assert sorted(d["payload"] for d in dead) == ["17", "27", "7"]
    assert {d["dead_letter"]["reason"] for d in dead} == {"exit status 3"}


@pytest.mark.slow
def test_sub_reconnects_across_a_broker_restart(start_broker) -> None:
    b = start_broker()
    group = b.spawn("sub", "t", "--group", "g", "-q", "1", "-C", "4")
    plain = b.spawn("sub", "t", "-C", "4")
    b.wait_metric("blipmq_subscriptions", 2)
    assert b.shell("printf '1\\n2\\n' | blipmq pub t -l -q 1").returncode == 0
    b.wait_metric("blipmq_messages_delivered_total", 4)
    assert b.stop() == 0
    b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
    b2.wait_metric("blipmq_subscriptions", 2)  # both came back by themselves
    assert b2.shell("printf '3\\n4\\n' | blipmq pub t -l -q 1").returncode == 0
    out, err = group.communicate(timeout=15)
    assert (group.returncode, out) == (0, b"1\n2\n3\n4\n"), err
    assert b"reconnected" in err and b"the group goes on where it was" in err
    out, err = plain.communicate(timeout=15)
    assert (plain.returncode, out) == (0, b"1\n2\n3\n4\n"), err
    assert b"going on after offset" in err


def test_no_reconnect_ends_with_the_broker(start_broker) -> None:
    b = start_broker()
    sub = b.spawn("sub", "t", "--no-reconnect")
    b.wait_subscribers(1)
    assert b.stop() == 0
    _, err = sub.communicate(timeout=10)
    assert sub.returncode == 0 and b"shutting down" in err


def test_help_framework_errors_are_one_line(tmp_path: Path) -> None:
    import subprocess

    from conftest import BLIPMQ

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([BLIPMQ, *args], capture_output=True, timeout=30, cwd=tmp_path)

    for args in (("nosuch",), ("config", "init", "--bogus"), ("sub", "--bogus")):
        res = run(*args)
        assert res.returncode == Exit.USAGE, args
        assert res.stderr.count(b"\n") == 1 and b"\xe2\x94" not in res.stderr, res.stderr
    assert run("sub", "t", "-h").stdout.count(b"Usage: blipmq sub") == 1
    res = run("config", "init", "-")
    assert res.returncode == 0 and res.stdout.startswith(b"# BlipMQ broker configuration")
    assert not list(tmp_path.iterdir())  # nothing written

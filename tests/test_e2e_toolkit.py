"""The shell toolkit's last pieces on a real broker and the real CLI: `sub --until-end`,
group names refused alike everywhere, the address `start` could not bind, `pubfile`'s
progress on a terminal, the timestamp in templates, `pub -f -r`, and a group's backlog
after retention skipped it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from terminal import stderr_on_terminal

from blipmq_cli.client import Client
from blipmq_cli.exits import Exit
from blipmq_server.errors import BrokerError
from blipmq_server.protocol.codec import ErrorCode, Start


def test_until_end_stops_at_the_end_of_the_log(start_broker) -> None:
    b = start_broker()
    b.shell("seq 1 5 | blipmq pub n -l -q 1")
    b.cli("pub", "other", "not n", "-q", "1")  # the log ends with a record n does not match
    # fewer than --count in the log: ends at its end instead of waiting (README's awk example)
    res = b.shell("blipmq sub n --from earliest -C 100 --until-end | awk '{ s += $1 } "
                  "END { print s / NR }'", timeout=30)
    assert (res.returncode, res.stdout) == (0, b"3\n"), res.stderr
    # QoS 1 and a durable group: the end comes once the broker has every ack
    res = b.cli("sub", "n", "--from", "earliest", "-q", "1", "--group", "g", "-e")
    assert (res.returncode, res.stdout) == (0, b"1\n2\n3\n4\n5\n"), res.stderr
    b.cli("pub", "n", "6", "-q", "1")
    res = b.cli("sub", "n", "-q", "1", "--group", "g", "-e")  # the group goes on at 6
    assert (res.returncode, res.stdout) == (0, b"6\n"), res.stderr
    res = b.cli("sub", "n", "--from", "3", "-e", "--format", "{offset} {payload}")
    assert res.returncode == 0 and res.stdout.decode().split()[1::2] == ["3", "4", "5", "6"]
    # live only: the retained values, then the end
    b.cli("pub", "-r", "dev/a/status", "on")
    b.cli("pub", "-r", "dev/b/status", "off")
    res = b.cli("sub", "dev/+/status", "-v", "-e")
    assert (res.returncode, sorted(res.stdout.splitlines())) == (
        0, [b"dev/a/status on", b"dev/b/status off"]), res.stderr
    res = b.cli("sub", "nothing/here", "-e", "-q", "1")
    assert (res.returncode, res.stdout) == (0, b"")
    # several filters: each must reach its end
    res = b.cli("sub", "n", "dev/a/status", "--from", "earliest", "-e", "-v")
    assert res.returncode == 0 and res.stdout.count(b"\n") == 7, res.stdout
    # --exec: every command ran and was acked before the exit
    res = b.cli("sub", "n", "--from", "earliest", "-q", "1", "-e", "--exec", 'echo "$(cat)"',
                "--jobs", "2")
    assert res.returncode == 0 and sorted(res.stdout.split()) == [b"%d" % i for i in range(1, 7)]


def test_until_end_over_the_python_client(start_broker) -> None:
    b = start_broker()
    with Client(b.addr) as c:
        c.publish("p", b"x", qos=1)
        sub = c.subscribe("p", start=Start.EARLIEST, until_end=True)
        assert sub.end is not None and sub.end >= 1
        assert [m.payload for m in sub] == [b"x"] and sub.at_end


def test_an_invalid_name_is_exit_7_in_every_command(start_broker) -> None:
    b = start_broker()
    for args in (("unsub", "x", "--group", "x y"), ("sub", "x", "--group", "x y", "-W", "1s"),
                 ("sub", "x", "--group", "g" * 65, "-q", "1", "-W", "1s"),
                 ("unsub", "a/+b", "--group", "g"), ("sub", "a/+b", "-W", "1s"),
                 ("pub", "a/+", "x"), ("pub", "$SYS/x", "x"), ("pub", "a/#", "-l")):
        res = b.cli(*args, input=b"x\n")
        assert res.returncode == Exit.BAD_NAME, (args, res.stderr)
        assert res.stderr.count(b"\n") == 1 and b"Traceback" not in res.stderr, args
    assert b.cli("unsub", "x", "--group", "no-such").returncode == Exit.NOT_FOUND
    # the broker refuses the same names itself, whatever client asks
    with Client(b.addr) as c:
        try:
            c.unsubscribe("x", group="x y")
        except BrokerError as exc:
            assert exc.code == ErrorCode.INVALID_REQUEST
        else:
            raise AssertionError("an invalid group name was not refused")


def test_start_names_the_address_already_in_use(tmp_path: Path) -> None:
    import socket

    from conftest import BLIPMQ

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for flags, what in ((("--bind", f"127.0.0.1:{port}", "--metrics-bind", "127.0.0.1:0"),
                             "client listener"),
                            (("--bind", "127.0.0.1:0", "--metrics-bind", f"127.0.0.1:{port}"),
                             "metrics listener")):
            res = subprocess.run([BLIPMQ, "start", "--data-dir", str(tmp_path / what), *flags],
                                 capture_output=True, timeout=60)
            lines = res.stderr.decode().splitlines()
            assert res.returncode == Exit.INTERNAL, res.stderr
            assert lines[-1] == (f"blipmq: cannot start: Address already in use on "
                                 f"127.0.0.1:{port} (the {what})"), lines
            assert "Traceback" not in res.stderr.decode()
    finally:
        taken.close()


def test_pub_file_with_retain_keeps_the_file_as_the_retained_value(start_broker,
                                                                   tmp_path: Path) -> None:
    b = start_broker()
    blob = tmp_path / "fw.bin"
    blob.write_bytes(bytes(range(256)) * 40)
    assert b.cli("pub", "fw/latest", "-f", str(blob), "-r").returncode == 0
    res = b.cli("sub", "fw/latest", "-N", "-C", "1", "-W", "10s")
    assert res.returncode == 0 and res.stdout == blob.read_bytes(), res.stderr
    blob.write_bytes(b"\xffsecond")
    assert b.cli("pubfile", "fw/latest", str(blob), "--retain", "-q", "1").returncode == 0
    res = b.cli("sub", "fw/latest", "--format", "json", "-e")
    record = json.loads(res.stdout)
    assert record["retained"] is True and record["payload"] == "/3NlY29uZA==", record


def test_pubfile_progress_is_drawn_on_a_terminal_as_bytes_go_out(start_broker,
                                                                   tmp_path: Path) -> None:
    from conftest import BLIPMQ

    b = start_broker()
    blob = tmp_path / "big.bin"
    blob.write_bytes(os.urandom(6 << 20))
    sub = b.spawn("sub", "big", "-N", "-C", "1")
    b.wait_subscribers(1)
    # stderr on a terminal: the bar is drawn there
    status, text = stderr_on_terminal([BLIPMQ, "pubfile", "big", str(blob)], b.env)
    assert status == 0
    assert sub.communicate(timeout=30)[0] == blob.read_bytes()
    percents = {int(p) for p in re.findall(r"(\d{1,3})%", text)}
    assert "sending big.bin" in text, text[-500:]
    assert len(percents & set(range(1, 100))) >= 3, sorted(percents)  # drawn on the way


def test_templates_and_json_carry_the_timestamp(start_broker) -> None:
    b = start_broker()
    before = int(time.time() * 1000)
    b.cli("pub", "ts", "x", "-q", "1")
    after = int(time.time() * 1000)
    res = b.cli("sub", "ts", "--from", "earliest", "-e", "--format", "{timestamp_ms} {timestamp}")
    ms_text, iso = res.stdout.decode().split()
    assert before - 1000 <= int(ms_text) <= after + 1000, (before, ms_text, after)
    assert iso == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(ms_text) // 1000)) + (
        f".{int(ms_text) % 1000:03d}Z")
    res = b.cli("sub", "ts", "--from", "earliest", "-e", "-F", "%I|%p")
    assert res.stdout.decode() == f"{iso}|x\n"
    res = b.cli("sub", "ts", "--from", "earliest", "-e", "--format", "json")
    assert json.loads(res.stdout)["timestamp_ms"] == int(ms_text)


def test_group_backlog_drops_when_the_size_cap_skips_records(start_broker) -> None:
    b = start_broker({"wal": {"segment_bytes": 4096, "retention_bytes": 16384,
                              "maintenance_interval_ms": 100}})
    assert b.cli("sub", "t", "--group", "g", "-q", "1", "-W", "0.2").returncode == Exit.TIMEOUT
    assert b.shell("seq -f '%060g' 1 400 | blipmq pub t -l -q 1").returncode == 0

    def skipped() -> bool:
        return b.metric("blipmq_group_skipped_total", filter="t", group="g") > 0

    deadline = time.monotonic() + 20
    while not skipped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert skipped(), "the size cap never skipped the group's records"
    # the recount runs off the event loop: wait for the figure to settle below the 400
    backlog = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        now = b.metric("blipmq_group_backlog", filter="t", group="g")
        if now == backlog and now < 400:
            break
        backlog = now
        time.sleep(0.3)
    res = b.cli("sub", "t", "--group", "g", "-q", "1", "-e")  # what is really still behind
    behind = len(res.stdout.splitlines())
    assert res.returncode == 0 and 0 < behind < 400, (res.returncode, behind)
    assert backlog == behind
    b.wait_metric("blipmq_group_backlog", 0, filter="t", group="g")

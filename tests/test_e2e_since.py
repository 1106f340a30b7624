"""Replay by time through the real CLI: `sub --from <ISO time>` and `sub --since <duration>`."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from blipmq_cli.exits import Exit


def stamps(out: bytes) -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in out.decode().splitlines()]
    return [(r["payload"], r["timestamp_ms"]) for r in rows]


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def test_from_a_time_and_since_a_duration(start_broker) -> None:
    b = start_broker()
    assert b.shell("seq 1 3 | blipmq pub t --lines -").returncode == 0
    res = b.cli("sub", "t", "--from", "earliest", "--count", "3", "--format", "json")
    first = stamps(res.stdout)
    assert [p for p, _ in first] == ["1", "2", "3"]
    newest = max(ts for _, ts in first)
    while time.time() * 1000 <= newest + 1:  # the next publish gets a later stamp
        time.sleep(0.001)
    assert b.shell("seq 4 6 | blipmq pub t --lines -").returncode == 0
    res = b.cli("sub", "t", "--from", "earliest", "--count", "6", "--format", "json")
    later = [ts for p, ts in stamps(res.stdout) if p in ("4", "5", "6")]
    start = min(later)
    assert start > newest

    res = b.cli("sub", "t", "--from", iso(start).replace("+00:00", "Z"), "--count", "3",
                "--format", "json", "--timeout", "10")
    assert res.returncode == 0, res.stderr
    assert [p for p, _ in stamps(res.stdout)] == ["4", "5", "6"]
    # the same instant written with an offset
    east = datetime.fromtimestamp(start / 1000, UTC).astimezone().isoformat(
        timespec="milliseconds")
    res = b.cli("sub", "t", "--from", east, "--count", "1", "--format", "lines")
    assert res.stdout == b"4\n"
    res = b.cli("sub", "t", "--since", "10m", "--count", "6", "--format", "lines")
    assert res.returncode == 0 and res.stdout.split() == [b"%d" % i for i in range(1, 7)]


def test_bad_times_are_one_line_usage_errors(start_broker) -> None:
    b = start_broker()
    for args in (["--since", "10 parsecs"], ["--from", "2026-11-23T10:00:00"],
                 ["--from", "yesterday"], ["--since", "5m", "--from", "earliest"],
                 ["--since", "-5m"]):
        res = b.cli("sub", "t", *args)
        assert res.returncode == Exit.USAGE, (args, res.stderr)
        assert res.stderr.decode().count("\n") == 1, res.stderr

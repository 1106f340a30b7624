"""`blipmq stats`, `groups`, `ping` and `version` against a real broker, over the protocol."""

from __future__ import annotations

import json
import time

from blipmq_cli.client import Client
from blipmq_cli.exits import Exit
from blipmq_server.protocol import codec


def test_stats_json_reports_topics_groups_and_the_log(start_broker) -> None:
    b = start_broker()
    assert b.shell("seq 1 10 | blipmq pub jobs --qos 1 --lines -").returncode == 0
    assert b.shell("seq 1 4 | blipmq pub other --lines -").returncode == 0
    assert b.cli("pub", "-r", "status/x", "up").returncode == 0
    res = b.cli("sub", "jobs", "--group", "billing", "--qos", "1", "--from", "earliest",
                "--count", "3")
    assert res.returncode == 0, res.stderr
    b.wait_metric("blipmq_group_backlog", 7, filter="jobs", group="billing")
    # the group's acks may still wait to be written with others (docs/ARCHITECTURE.md, the
    # flusher): the log's size is compared once the log has nothing left to write
    b.wait_metric("blipmq_wal_pending_records", 0)
    deadline = time.monotonic() + 10
    while True:
        res = b.cli("stats", "--json")
        assert res.returncode == 0, res.stderr
        report = json.loads(res.stdout)
        if report["log"]["bytes"] == b.metric("blipmq_wal_size_bytes"):
            break  # (a batch taken just before may land between the two reads: ask again)
        assert time.monotonic() < deadline, (report["log"], b.metric("blipmq_wal_size_bytes"))
        time.sleep(0.02)
    topics = {t["topic"]: (t["messages"], t["bytes"], t["retained"]) for t in report["topics"]}
    assert topics == {"jobs": (10, 11, False), "other": (4, 4, False), "status/x": (1, 2, True)}
    (group,) = report["groups"]
    assert (group["filter"], group["group"], group["durable"], group["backlog"]) == (
        "jobs", "billing", True, 7)
    assert report["protocol"] == codec.VERSION and report["version"]
    assert report["uptime_s"] >= 0 and report["connections"] == 1
    assert set(report["drops"]) == {"drop_oldest", "drop_new", "ttl", "no_consumer"}
    assert report["retained"]["topics"] == 1

    res = b.cli("groups", "--json")
    assert json.loads(res.stdout)["groups"] == report["groups"]
    table = b.cli("stats")
    assert table.returncode == 0 and b"billing" in table.stdout and b"status/x" in table.stdout
    assert b"billing" in b.cli("groups").stdout


def test_stats_counts_subscribers_and_in_flight(start_broker) -> None:
    b = start_broker()
    with Client(b.addr) as c:
        plain = c.subscribe("a/#")
        worker = c.subscribe("w", group="g", qos=1, credit=5)
        c.publish_many(("w", b"%d" % i) for i in range(3))
        got = worker.next_batch(5)
        assert got is not None and len(got) == 3
        report = c.stats()
        assert report["subscriptions"] == 2 and report["subscribers"] == 1
        assert report["in_flight"] == 3
        assert plain.sub_id != worker.sub_id


def test_ping_and_version(start_broker) -> None:
    b = start_broker()
    res = b.cli("ping", "--count", "2")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().splitlines()
    assert len(lines) == 2 and all(f"pong from {b.addr}: time=" in line for line in lines)
    res = b.cli("version")
    client_line, broker_line = res.stdout.decode().splitlines()
    assert client_line.startswith("client ") and broker_line.startswith("broker ")
    assert f"(protocol {codec.VERSION})" in broker_line
    info = json.loads(b.cli("version", "--json").stdout)
    assert info["client"] == info["broker"] and info["broker_protocol"] == codec.VERSION


def test_introspection_errors_are_one_line_with_the_documented_code(start_broker) -> None:
    b = start_broker()
    from tests.upstream import free_port

    dead = f"127.0.0.1:{free_port()}"  # a port nobody listens on (of this worker's own)
    for args in (["stats"], ["groups"], ["ping"], ["stats", "--json", "--watch"]):
        res = b.cli(*args, "--addr", dead)
        assert res.returncode == Exit.UNREACHABLE, (args, res.stderr)
        assert res.stderr.decode().count("\n") == 1 and b"Traceback" not in res.stderr
    res = b.cli("version", "--addr", dead)
    assert res.returncode == Exit.UNREACHABLE and res.stdout.startswith(b"client ")
    res = b.cli("ping", "--count", "0")
    assert res.returncode == Exit.USAGE and res.stderr.decode().count("\n") == 1


def test_stats_watch_json_prints_a_line_per_refresh(start_broker) -> None:
    b = start_broker()
    proc = b.spawn("stats", "--watch", "--json", "--interval", "0.1")
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert b.cli("pub", "t", "x").returncode == 0
    for _ in range(100):  # the broker's counts show up in a later refresh
        report = json.loads(proc.stdout.readline())
        if report["messages"]["published"] == 1:
            break
    else:
        raise AssertionError("stats --watch never showed the publish")
    assert first["messages"]["published"] == 0
    proc.kill()
    proc.wait()


def test_stats_fits_the_frame_listing_the_groups_with_most_backlog(start_broker) -> None:
    # h29: with many groups the report outgrew the client's frame limit: `blipmq stats`,
    # `groups` and `bridges` failed ("frame of 325470 bytes exceeds the maximum", exit 3).
    # The smallest frame limit there is (131,372 bytes), and five groups of 40 KB filters
    b = start_broker({"server": {"max_message_bytes": 1, "max_topic_bytes": 65535},
                      "delivery": {"max_batch_bytes": 1024}})
    pad = "p" * 40_000
    with Client(b.addr) as c:
        for i in range(5):
            c.subscribe(f"{i}/{pad}/#", group=f"g{i}", qos=1)
    with Client(b.addr) as c:  # the groups stay, without consumers: g3 has a backlog
        c.publish(f"3/{pad}/x", b"x", qos=1)
    res = b.cli("stats", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    # the topic, then the groups: most backlog first, then by filter
    assert [(g["group"], g["backlog"]) for g in report["groups"]] == [("g3", 1), ("g0", 0)]
    assert report["groups_omitted"] == 3
    assert [t["topic"] for t in report["topics"]] == [f"3/{pad}/x"]
    res = b.cli("groups", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"groups": report["groups"], "groups_omitted": 3}
    res = b.cli("groups")
    assert res.returncode == 0, res.stderr
    assert b"3 more group(s) not listed" in res.stdout
    res = b.cli("stats")
    assert res.returncode == 0 and b"3 more group(s) not listed" in res.stdout, res.stderr
    res = b.cli("bridges")
    assert res.returncode == 0 and res.stdout.startswith(b"no bridges configured"), res.stderr


HOSTILE = ("a/[bold red]FAKE ALERT[/] [link=https://evil.example]docs[/link]",
           "b/\x1b]0;owned\x07\x1b[2J\x1b[Hclear", "c/[/]", "e/\u202etxt.exe", "f/\x9b31m\x7f")
RAW_CONTROLS = ("\x1b", "\x07", "\x9b", "\x7f", "\u202e")


def _literal(text: str) -> str:
    """How a table shows a name: its control characters as escapes."""
    return "".join(ch if ch not in RAW_CONTROLS else f"\\x{ord(ch):02x}" if ord(ch) < 0x100
                   else f"\\u{ord(ch):04x}" for ch in text)


def test_stats_and_groups_show_names_as_literal_text(start_broker) -> None:
    # h29: topic names and filters were read as rich markup and written raw: a publish to
    # 'c/[/]' made `blipmq stats` fail (MarkupError, exit 1), '[link=...]' drew a link,
    # ESC [2J cleared the admin's terminal
    b = start_broker()
    for topic in HOSTILE:
        assert b.cli("pub", topic, "1").returncode == 0
    with Client(b.addr) as c:
        c.subscribe("d/[/]/#", group="g", qos=1)
    wide = {"COLUMNS": "400", "FORCE_COLOR": "", "TTY_COMPATIBLE": ""}
    res = b.cli("stats", **wide)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert not any(ch in out for ch in RAW_CONTROLS), out
    for topic in HOSTILE:
        assert _literal(topic) in out, (topic, out)
    assert "d/[/]/#" in out and "https://evil.example" in out
    res = b.cli("groups", **wide)
    assert res.returncode == 0 and "d/[/]/#" in res.stdout.decode(), res.stderr
    # --json: the exact names, every control character escaped by JSON
    res = b.cli("stats", "--json")
    assert res.returncode == 0, res.stderr
    assert not any(ch in res.stdout.decode() for ch in RAW_CONTROLS)
    assert {t["topic"] for t in json.loads(res.stdout)["topics"]} == set(HOSTILE)
    res = b.cli("groups", "--json")
    assert [g["filter"] for g in json.loads(res.stdout)["groups"]] == ["d/[/]/#"]
    # the log's own view of the topics, likewise
    res = b.cli("wal", "inspect", str(b.data_dir), **wide)
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert not any(ch in out for ch in RAW_CONTROLS)
    assert all(_literal(topic) in out for topic in HOSTILE), out


def test_tables_show_broker_strings_as_literal_text() -> None:
    # what a broker, or an upstream broker a bridge talks to, says: never markup or control
    from rich.console import Console

    from blipmq_cli import introspect

    report = {"broker": "blipmq", "version": "[/]\x1b[2J", "protocol": 2, "uptime_s": 1,
              "connections": 0, "log": None, "retained": {"topics": 0, "bytes": 0},
              "topics": [{"topic": "[/]", "messages": 1, "bytes": 1, "retained": False}],
              "topics_omitted": 0, "groups": [], "groups_omitted": 0,
              "mqtt": {"online": 1, "offline": 0, "inflight": 0, "wills_published": 0,
                       "protocol_errors": {"[bold]x\x1b[H": 1}},
              "bridges": [{"name": "up[/]", "connected": False, "address": "",
                           "backlog_messages": 0, "backlog_bytes": 0, "oldest_age_s": None,
                           "in_flight": 0, "forwarded": 0, "redelivered": 0,
                           "reconnects": 0, "dropped": 0, "dead_lettered": 0,
                           "last_error": "upstream said [link=https://x]\x1b]8;;x\x07"}],
              "bridges_omitted": 0}
    console = Console(width=400, color_system=None, force_terminal=False)
    with console.capture() as got:
        console.print(introspect._render(report, "127.0.0.1:1"))
        console.print(introspect._bridges_table(report))
    out = got.get()
    assert not any(ch in out for ch in RAW_CONTROLS)
    assert "[/]\\x1b[2J" in out and "[bold]x\\x1b[H 1" in out and "up[/]" in out
    assert "upstream said [link=https://x]\\x1b]8;;x\\x07" in out

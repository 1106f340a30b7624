"""SIGHUP reloads the configuration (keys, permissions, log level) and never stops the
broker: a revoked key's connections are closed, the others keep their connections and
subscriptions, a bad new configuration is refused with one line and the old one stays."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import tomlkit

from blipmq_cli.keys import mint
from blipmq_server import config as config_module
from blipmq_server.server.app import Server


def key(name: str, *, publish: tuple[str, ...] = ("#",), subscribe: tuple[str, ...] = ("#",),
        admin: bool = False) -> tuple[str, dict]:
    """A fresh key and its [[auth.keys]] table."""
    text = mint(name, list(publish), list(subscribe), admin)
    secret = text.splitlines()[0]
    table = tomlkit.parse(text.split("\n", 3)[3])["auth"]["keys"][0]
    return secret, dict(table)


def rewrite(b, keys: list[dict], **sections: dict) -> None:
    doc = tomlkit.parse(b.config_path.read_text())
    doc["auth"] = {"keys": keys}
    for name, values in sections.items():
        doc[name] = values
    b.config_path.write_text(tomlkit.dumps(doc))


def test_sighup_revokes_a_key_and_keeps_the_others(start_broker) -> None:
    a, a_table = key("a")
    c, c_table = key("c")
    b = start_broker({"auth": {"keys": [a_table, c_table]}})
    kept = b.spawn("sub", "t", "--count", "2", BLIPMQ_API_KEY=c)
    gone = b.spawn("sub", "t", "--no-reconnect", BLIPMQ_API_KEY=a)
    b.wait_metric("blipmq_subscriptions", 2)
    assert b.cli("pub", "t", "one", BLIPMQ_API_KEY=c).returncode == 0

    rewrite(b, [c_table])  # a is revoked
    b.proc.send_signal(signal.SIGHUP)
    assert "1 connection(s) closed" in b.wait_log("reloaded: keys: 1 (-a)")
    out, err = gone.communicate(timeout=10)
    assert gone.returncode != 0 and b"revoked" in err, err
    assert b.cli("pub", "t", "x", BLIPMQ_API_KEY=a).returncode == 5  # refused from now on
    assert b.metric("blipmq_auth_refused_total", reason="native") >= 1

    assert b.cli("pub", "t", "two", BLIPMQ_API_KEY=c).returncode == 0
    out, err = kept.communicate(timeout=10)  # never disconnected: both messages
    assert (kept.returncode, out) == (0, b"one\ntwo\n"), err
    assert b.metric("blipmq_connections_closed_total", reason="revoked") == 1
    assert b.proc.poll() is None


def test_sighup_changes_permissions_of_open_connections(start_broker) -> None:
    c, c_table = key("c")
    b = start_broker({"auth": {"keys": [c_table]}})
    pub = b.spawn("pub", "-t", "a/1", "--lines", BLIPMQ_API_KEY=c)
    sub = b.spawn("sub", "a/#", "--count", "1", BLIPMQ_API_KEY=c)
    b.wait_metric("blipmq_subscriptions", 1)
    assert pub.stdin is not None
    pub.stdin.write(b"allowed\n")
    pub.stdin.flush()
    out, _ = sub.communicate(timeout=10)
    assert out == b"allowed\n"

    c_table["publish"] = ["b/#"]  # the same key may no longer publish to a/...
    rewrite(b, [c_table])
    b.proc.send_signal(signal.SIGHUP)
    b.wait_log("reloaded: keys: 1 (~c)")
    pub.stdin.write(b"now denied\n")
    pub.stdin.close()
    assert pub.wait(timeout=10) == 5  # the same connection: FORBIDDEN
    assert b"a/1" in pub.stderr.read()  # type: ignore[union-attr]


def test_a_bad_reload_is_refused_and_the_old_config_stays(start_broker) -> None:
    c, c_table = key("c")
    b = start_broker({"auth": {"keys": [c_table]}})
    b.config_path.write_text(b.config_path.read_text() + "\n[log]\nlevel = \"loud\"\n")
    b.proc.send_signal(signal.SIGHUP)
    line = b.wait_log("reload refused")
    assert "log.level" in line
    assert b.cli("pub", "t", "x", BLIPMQ_API_KEY=c).returncode == 0
    b.config_path.write_text("[server\nbroken")
    b.proc.send_signal(signal.SIGHUP)
    b.wait_log("TOML syntax error")  # the second refusal
    assert b.proc.poll() is None and b.cli("ping", BLIPMQ_API_KEY=c).returncode == 0


def test_sighup_without_changes_and_the_log_level(start_broker) -> None:
    b = start_broker()
    b.proc.send_signal(signal.SIGHUP)
    b.wait_log("reloaded: nothing changed")
    doc = tomlkit.parse(b.config_path.read_text())
    doc["log"] = {"level": "debug"}
    doc["queues"] = {"capacity": 10}
    b.config_path.write_text(tomlkit.dumps(doc))
    b.proc.send_signal(signal.SIGHUP)
    line = b.wait_log("log level: info -> debug")
    assert "not applied until a restart: [queues]" in line
    assert b.proc.poll() is None
    assert b.stop() == 0


def test_a_reload_of_a_deeply_nested_file_or_a_fifo_is_refused_and_the_broker_serves(
        start_broker, tmp_path) -> None:
    # regression: a file of arrays nested 1,000 deep raised RecursionError, which the
    # reload did not catch: the broker died with a traceback. A FIFO in the file's place
    # held the event loop in open() until someone wrote to it: nothing was served
    from conftest import BLIPMQ

    b = start_broker()
    kept = b.config_path.read_text()
    b.config_path.write_text("x = " + "[" * 1000 + "]" * 1000 + "\n")
    b.proc.send_signal(signal.SIGHUP)
    assert "nested too deeply" in b.wait_log("reload refused")
    assert b.proc.poll() is None and b.cli("ping").returncode == 0
    # `blipmq start` with that file: exit 2 and one line, no traceback
    done = subprocess.run([BLIPMQ, "start", "--config", str(b.config_path)],
                          capture_output=True, timeout=30)
    assert done.returncode == 2 and b"nested too deeply" in done.stderr, done.stderr
    assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr

    b.config_path.unlink()
    os.mkfifo(b.config_path)
    b.proc.send_signal(signal.SIGHUP)
    started = time.monotonic()
    assert "not a regular file" in b.wait_log("a reload reads the file again")
    assert b.cli("ping").returncode == 0
    assert time.monotonic() - started < 5
    b.config_path.unlink()
    b.config_path.write_text(kept)
    b.proc.send_signal(signal.SIGHUP)
    b.wait_log("reloaded: nothing changed")
    assert b.stop() == 0


def test_a_reload_names_log_format_as_needing_a_restart() -> None:
    # regression: [log] format was taken as applied (``reloaded: nothing changed``) and
    # kept so, while the lines stayed in the old format
    base = {"server.port": 0, "metrics.enabled": False, "wal.enabled": False}
    server = Server(config_module.load(None, env={}, overrides={**base,
                                                                "log.format": "plain"}))
    json = config_module.load(None, env={}, overrides={**base, "log.format": "json"})
    for _ in range(2):  # not applied: said again at the next reload
        assert server.reload(json) == ["not applied until a restart: log.format"]
    assert server.config.log.format == "plain"


def test_keys_new_prints_a_key_once_and_its_hash(tmp_path) -> None:
    from conftest import BLIPMQ

    done = subprocess.run([BLIPMQ, "keys", "new", "hall", "--publish", "sensors/hall/#",
                           "--subscribe", "cmd/hall/#"], capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    secret = text.splitlines()[0]
    assert secret.startswith("bmq_") and text.count(secret) == 1
    table = tomlkit.parse(text.split("\n", 3)[3])["auth"]["keys"][0]
    b2sum = subprocess.run(["b2sum"], input=secret.encode(), capture_output=True, timeout=10)
    assert table["hash"] == "blake2b:" + b2sum.stdout.split()[0].decode()
    assert table["publish"] == ["sensors/hall/#"] and table["admin"] is False
    bad = subprocess.run([BLIPMQ, "keys", "new", "x", "--publish", "a/#/b"],
                         capture_output=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count(b"\n") == 1
    star = subprocess.run([BLIPMQ, "keys", "new", "*"], capture_output=True, timeout=30)
    assert star.returncode == 2 and b"'*'" in star.stderr and star.stdout == b""
    # bytes that are not UTF-8: a stanza no config file could hold was printed
    odd = subprocess.run([BLIPMQ.encode(), b"keys", b"new", b"\xff"], capture_output=True,
                         timeout=30)
    assert odd.returncode == 2 and b"not UTF-8" in odd.stderr and odd.stdout == b"", odd
    helped = subprocess.run([BLIPMQ, "keys", "new", "--help"], capture_output=True,
                            timeout=30, env={**os.environ, "COLUMNS": "200"})
    assert b"only a label" in helped.stdout and b"MQTT username)" not in helped.stdout


def test_a_narrowed_key_loses_the_subscriptions_it_may_no_longer_make(start_broker) -> None:
    c, c_table = key("c")
    b = start_broker({"auth": {"keys": [c_table]}})
    wide = b.spawn("sub", "a/#", "--no-reconnect", BLIPMQ_API_KEY=c)
    fine = b.spawn("sub", "b/x", "--count", "1", BLIPMQ_API_KEY=c)
    b.wait_metric("blipmq_subscriptions", 2)
    c_table["subscribe"] = ["b/#"]
    rewrite(b, [c_table])
    b.proc.send_signal(signal.SIGHUP)
    assert "1 subscription(s) ended" in b.wait_log("reloaded: keys: 1 (~c)")
    _, err = wide.communicate(timeout=10)
    assert wide.returncode == 5 and b"may no longer read 'a/#'" in err, err
    assert b.cli("pub", "b/x", "still", BLIPMQ_API_KEY=c).returncode == 0
    out, _ = fine.communicate(timeout=10)
    assert (fine.returncode, out) == (0, b"still\n")


def test_reloads_under_load_drop_no_connection_of_an_unchanged_key(start_broker) -> None:
    """20 subscribers and a publisher of 3,000 numbered QoS 1 lines on key c while the
    configuration is reloaded 5 times (another key comes and goes): every subscriber gets
    every line, and no connection closes but the revoked key's."""
    c, c_table = key("c")
    b = start_broker({"auth": {"keys": [c_table]}})
    n = 3000
    subs = [b.spawn("sub", "load/#", "--count", str(n), "--no-reconnect", BLIPMQ_API_KEY=c)
            for _ in range(20)]
    b.wait_metric("blipmq_subscriptions", 20)
    pub = b.spawn("pub", "-t", "load/x", "--lines", "-q", "1", BLIPMQ_API_KEY=c)
    assert pub.stdin is not None
    for round_ in range(5):
        pub.stdin.write(b"".join(b"%d\n" % i for i in range(round_ * 600, (round_ + 1) * 600)))
        pub.stdin.flush()
        _, other_table = key(f"other-{round_}")
        rewrite(b, [c_table, other_table] if round_ % 2 == 0 else [c_table])
        b.proc.send_signal(signal.SIGHUP)
        b.wait_log(f"reloaded: keys: {2 if round_ % 2 == 0 else 1} (", timeout=20)
        b.log.clear()  # the next round waits for its own line
    pub.stdin.close()
    assert pub.wait(timeout=60) == 0, pub.stderr.read()  # type: ignore[union-attr]
    want = b"".join(b"%d\n" % i for i in range(n))
    for sub in subs:
        out, err = sub.communicate(timeout=60)
        assert (sub.returncode, out) == (0, want), err[-300:]
    closed = {r: b.metric("blipmq_connections_closed_total", reason=r)
              for r in ("revoked", "reset", "slow_consumer", "protocol_error", "eof")}
    assert closed["revoked"] == closed["reset"] == closed["slow_consumer"] == 0, closed
    assert closed["protocol_error"] == 0, closed

"""bench/compare.py --quick end to end: real brokers (BlipMQ and whichever peers are
installed: scripts/test-deps installs them), real clients in their own processes. Checks the
CSV/JSON have the rows the docs quote and no absent or negative figure; never the speed.
The MQTT rows: BlipMQ's MQTT listener and mosquitto driven by the same clients."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import compare  # bench/ is not a package: on sys.path above

TOP = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_comparison_writes_complete_results(tmp_path: Path) -> None:
    import newer_nats

    peers, _ = compare.ensure_peers(["mosquitto", "nats", "redis"], install=False)
    brokers = ["blipmq", *peers]
    jetstream, why = newer_nats.obtain(may_fetch=True)  # Debian trixie's 2.10, into the cache
    assert jetstream is not None, why
    done = subprocess.run(
        [sys.executable, str(TOP / "bench" / "compare.py"), "--quick", "--no-install",
         "--brokers", ",".join(brokers), "--sizes", "100,4096", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=420,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bench/compare.py" in done.stdout  # the command that reproduces it
    result = json.loads((tmp_path / "results.json").read_text())
    rows = result["rows"]
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    by = {}
    for r in rows:
        by.setdefault((r["workload"], r["broker"]), []).append(r)
    for broker in brokers:
        info = by[("broker", broker)][0]
        assert info["idle_rss_mb"] > 0 and info["peak_rss_mb"] >= info["idle_rss_mb"]
        assert info["startup_ms"] > 0
        for w in ("throughput 1->1", "throughput 1->4"):
            assert sorted(r["size"] for r in by[(w, broker)]) == [100, 4096]
        assert len(by[("latency 2000 msg/s", broker)]) == 1
    for broker in [b for b in brokers if b != "nats"]:  # nats has no CLI pipe tool here
        assert len(by[("CLI pipe", broker)]) == 1
    durable = by[("durable confirmed", "blipmq")]
    assert len(durable) == 2 and all(r["delivered"] == r["messages"] for r in durable)
    if "nats" in peers:
        settings = sorted(r["client"].split(", ")[1] for r in by[("durable confirmed", "nats")])
        assert result["meta"]["jetstream_server"]  # the cached 2.10 ran both settings
        assert settings == ["JetStream default", "JetStream sync always"]
    axes = {"curve subscriptions exact", "curve subscriptions wildcard", "curve topics",
            "curve connections"}
    for broker in brokers:  # every broker on every axis; new-topic resolution is BlipMQ's
        curves = {w for w, b in by if w.startswith("curve") and b == broker}
        assert curves == (axes | {"curve new topic resolve"} if broker == "blipmq" else axes)
    check_mqtt(rows, by, "mosquitto" in peers)
    for r in rows:
        if r["workload"] == "broker":
            continue
        assert r["delivered"] >= 0 and r["lost"] >= 0, r
        assert r["delivered"] + r["lost"] == r["messages"] * max(r["subscribers"], 1), r
        assert r["seconds"] > 0 and r["broker_cpu_s"] >= 0, r
        if not r["workload"].startswith("mqtt idle"):  # connections held: no rate
            assert r["msg_per_s"] > 0, r
        if r["workload"].startswith(("throughput", "latency", "curve", "mqtt paho",
                                     "mqtt latency")) and r["delivered"]:
            assert r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] and r["max_us"] >= r["p99_us"]
        if r["broker"] == "blipmq":
            assert r["lost"] == 0, r  # blocks publishers rather than dropping
    for chart in ("throughput", "latency", "memory", "cpu", "curve"):
        assert (tmp_path / f"{chart}.png").read_bytes()[:4] == b"\x89PNG"
    summary = (tmp_path / "summary.md").read_text()
    assert "| workload | BlipMQ |" in summary
    assert "| MQTT, the same clients for both | BlipMQ (MQTT) | mosquitto |" in summary
    if "mosquitto" in peers:  # a BlipMQ/mosquitto ratio on the C tools' line
        line = next(x for x in summary.splitlines() if x.startswith("| C tools, QoS 0, 100 B"))
        assert re.search(r"\| \d+\.\d\dx \|$", line), line


def check_mqtt(rows: list[dict], by: dict, mosquitto: bool) -> None:
    """The MQTT rows: every workload on both brokers (the sessions' restart on BlipMQ),
    every figure there and not negative."""
    brokers = ["blipmq", "mosquitto"] if mosquitto else ["blipmq"]
    tools = bool(compare.find("mosquitto_pub") and compare.find("mosquitto_sub"))
    traffic = ["mqtt paho 1->1", "mqtt paho 1->4", "mqtt latency 2000 msg/s"]
    traffic += ["mqtt C tools qos0", "mqtt durable qos1"] if tools else []
    for broker in brokers:
        for w in traffic:
            (r,) = by[(w, broker)]
            for key in ("msg_per_s", "seconds", "broker_cpu_s", "cpu_us_per_delivery"):
                assert r[key] is not None and r[key] >= 0, (key, r)
        if tools:
            (dur,) = by[("mqtt durable qos1", broker)]
            assert dur["delivered"] == dur["messages"], dur  # every QoS 1 message confirmed
        held = compare.MQTT["quick"]["idle"]
        (idle,) = by[(f"mqtt idle {held}", broker)]
        assert idle["delivered"] == idle["messages"] == held, idle  # every one connected
        assert idle["dropped"] == 0, idle  # and none closed by the broker
        assert 0 < idle["idle_rss_mb"] <= idle["rss_mb"] <= idle["peak_rss_mb"], idle
        assert idle["cpu_ms_per_s"] >= 0 and idle["kb_per_connection"] >= 0, idle
    sessions = [r for r in rows if r["workload"].startswith("mqtt sessions restore")]
    assert [r["broker"] for r in sessions] == ["blipmq"]
    (s,) = sessions
    assert s["delivered"] == s["messages"] == s["restored"] > 0, s  # all made, all restored
    assert s["resumed"] == s["resume_sample"] > 0, s  # CONNACK: session present
    assert s["startup_ms"] > 0 and s["ready_ms"] > 0 and s["rss_mb"] > 0, s
    assert s["cpu_ms_per_s"] >= 0, s  # idle, every session offline


def test_archive_uri_reads_deb822_and_one_line_sources(tmp_path: Path) -> None:
    import newer_nats

    sources = tmp_path / "debian.sources"
    sources.write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n")
    assert newer_nats.archive_uri(sources, tmp_path / "none") == "http://mirror.example/debian"
    listing = tmp_path / "sources.list"
    listing.write_text("# comment\ndeb http://mirror.example/debian-security bookworm-security "
                       "main\ndeb [arch=amd64] http://mirror.example/debian bookworm main\n")
    assert newer_nats.archive_uri(tmp_path / "none", listing) == "http://mirror.example/debian"
    assert newer_nats.archive_uri(tmp_path / "none", tmp_path / "none") is None


def test_the_latency_floor_bench_forwards_every_message(tmp_path: Path) -> None:
    """bench/floor.py's two forwarders (Trio, plain epoll) and BlipMQ, a short round: each
    row has its figures and nothing was lost (the forwarders must really pass every PUBLISH
    on, or the paho subscriber's count says so). Never the speed."""
    done = subprocess.run(
        [sys.executable, str(TOP / "bench" / "floor.py"), "--kinds", "epoll,trio,blipmq",
         "--rounds", "1", "--count", "300", "--rate", "1000"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ")
            and not line.startswith("| server")}
    assert set(rows) == {"epoll", "trio", "blipmq"}, done.stdout
    for kind, (p50, p99, cpu, ratio, lost) in rows.items():
        assert float(p50.replace(",", "")) > 0 and float(p99.replace(",", "")) > 0, kind
        assert float(cpu.replace(",", "")) >= 0 and ratio == "-", kind
        assert lost == "0", (kind, done.stdout)

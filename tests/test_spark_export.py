"""The ``blipmq-wal`` source, the analytics and the export on one shared local Spark session,
over dumps made by real broker runs (``fleet.drive``, dumped while the broker runs)."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import kill_brokers, launch_broker
from fleet import CONFIG, Published, drive
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from spark_tools import analytics
from spark_tools.job import ExportOptions, export, session, spark_log
from spark_tools.source import DDL, read_wal

DEVICES = ("pi-1", "pi-2", "gw-3")

# One worker runs every Spark test (pytest-xdist, make test): they share one local Spark
# session and the module fixtures' broker runs, and three JVMs at once would only fight for the
# two cores.
pytestmark = pytest.mark.xdist_group("spark")


@pytest.fixture(scope="session")
def spark() -> SparkSession:
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    s = session("local[2]", (("spark.sql.shuffle.partitions", "2"),), spark_log())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[Path, dict[str, Published]]:
    """Dumps of three devices, one directory per device, each taken while its broker ran."""
    where = tmp_path_factory.mktemp("fleet")
    dumps = where / "dumps"
    started: list = []
    sent = {}
    try:
        for i, device in enumerate(DEVICES):
            b = launch_broker(where, started, CONFIG)
            sent[device] = drive(b, device, readings=20 + 10 * i, orders=5 + i, alerts=1 + i)
            res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out",
                        str(dumps / device), "--device-id", device)
            assert res.returncode == 0, res.stderr
            assert b.stop() == 0
    finally:
        kill_brokers(started)
    return dumps, sent


def test_filter_matching_follows_the_broker(spark) -> None:
    cases = [("a/+/c", "a/b/c", True), ("a/+/c", "a/b/d", False), ("a/#", "a", True),
             ("a/#", "a/b/c", True), ("#", "x/y", True), ("#", "$dlq/x", False),
             ("+/x", "$dlq/x", False), ("$dlq/#", "$dlq/alerts", True), ("a", "a/b", False),
             ("a/b", "a/b", True), ("+", "a/b", False)]
    df = spark.createDataFrame([(f, t) for f, t, _ in cases], "f string, t string")
    got = df.select(analytics.filter_matches("f", "t").alias("m")).collect()
    assert [r.m for r in got] == [want for _, _, want in cases]


def _records(spark, rows: list[dict]):
    cols = [c.split(" ")[0] for c in DDL.split(", ")]
    return spark.createDataFrame([tuple(r.get(c) for c in cols) for r in rows], DDL)


def test_analytics_on_a_tiny_frame(spark) -> None:
    from datetime import UTC, datetime

    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    base = {"device": "d", "segment": "s", "position": 0, "timestamp": t}
    m = {**base, "kind": "message", "qos": 1, "ttl_ms": 0}
    rows = [
        {**base, "kind": "group", "offset": 1, "topic": "jobs/#", "group_name": "g",
         "group_op": "create", "group_start": 1},
        {**m, "offset": 2, "topic": "jobs/a", "payload": b"x" * 10, "payload_size": 10},
        {**m, "offset": 3, "topic": "jobs/b", "payload": b"y" * 30, "payload_size": 30},
        {**m, "offset": 4, "topic": "other", "payload": b"z", "payload_size": 1},
        {**m, "offset": 5, "topic": "jobs/a", "payload": b"w" * 10, "payload_size": 10},
        {**base, "kind": "ack", "offset": 6, "group_id": 1, "ack_floor": 3, "acked": [2]},
        {**m, "offset": 7, "topic": "$dlq/jobs/b", "payload": b"y" * 30, "payload_size": 30,
         "dead_deliveries": 2, "dead_reason": "nacked"},
        {**base, "kind": "damage", "position": 99, "payload_size": 40, "problem": "CRC"},
    ]
    df = _records(spark, rows)
    traffic = {(r.topic): r for r in analytics.traffic(df).collect()}
    assert traffic["jobs/a"].messages == 2 and traffic["jobs/a"].bytes == 20
    assert traffic["jobs/b"].size_p50 == 30 and traffic["other"].qos1 == 1
    (g,) = analytics.groups(df).collect()
    # published to it: offsets 2, 3, 5; acked: 2; floor 3: offsets 3 and 5 are pending
    assert (g.group_name, g.published, g.acked, g.lag) == ("g", 3, 1, 2)
    (dead,) = analytics.dead_letters(df).collect()
    assert (dead.topic, dead.reason, dead.messages) == ("$dlq/jobs/b", "nacked", 1)
    (dev,) = analytics.devices(df).collect()
    assert (dev.messages, dev.bytes, dev.topics, dev.last_offset) == (5, 81, 4, 7)
    (dmg,) = analytics.damage(df).collect()
    assert (dmg.parts, dmg.bytes) == (1, 40)
    assert {r.size_up_to: r.messages for r in analytics.sizes(df).collect()} == {
        16: 2, 32: 2, 1: 1}
    (rate,) = analytics.rates(df).collect()
    assert rate.messages == 5


@pytest.mark.slow
def test_export_counts_what_was_published(spark, fleet, tmp_path) -> None:
    dumps, sent = fleet
    out = tmp_path / "out"
    done = export(spark, ExportOptions((str(dumps),), str(out)))
    assert done.devices == 3 and done.damaged_parts == 0
    traffic = {(r["device"], r["topic"]): r for r in done.aggregates["traffic"]}
    want = {(d, t): (n, p.payload_bytes[t]) for d, p in sent.items() for t, n in p.counts.items()}
    assert {k: (r["messages"], r["bytes"]) for k, r in traffic.items()} == want
    groups = {(r["device"], r["group_name"]): r for r in done.aggregates["groups"]}
    for device, p in sent.items():
        billing = groups[(device, "billing")]
        assert billing["published"] == billing["acked"] == p.counts["orders"]
        assert billing["lag"] == 0 and billing["filter"] == "orders"
        pager = groups[(device, "pager")]
        assert pager["published"] == p.counts["alerts"] and pager["lag"] == 0
    dead = {(r["device"], r["topic"], r["reason"]): r["messages"]
            for r in done.aggregates["dead_letters"]}
    assert dead == {(d, "$dlq/alerts", "nacked"): p.dead for d, p in sent.items()}
    # the Parquet round trip: every message, byte for byte, by date and device
    back = spark.read.parquet(str(out / "records"))
    assert {f.name for f in back.schema} >= {"date", "device", "topic", "payload", "offset"}
    got = Counter((r.device, r.topic) for r in back.where("kind = 'message'")
                  .select("device", "topic").collect())
    assert got == Counter({k: n for k, (n, _) in want.items()})
    orders = sorted(bytes(r.payload) for r in back.where(
        "kind = 'message' AND topic = 'orders' AND device = 'pi-2'").collect())
    assert orders == sorted(f"order-pi-2-{i:04d}".encode() for i in range(sent["pi-2"]
                                                                      .counts["orders"]))
    days = [p.name for p in (out / "records").iterdir() if p.name.startswith("date=")]
    assert days and all(
        sorted(q.name for q in (out / "records" / day).iterdir())
        <= sorted(f"device={d}" for d in DEVICES) for day in days)
    # re-exporting one device replaces its partitions only: nothing doubles, nothing is lost
    again = export(spark, ExportOptions((str(dumps / "pi-1"),), str(out)))
    assert again.devices == 3
    assert again.aggregates["traffic"] and sorted(
        (r["device"], r["topic"], r["messages"]) for r in again.aggregates["traffic"]) == sorted(
        (d, t, n) for (d, t), (n, _) in want.items())
    back = spark.read.parquet(str(out / "records"))
    assert back.where("kind = 'message'").count() == sum(n for n, _ in want.values())


@pytest.mark.slow
def test_a_corrupted_segment_exports_every_good_record(spark, fleet, tmp_path) -> None:
    dumps, _ = fleet
    bad = tmp_path / "pi-1"
    shutil.copytree(dumps / "pi-1", bad)
    seg = sorted((bad / "wal").iterdir())[0]
    data = bytearray(seg.read_bytes())
    data[200] ^= 0xFF  # inside an early record
    seg.write_bytes(bytes(data))
    whole = spark.read.format("blipmq-wal").load(str(dumps / "pi-1"))
    hurt = spark.read.format("blipmq-wal").load(str(bad))
    lost = whole.join(hurt, ["offset"], "left_anti").collect()
    assert len(lost) == 1  # the one damaged record, and only it
    done = export(spark, ExportOptions((str(bad),), str(tmp_path / "out")))
    assert done.damaged_parts == 1 and done.damaged_bytes > 0
    (dmg,) = done.aggregates["damage"]
    assert dmg["device"] == "pi-1" and dmg["first_problem"] == "CRC mismatch"
    assert done.rows == whole.count() - 1


def test_sql_view_in_a_new_session_without_register(spark, fleet) -> None:
    dumps, sent = fleet
    other = spark.newSession()
    other.sql(f"CREATE TEMPORARY VIEW w USING `blipmq-wal` OPTIONS (path '{dumps}')")
    got = {(r.device, r.n) for r in other.sql(
        "SELECT device, count(*) AS n FROM w WHERE kind = 'message' GROUP BY device").collect()}
    assert got == {(d, sum(p.counts.values())) for d, p in sent.items()}


def test_every_reader_decodes_the_same(spark, fleet) -> None:
    """The data source, the export's own tasks and the binaryFile fallback."""
    dumps, _ = fleet
    cols = ["device", "offset", "kind", "topic", "payload", "dead_reason", "group_name"]
    direct = read_wal(spark, [str(dumps)], via="source").select(*cols)
    tasks = read_wal(spark, [str(dumps)], via="tasks", partition_bytes=1)
    segments = sum(len(os.listdir(dumps / d / "wal")) for d in DEVICES)
    assert tasks.rdd.getNumPartitions() == segments
    tasks = tasks.select(*cols)
    fallback = read_wal(spark, [f"file://{dumps}"], via="binaryFile").select(*cols)
    assert direct.count() == tasks.count() == fallback.count() > 0
    assert direct.exceptAll(fallback).count() == 0
    assert direct.exceptAll(tasks).count() == 0 and tasks.exceptAll(direct).count() == 0


def test_one_partition_per_segment_group(spark, fleet) -> None:
    dumps, _ = fleet
    segments = sum(len(os.listdir(dumps / d / "wal")) for d in DEVICES)
    one = spark.read.format("blipmq-wal").option("partitionBytes", "1").load(str(dumps))
    assert one.rdd.getNumPartitions() == segments
    grouped = spark.read.format("blipmq-wal").load(str(dumps))
    assert grouped.rdd.getNumPartitions() == 1
    assert one.count() == grouped.count()
    manifests = [json.loads((dumps / d / "manifest.json").read_text()) for d in DEVICES]
    assert grouped.where(F.col("kind") != "damage").count() == sum(
        m["records"] for m in manifests)


@pytest.mark.slow
def test_mqtt_published_data_reads_and_exports_like_native(spark, tmp_path) -> None:
    """What MQTT clients publish (every QoS, retained, empty levels, UTF-8 names, an empty
    payload) is in the dump as ordinary message records beside the native CLI's, and a
    persistent MQTT session's saved state reads as ``state`` records, not as damage."""
    from mqttpeer import mosquitto

    started: list = []
    try:
        b = launch_broker(tmp_path, started, {"mqtt": {"enabled": True, "port": 0}})
        # a persistent session with a QoS 1 subscription: its state goes into the log
        res = mosquitto("mosquitto_sub", b.mqtt_port, "-i", "spark-keeper", "-c", "-q", "1",
                        "-t", "plant/#", "-E")
        assert res.returncode == 0, res.stderr
        sent = {("plant/a", 0): [b"zero-1", b"zero-2"], ("/plant//b", 1): [b"one"],
                ("plant/\u00fcml\u00e4ut", 2): ["gr\u00fc\u00dfe".encode()],
                ("plant/empty", 1): [b""]}
        for (topic, qos), payloads in sent.items():
            for p in payloads:
                res = mosquitto("mosquitto_pub", b.mqtt_port, "-q", str(qos), "-t", topic,
                                *(("-m", p.decode()) if p else ("-n",)))
                assert res.returncode == 0, res.stderr
        res = mosquitto("mosquitto_pub", b.mqtt_port, "-q", "1", "-r", "-t", "plant/state",
                        "-m", "on")
        assert res.returncode == 0, res.stderr
        res = b.cli("pub", "-q", "1", "plant/native", "from-the-cli")
        assert res.returncode == 0, res.stderr
        dump = tmp_path / "dump"
        res = b.cli("wal", "dump", "--data-dir", str(b.data_dir), "--out", str(dump),
                    "--device-id", "gw-mqtt")
        assert res.returncode == 0, res.stderr
        assert b.stop() == 0
    finally:
        kill_brokers(started)
    # a QoS 2 publish is a QoS 1 message to the export (docs/MQTT.md)
    want = Counter({(t, min(q, 1), p): 1 for (t, q), ps in sent.items() for p in ps})
    want[("plant/state", 1, b"on")] += 1
    want[("plant/native", 1, b"from-the-cli")] += 1
    df = read_wal(spark, [str(dump)])
    assert df.where("kind = 'damage'").count() == 0
    got = Counter((r.topic, r.qos, bytes(r.payload)) for r in df.where(
        "kind = 'message'").select("topic", "qos", "payload").collect())
    assert got == want
    assert df.where("kind = 'state'").count() >= 1  # the persistent session
    done = export(spark, ExportOptions((str(dump),), str(tmp_path / "out")))
    assert done.devices == 1 and done.damaged_parts == 0
    traffic = {r["topic"]: r["messages"] for r in done.aggregates["traffic"]}
    assert traffic == dict(Counter(t for (t, _, _), n in want.items() for _ in range(n)))


@pytest.mark.slow
def test_damage_the_export_crashed_on_or_missed_is_reported(spark, fleet, tmp_path) -> None:
    """D03: a CRC-valid record whose payload length runs past it crashed the decoder
    (SIGSEGV, the whole export failed). D04: a dump's segment cut short was "no damage" on
    the binaryFile path (hdfs://, s3a://) and a few bytes locally. D13: logs holding only
    damage exported with exit 0."""
    import struct

    from blipmq_server.errors import WalError
    from blipmq_server.wal import reader
    from blipmq_server.wal import record as rec

    dumps, _ = fleet
    work = tmp_path / "dumps"
    shutil.copytree(dumps, work)
    seg = sorted((work / "pi-1" / "wal").glob("*.seg"))[-1]
    data = seg.read_bytes()
    checked = reader.check(data, seg.name)
    offset, pos = [(o, p) for o, p in checked.records
                   if data[p + 8] == rec.Kind.MESSAGE][-1]
    record, end = rec.decode_at(data, pos)
    poison = struct.pack(">BIHHI", 1, 0, 1, 0, 0xFFFFFFFF) + b"tx"
    seg.write_bytes(data[:pos] + rec.encode(record.kind, offset, record.timestamp_ms, poison)
                    + data[end:])
    cut = sorted((work / "pi-2" / "wal").glob("*.seg"))[-1]
    whole = cut.read_bytes()
    cut.write_bytes(whole[:len(whole) // 2])
    for via in ("tasks", "binaryFile"):
        rows = (read_wal(spark, [str(work)], via=via).where(F.col("kind") == "damage")
                .select("device", "problem", "payload_size").collect())
        problems = {(r.device, r.problem.split(" (")[0].split(":")[0]) for r in rows}
        assert ("pi-1", f"MESSAGE record {offset} cannot be read") in problems, (via, rows)
        assert ("pi-2", "segment cut short") in problems, (via, rows)
        short = [r for r in rows
                 if r.device == "pi-2" and r.problem.startswith("segment cut short")]
        assert short[0].payload_size == len(whole) - len(whole) // 2, (via, rows)
    empty = tmp_path / "empty" / "wal"
    empty.mkdir(parents=True)
    (empty / "00000000000000000001.seg").write_bytes(b"junk" * 10)
    (empty / "00000000000000000009.seg").write_bytes(os.urandom(100))
    with pytest.raises(WalError, match="hold no records"):
        export(spark, ExportOptions((str(tmp_path / "empty"),), str(tmp_path / "out")))


def test_a_group_deleted_and_created_again_is_two_instances(spark) -> None:
    """h30 #1: a DELETE names a group by filter and name; it ends the instance live then, and
    nothing after it counts for that instance (each DELETE joined every instance of the name
    before: 2 instances made 4 rows, the live one showed deleted, published ran on)."""
    from datetime import UTC, datetime

    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    base = {"device": "d", "segment": "s", "position": 0}
    m = {**base, "kind": "message", "qos": 1, "ttl_ms": 0, "topic": "t", "payload_size": 1}
    g = {**base, "kind": "group", "topic": "t", "group_name": "g"}

    def at(o: int) -> dict:
        return {"offset": o, "timestamp": t.replace(second=o)}

    rows = [
        {**g, **at(1), "group_op": "create", "group_start": 1},
        {**m, **at(2)},
        {**base, **at(3), "kind": "ack", "group_id": 1, "ack_floor": 3, "acked": [2]},
        {**g, **at(4), "group_op": "delete"},
        {**m, **at(5)},  # after the delete, before the next create: nobody's
        {**g, **at(6), "group_op": "create", "group_start": 6},
        {**m, **at(7)},
        {**g, **at(8), "group_op": "idle"},
        {**m, **at(9)},
        {**g, **at(10), "group_op": "delete"},
        {**m, **at(11)},
        {**g, **at(12), "group_op": "create", "group_start": 12},
        {**m, **at(13)},
    ]
    got = {r.group_id: r for r in analytics.groups(_records(spark, rows)).collect()}
    assert sorted(got) == [1, 6, 12]
    one, two, live = got[1], got[6], got[12]
    assert (one.published, one.acked, one.lag) == (1, 1, 0)
    assert one.deleted == t.replace(second=4).replace(tzinfo=None)
    assert (two.published, two.acked, two.lag) == (2, 0, 0)  # 7 and 9; deleted: no lag
    assert two.deleted == t.replace(second=10).replace(tzinfo=None)
    assert (live.published, live.lag, live.deleted) == (1, 1, None)
    assert live.created == t.replace(second=12).replace(tzinfo=None)


# ------------------------------------------------------------- h30: forged logs and dumps

T0 = 1_795_740_000_000  # 2026-11-27 00:40 UTC


def _message(topic: str, payload: bytes) -> bytes:
    from blipmq_server.protocol import message as msg

    t = topic.encode()
    return msg.MSG_HEAD.pack(msg.FLAG_QOS1, 0, len(t), 0, len(payload)) + t + payload


def _log(data_dir: Path, records: list[tuple[int, bytes]], first: int = 1) -> Path:
    """A data directory with one segment of ``records`` (kind, body), offsets from
    ``first``, a second apart."""
    from blipmq_server.wal import record as rec

    wal = data_dir / "wal"
    wal.mkdir(parents=True, exist_ok=True)
    seg = wal / f"{first:020d}.seg"
    seg.write_bytes(rec.header(first) + b"".join(
        rec.encode(kind, first + i, T0 + 1000 * i, body) for i, (kind, body) in
        enumerate(records)))
    return seg


def _dump(data_dir: Path, out: Path, device: str) -> Path:
    from blipmq_cli import dump

    dump.dump(str(data_dir), str(out), device_id=device)
    return out


def _messages(n: int, topic: str = "t") -> list[tuple[int, bytes]]:
    return [(1, _message(topic, b"m%03d" % i)) for i in range(n)]


def test_create_rows_carry_their_group_id(tmp_path) -> None:
    """h30 #15: a GROUP create row's group_id is the group's id (its offset), as the schema
    says; delete and idle rows name the group by filter and name only."""
    from blipmq_server.broker import durable
    from blipmq_server.wal import reader
    from spark_tools.batches import segment_batches

    seg = _log(tmp_path, [(2, durable.group_body(durable.CREATE, 1, "t", "g")),
                          *_messages(2),
                          (3, durable.ack_body(1, 3, [2])),
                          (2, durable.group_body(durable.DELETE, 0, "t", "g"))])
    data = seg.read_bytes()
    (batch,) = segment_batches(data, reader.check(data, seg.name), "d", seg.name)
    rows = batch.to_pylist()
    assert [(r["kind"], r["group_op"], r["group_id"]) for r in rows] == [
        ("group", "create", 1), ("message", None, None), ("message", None, None),
        ("ack", None, 1), ("group", "delete", None)]


def test_reads_stop_at_the_sizes_planned(tmp_path) -> None:
    """h30 #4: one plan is one snapshot: records appended after planning (a live data
    directory) are not read, however often the plan is read."""
    from spark_tools.source import plan, read_pieces

    seg = _log(tmp_path / "data", _messages(5))
    groups = plan([str(tmp_path / "data")])
    from blipmq_server.wal import record as rec

    with open(seg, "ab") as f:  # the broker goes on writing
        f.write(rec.encode(1, 6, T0 + 9000, _message("t", b"late")))
    offsets = [o for g in groups for b in read_pieces(g) for o in b.column("offset").to_pylist()]
    assert offsets == [1, 2, 3, 4, 5]


def test_damage_counted_by_the_dump_becomes_rows(spark, tmp_path) -> None:
    """h30 #5: ``wal dump`` does not copy damaged bytes but counts them in its manifest;
    that count reaches the data as damage rows (both readers) and the export's figures."""
    seg = _log(tmp_path / "data", _messages(20))
    data = bytearray(seg.read_bytes())
    data[300] ^= 0xFF
    seg.write_bytes(bytes(data))
    dump = _dump(tmp_path / "data", tmp_path / "dumps" / "dev", "dev")
    damaged = json.loads((dump / "manifest.json").read_text())["damaged_bytes"]
    assert damaged > 0
    for via in ("tasks", "binaryFile"):
        path = str(dump) if via == "tasks" else f"file://{dump}"
        rows = read_wal(spark, [path], via=via).where("kind = 'damage'").collect()
        assert [(r.device, r.payload_size) for r in rows] == [("dev", damaged)], via
        assert "not copied" in rows[0].problem
    done = export(spark, ExportOptions((str(dump),), str(tmp_path / "out")))
    assert (done.damaged_parts, done.damaged_bytes) == (1, damaged)
    (row,) = done.aggregates["damage"]
    assert (row["device"], row["bytes"]) == ("dev", damaged)


def test_a_log_given_twice_or_two_logs_of_one_device_are_refused(tmp_path) -> None:
    """h30 #6: the same dump through two paths doubled every record; two dumps naming one
    device merged into one."""
    from blipmq_server.errors import WalError
    from spark_tools.source import plan

    _log(tmp_path / "a", _messages(3))
    _log(tmp_path / "b", _messages(3))
    dumps = tmp_path / "dumps"
    _dump(tmp_path / "a", dumps / "one", "dev")
    _dump(tmp_path / "b", tmp_path / "other", "dev")
    with pytest.raises(WalError, match="given twice"):
        plan([str(dumps), str(dumps / "one")])
    with pytest.raises(WalError, match="two logs of device 'dev'"):
        plan([str(dumps), str(tmp_path / "other")])
    assert len(plan([str(dumps)])) == 1


@pytest.mark.parametrize("device_id", ["", "  ", None, "a\nb"])
def test_a_device_id_that_names_no_device_is_refused(tmp_path, device_id) -> None:
    """h30 #12: an empty device_id was written as __HIVE_DEFAULT_PARTITION__ (a null
    device), after which every export into that output failed sorting devices."""
    from blipmq_server.errors import WalError
    from spark_tools.source import plan

    _log(tmp_path / "a", _messages(3))
    dump = _dump(tmp_path / "a", tmp_path / "dump", "dev")
    manifest = json.loads((dump / "manifest.json").read_text())
    manifest["device_id"] = device_id
    (dump / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(WalError, match="device_id"):
        plan([str(dump)])


def test_summary_and_report_take_a_null_device() -> None:
    """h30 #12: an output poisoned by an old export (device null) still shows."""
    from datetime import UTC, datetime

    from spark_tools import report, summary
    from spark_tools.job import Exported

    t = datetime(2026, 11, 27, 0, 40, tzinfo=UTC)
    dev = {"messages": 1, "bytes": 1, "topics": 1, "first_seen": t, "last_seen": t}
    traffic = {"topic": "t", "messages": 1, "bytes": 1, "size_p50": 1, "size_p95": 1,
               "size_p99": 1}
    grp = {"group_name": "g", "filter": "t", "published": 1, "acked": 1, "lag": 0,
           "deleted": None}
    agg = {"devices": [{**dev, "device": None}, {**dev, "device": "a"}],
           "traffic": [{**traffic, "device": None}, {**traffic, "device": "a"}],
           "rates": [{"device": None, "minute": t, "messages": 1},
                     {"device": "a", "minute": t, "messages": 1}],
           "sizes": [], "groups": [{**grp, "device": None}, {**grp, "device": "a"}],
           "dead_letters": [{"device": None, "topic": "t", "reason": "r", "messages": 1},
                            {"device": "a", "topic": "t", "reason": "r", "messages": 1}],
           "damage": []}
    done = Exported(2, 0, 0, 2, agg)
    summary.show(done, "out")
    assert "device" in report.render(done)


def test_load_takes_a_list_of_paths_and_paths_with_commas(spark, tmp_path) -> None:
    """h30 #9: ``load([a, b])`` passes a JSON array in ``paths``; it was split on commas,
    as was one path holding a comma."""
    _log(tmp_path / "a", _messages(3))
    _log(tmp_path / "b", _messages(4))
    a = _dump(tmp_path / "a", tmp_path / "x,y" / "one", "one")
    b = _dump(tmp_path / "b", tmp_path / "two", "two")
    both = spark.read.format("blipmq-wal").load([str(a), str(b)])
    assert both.where("kind = 'message'").count() == 7
    assert spark.read.format("blipmq-wal").load(str(a)).count() == 3
    assert spark.read.format("blipmq-wal").load(str(tmp_path / "x,y")).count() == 3
    assert read_wal(spark, [str(a), str(b)], via="source").count() == 7


def test_binary_file_path_skips_files_not_named_after_an_offset(spark, tmp_path) -> None:
    """h30 #10: a copy ``...1.bak.seg`` beside its segment was read twice by the binaryFile
    path (hdfs://, s3a://); the local reader reports it and does not read it."""
    seg = _log(tmp_path / "d0", _messages(10))
    shutil.copy(seg, seg.with_name(seg.stem + ".bak.seg"))
    got = {}
    for via in ("tasks", "binaryFile"):
        df = read_wal(spark, [f"file://{tmp_path / 'd0'}"], via=via)
        got[via] = sorted((r.kind, r.segment, r.problem) for r in df.where(
            "kind = 'damage' OR offset = 1").collect())
        assert df.where("kind = 'message'").count() == 10, via
    assert got["tasks"] == got["binaryFile"]
    assert any(p and "not named after an offset" in p for _, _, p in got["binaryFile"])


def test_a_re_export_replaces_every_aggregate_of_the_device(spark, tmp_path) -> None:
    """h30 #3: the device's old damage, groups and dead letters stayed after a re-export
    from a clean dump (dynamic overwrite replaces only the partitions written); also #16:
    what a killed export left (``.spark-staging-*``) is cleaned up by the next one, and #13:
    timestamps are Parquet INT64 microseconds marked UTC, not INT96."""
    import pyarrow.parquet as pq

    from blipmq_server.broker import durable

    seg = _log(tmp_path / "bad", [(2, durable.group_body(durable.CREATE, 1, "t", "g")),
                                  *_messages(20)])
    data = bytearray(seg.read_bytes())
    data[500] ^= 0xFF
    seg.write_bytes(bytes(data))
    _log(tmp_path / "good", _messages(5))
    _log(tmp_path / "other", [(2, durable.group_body(durable.CREATE, 1, "t", "h")),
                              *_messages(2)])
    bad = _dump(tmp_path / "bad", tmp_path / "bad-dump", "dev")
    good = _dump(tmp_path / "good", tmp_path / "good-dump", "dev")
    other = _dump(tmp_path / "other", tmp_path / "other-dump", "other")
    out = tmp_path / "out"
    first = export(spark, ExportOptions((str(bad), str(other)), str(out)))
    assert {r["device"] for r in first.aggregates["damage"]} == {"dev"}
    assert {r["device"] for r in first.aggregates["groups"]} == {"dev", "other"}
    left = [out / "records" / ".spark-staging-0f0f", out / "aggregates" / "traffic" /
            ".spark-staging-1e1e"]
    for path in left:  # as an export killed while writing leaves them
        (path / "device=dev").mkdir(parents=True)
    again = export(spark, ExportOptions((str(good),), str(out)))
    assert again.aggregates["damage"] == []
    assert {r["device"] for r in again.aggregates["groups"]} == {"other"}
    assert {(r["device"], r["messages"]) for r in again.aggregates["devices"]} == {
        ("dev", 5), ("other", 2)}
    assert not any(path.exists() for path in left)
    assert not list(out.rglob(".replaced-*"))
    one = next((out / "records").rglob("*.parquet"))
    assert pq.read_schema(one).field("timestamp").type == pa.timestamp("us", tz="UTC")


def test_times_read_back_are_utc_whatever_the_local_zone(spark, tmp_path, monkeypatch) -> None:
    """h30 #8: ``collect`` gives naive local times; the report labelled them UTC."""
    import time
    from datetime import UTC, datetime

    from spark_tools import report
    from spark_tools.job import read_back

    _log(tmp_path / "a", _messages(3))
    dump = _dump(tmp_path / "a", tmp_path / "dump", "dev")
    export(spark, ExportOptions((str(dump),), str(tmp_path / "out")))
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        agg = read_back(spark, str(tmp_path / "out"))
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    (dev,) = agg["devices"]
    assert dev["first_seen"] == datetime(2026, 11, 27, 0, 40, tzinfo=UTC)
    assert report.line_chart({"dev": [(r["minute"], r["messages"]) for r in agg["rates"]]},
                             "m").count("2026-11-27 00:40 UTC") == 1
    assert report.when(dev["last_seen"]) == "2026-11-27 00:40:02 UTC"


def test_a_failed_job_says_its_root_cause(spark, tmp_path) -> None:
    """h30 #11: the first line of a Py4JJavaError is "An error occurred while calling
    o99.parquet."; the cause is at the end of the Java exception chain."""
    from spark_tools.job import first_line

    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception) as caught:
        spark.range(1).write.parquet(str(tmp_path / "file" / "out"))
    line = first_line(caught.value)
    assert "An error occurred while calling" not in line
    assert "not a directory" in line.lower() or "mkdirs" in line.lower(), line


# ------------------------------------------------- h32: kills, numeric device ids, full disk

TRAFFIC = Path("aggregates") / "traffic"
HIDDEN = (".replaced-", ".new-", ".spark-staging-")


def _traffic(spark, out: Path) -> dict[str, int]:
    from spark_tools.job import read_back

    return {r["device"]: r["messages"] for r in read_back(spark, str(out))["traffic"]}


def _leftovers(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.startswith(HIDDEN)]


@pytest.fixture(scope="module")
def outputs(spark, tmp_path_factory) -> tuple[Path, Path, dict[str, Path]]:
    """An output of devA (5 messages) and devB (2), and the same output after devA was
    exported again (7 messages)."""
    where = tmp_path_factory.mktemp("outputs")
    dumps = {}
    for name, device, n in (("a-old", "devA", 5), ("a-new", "devA", 7), ("b", "devB", 2)):
        _log(where / name, _messages(n))
        dumps[name] = _dump(where / name, where / "dumps" / name, device)
    old = where / "old"
    export(spark, ExportOptions((str(dumps["a-old"]), str(dumps["b"])), str(old)))
    new = where / "new"
    shutil.copytree(old, new)
    export(spark, ExportOptions((str(dumps["a-new"]),), str(new)))
    assert _traffic(spark, old) == {"devA": 5, "devB": 2}
    assert _traffic(spark, new) == {"devA": 7, "devB": 2}
    return old, new, dumps


def _killed(old: Path, new: Path, at: Path, point: str) -> Path:
    """``old`` as a re-export of devA killed at ``point`` leaves it (``new``: where that
    export would have got to); the kill hit while ``aggregates/traffic`` was replaced."""
    shutil.copytree(old, at)
    table = at / TRAFFIC
    place, aside, staged = (table / "device=devA", table / ".replaced-dead" / "device=devA",
                            table / ".new-dead")
    fresh = new / TRAFFIC / "device=devA"
    aside.parent.mkdir()
    if point == "aside made":  # between the mkdirs and the rename
        return at
    place.rename(aside)  # the old partition set aside...
    if point == "set aside":
        return at
    if point == "writing":  # ...the new one half written, in the write's own directories
        (staged / "_temporary" / "0" / "task_1" / "device=devA").mkdir(parents=True)
        (staged / "device=devA").mkdir(parents=True)
        (table / ".spark-staging-0f0f" / "device=devA").mkdir(parents=True)  # older exports'
        for part in fresh.glob("*.parquet"):
            shutil.copy(part, staged / "_temporary" / "0" / "task_1" / "device=devA")
            (staged / "device=devA" / part.name).write_bytes(part.read_bytes()[:100])
        return at
    shutil.copytree(fresh, place)  # ...the new one renamed into its place
    staged.mkdir()
    (staged / "_SUCCESS").write_bytes(b"")
    if point == "swapped in":
        return at
    (aside.parent / "_written").write_bytes(b"")
    for part in aside.glob("*.parquet"):  # the old one partly deleted
        part.unlink()
        break
    assert point == "dropping", point
    return at


@pytest.mark.parametrize(("point", "want"), [
    ("aside made", 5), ("set aside", 5), ("writing", 5), ("swapped in", 7), ("dropping", 7)])
def test_a_re_export_killed_anywhere_leaves_the_old_or_the_new_partition(
        spark, outputs, tmp_path, point, want) -> None:
    """h32 #1: a re-export killed once a partition was set aside (``.replaced-*``) lost it
    for good: the next export's start deleted ``.replaced-*`` whatever was in its place. Each
    kill point's directories, settled by the next start, read as the old partition or the
    new one, and leave nothing hidden behind."""
    from spark_tools.output import Output

    old, new, _ = outputs
    out = _killed(old, new, tmp_path / "out", point)
    Output(spark, str(out)).clean()
    assert _traffic(spark, out) == {"devA": want, "devB": 2}
    assert _leftovers(out) == []
    assert Output(spark, str(out)).clean().restored == ()  # settled once


def test_the_next_export_puts_back_what_a_killed_one_set_aside(spark, outputs, tmp_path) -> None:
    """h32 #1, the attack's sequence: killed with devA's traffic set aside, then devB alone
    exported into the same output (exit 0): devA's aggregate is back."""
    old, new, dumps = outputs
    out = _killed(old, new, tmp_path / "out", "set aside")
    assert _traffic(spark, out) == {"devB": 2}  # what a reader sees until the next export
    done = export(spark, ExportOptions((str(dumps["b"]),), str(out)))
    assert {r["device"]: r["messages"] for r in done.aggregates["traffic"]} == {
        "devA": 5, "devB": 2}
    assert _leftovers(out) == []


def test_a_failed_write_or_swap_leaves_the_old_partitions(spark, outputs, tmp_path,
                                                         monkeypatch) -> None:
    """h32 #1: a write that fails moves nothing; a swap that fails half way puts the old
    partitions back; one that succeeds drops the partitions of devices with no new rows."""
    from spark_tools.output import Output

    old, new, _ = outputs
    out = tmp_path / "out"
    shutil.copytree(old, out)
    fresh = new / TRAFFIC / "device=devA"

    def write(path: str) -> None:
        shutil.copytree(fresh, Path(path) / "device=devA")

    def broken(path: str) -> None:
        write(path)
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        Output(spark, str(out)).replace(str(TRAFFIC), 1, broken, ["devA"])
    assert _traffic(spark, out) == {"devA": 5, "devB": 2}
    assert _leftovers(out) == []

    moves = []
    real = Output._move

    def move(self, src, dst) -> None:
        moves.append(dst.toString())
        if len(moves) == 2:  # the old one is aside, the new one fails to go in
            raise OSError("rename failed")
        real(self, src, dst)

    monkeypatch.setattr(Output, "_move", move)
    with pytest.raises(OSError, match="rename failed"):
        Output(spark, str(out)).replace(str(TRAFFIC), 1, write, ["devA"])
    monkeypatch.undo()
    assert _traffic(spark, out) == {"devA": 5, "devB": 2}
    assert _leftovers(out) == []

    Output(spark, str(out)).replace(str(TRAFFIC), 1, write, ["devA", "devB"])
    assert _traffic(spark, out) == {"devA": 7}  # devB has no rows in the new table
    assert _leftovers(out) == []


def test_device_ids_that_look_like_numbers_stay_text(spark, tmp_path) -> None:
    """h32 #2: Spark's partition type inference read ``device=007`` back as the number 7
    (summary and report showed 7; ``007`` and ``7`` both as 7)."""
    from spark_tools import report

    dumps = []
    for device, n in (("007", 3), ("7", 4), ("1e3", 5)):
        _log(tmp_path / device, _messages(n))
        dumps.append(str(_dump(tmp_path / device, tmp_path / "dumps" / device, device)))
    out = tmp_path / "out"
    export(spark, ExportOptions(tuple(dumps[:1]), str(out)))
    done = export(spark, ExportOptions(tuple(dumps[1:]), str(out)))
    assert {r["device"]: r["messages"] for r in done.aggregates["devices"]} == {
        "007": 3, "7": 4, "1e3": 5}
    for name, rows in done.aggregates.items():
        assert all(isinstance(r["device"], str) for r in rows), name
    assert done.devices == 3
    assert "<td>007</td>" in report.render(done)
    assert spark.conf.get("spark.sql.sources.partitionColumnTypeInference.enabled") == "true"


def _done(devices: list[str]):
    from datetime import UTC, datetime

    from spark_tools.job import Exported

    t = datetime(2026, 11, 27, 0, 40, tzinfo=UTC)
    rows = [{"device": d, "messages": 1, "bytes": 1, "topics": 1, "first_seen": t,
             "last_seen": t} for d in devices]
    agg = {"devices": rows, "traffic": [], "rates": [], "sizes": [], "groups": [],
           "dead_letters": [], "damage": []}
    return Exported(len(rows), 0, 0, len(rows), agg)


def test_a_report_that_cannot_be_made_leaves_the_previous_one(tmp_path, monkeypatch) -> None:
    """h32 #3: the report was opened (truncated) before it was made and written in place:
    any failure left the previous report cut short, or a 0-byte file."""
    from spark_tools import report

    path = tmp_path / "r.html"
    path.write_text("<html>last week</html>")
    broken = _done(["a"])
    broken.aggregates["groups"].append({"device": "a"})  # a row render cannot show
    with pytest.raises(KeyError):
        report.write(str(path), broken)
    assert path.read_text() == "<html>last week</html>"

    def full(*args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.os, "replace", full)
    with pytest.raises(OSError):
        report.write(str(path), _done(["a"]))
    monkeypatch.undo()
    assert path.read_text() == "<html>last week</html>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]
    report.write(str(path), _done(["a"]))
    assert "<td>a</td>" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


FULL_DISK = """
import os, sys
from datetime import UTC, datetime
from spark_tools import report
from spark_tools.job import Exported
t = datetime(2026, 11, 27, tzinfo=UTC)
dev = {"device": "a", "messages": 1, "bytes": 1, "topics": 1, "first_seen": t, "last_seen": t}
done = Exported(1, 0, 0, 1, {"devices": [dev] * 2000, "traffic": [], "rates": [], "sizes": [],
                             "groups": [], "dead_letters": [], "damage": []})
where = sys.argv[1]
with open(os.path.join(where, "old.html"), "w") as f:
    f.write("<html>last week</html>")
try:
    with open(os.path.join(where, "fill"), "wb") as f:
        while True:
            f.write(b"x" * 4096)
            f.flush()
except OSError:
    pass
for name in ("old.html", "first.html"):
    try:
        report.write(os.path.join(where, name), done)
        print(name, "written")
    except OSError as exc:
        print(name, "failed", exc.errno)
for name in sorted(os.listdir(where)):
    if name != "fill":
        print(name, open(os.path.join(where, name)).read() if name == "old.html" else "")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root")
def test_a_report_on_a_full_disk_leaves_the_previous_one(tmp_path) -> None:
    """h32 #3 as the attack ran it: a full tmpfs (private mount namespace)."""
    import subprocess
    import sys

    mnt = tmp_path / "full"
    mnt.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount --make-rprivate / && mount -t tmpfs -o size=64k '
         'tmpfs "$1" && exec "$2" "$3" "$1"', "sh", str(mnt), sys.executable, str(script)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    if "mount" in res.stderr and res.returncode:
        pytest.skip(f"no private tmpfs here: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["old.html failed 28", "first.html failed 28",
                                       "old.html <html>last week</html>"], res.stdout

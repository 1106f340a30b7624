"""The core's STATE records: a front end's state by key (MQTT persistent sessions), saved in
the log, recovered at start, carried past retention, invisible to cursors."""

from __future__ import annotations

from pathlib import Path

from test_broker_retained import commit, deliveries, open_broker, raw, sub

from blipmq_server.broker.core import Broker
from blipmq_server.broker.storage import MemoryLog
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import Start
from blipmq_server.wal.log import LogOptions


def test_the_latest_value_of_a_key_wins_and_an_empty_one_deletes() -> None:
    log = MemoryLog()
    b = Broker(log=log)
    assert b.put_state(b"k1", b"one", 1) == 1
    assert b.put_state(b"k2", b"two", 2) == 2
    assert b.put_state(b"k1", b"uno", 3) == 3
    assert b.put_state(b"k2", b"", 4) == 4
    assert b.put_state(b"never", b"", 5) == 0  # deleting what is not there writes nothing
    assert b.states == {b"k1": b"uno"}
    assert [r.kind for r in log.records] == [Kind.STATE] * 4


def test_states_come_back_from_the_log_and_outlive_retention(tmp_path: Path) -> None:
    options = LogOptions(segment_bytes=4096, retention_bytes=8192)
    b, log = open_broker(tmp_path, options)
    b.put_state(b"mqtt/s/dev1", b"subs of dev1", 10)
    b.put_state(b"mqtt/s/dev2", b"subs of dev2", 11)
    b.put_state(b"mqtt/s/dev2", b"", 12)  # deleted
    for i in range(200):  # enough traffic to fill several segments
        b.publish([raw("noise", b"n" * 100, retain=False)], 0, 20 + i)
        commit(log)
    first = log.segments[0]
    newest = log.segments[-1].base
    assert b.carry_states(500, newest) > 0  # what maintenance does before retention
    commit(log)
    assert b.newest_state() <= log.written_offset
    assert log.retain(1000, b.durable_floor()).removed
    assert first not in log.segments  # the original records are gone
    log.close()

    b2, log2 = open_broker(tmp_path, options)
    assert b2.states == {b"mqtt/s/dev1": b"subs of dev1"}
    assert b2.offset == log2.next_offset - 2  # the last message; state records are not
    replay = sub(b2, 1, "#", start=Start.EARLIEST)
    assert {d.topic for d in deliveries(b2, replay)} <= {"noise"}  # cursors skip them
    log2.close()

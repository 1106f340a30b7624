"""Crash safety: SIGKILL the broker at random moments while QoS 1 publishes stream in.

Every message whose publish was confirmed must be delivered afterwards to a durable group
that existed throughout.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blipmq_cli.client import Client
from blipmq_server.protocol import codec
from blipmq_server.wal.log import Log

PUBLISHER = r"""
import sys
from blipmq_cli.client import Client
from blipmq_server.protocol.codec import Message
trial, addr = sys.argv[1], sys.argv[2]
c = Client(addr)
n = 0
while True:
    batch = [Message("crash", f"{trial}:{n + i}".encode(), qos=1) for i in range(50)]
    c.publish_many(batch)
    c.wait_confirms()
    n += len(batch)
    print(n, flush=True)  # everything below n is confirmed
"""


@pytest.mark.slow
def test_confirmed_messages_survive_sigkill(start_broker, tmp_path: Path) -> None:
    rng = random.Random(20261122)
    data_dir = tmp_path / "shared-data"
    confirmed: set[bytes] = set()
    trials = 20
    for trial in range(trials):
        b = start_broker({"wal": {"segment_bytes": 65536}}, data_dir=data_dir)
        if trial == 0:  # the durable group that must get every confirmed message
            made = b.cli("sub", "crash", "--group", "audit", "--qos", "1", "--timeout", "0.2")
            assert made.returncode == 4
        pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(trial), b.addr],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert pub.stdout is not None
        first = pub.stdout.readline()  # publishing and confirmed: the load is on
        time.sleep(rng.uniform(0.0, 0.9))  # then a random moment for the crash
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)
        out, _ = pub.communicate(timeout=20)
        lines = (first + out).split()
        done = int(lines[-1]) if lines else 0
        confirmed.update(f"{trial}:{i}".encode() for i in range(done))
    b = start_broker({"delivery": {"default_credit": 5000}}, data_dir=data_dir)
    delivered: list[bytes] = []
    with Client(b.addr) as client:
        sub = client.subscribe("crash", group="audit", qos=1)
        while True:
            try:
                batch = sub.next_batch(3)
            except TimeoutError:
                break
            assert batch is not None
            delivered += [d.payload for d in batch]
            sub.ack(*batch)
    assert b.stop() == 0
    lost = confirmed - set(delivered)
    duplicated = len(delivered) - len(set(delivered))
    print(f"\ncrash trials={trials} confirmed={len(confirmed)} delivered={len(delivered)} "
          f"lost={len(lost)} duplicated={duplicated}")
    assert len(confirmed) > trials * 50, "the publisher must have got confirms in most trials"
    assert not lost
    assert duplicated == 0  # every delivery was acked at once: nothing to deliver twice


@pytest.mark.slow
def test_sigterm_under_qos1_load_keeps_everything_confirmed(start_broker) -> None:
    b = start_broker({"server": {"shutdown_grace_ms": 3000}})
    pub = subprocess.Popen([sys.executable, "-c", PUBLISHER, "term", b.addr],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert pub.stdout is not None
    for _ in range(5):  # five confirmed batches: the load is on
        first = pub.stdout.readline()
    started = time.monotonic()
    assert b.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 3.5
    out, _ = pub.communicate(timeout=20)
    done = int((first + out).split()[-1])
    assert done > 0
    wal = Log(str(b.data_dir / "wal"))
    found = wal.open()
    assert found.torn_bytes == 0 and not found.quarantined  # a clean stop leaves a clean log
    stored = {codec.decode_one(codec.encode_publish([r.body])).decoded()[0].payload
              for r in wal.read(0, max_records=10**8, max_bytes=1 << 40)}
    assert {f"term:{i}".encode() for i in range(done)} <= stored


def test_a_deleted_group_stays_deleted_after_sigkill(start_broker) -> None:
    """`blipmq unsub --group` answered: the group is gone, and a crash right after must
    not bring it back (with its position and backlog). The broker is SIGKILLed the moment
    UNSUBSCRIBED arrives, before the client library even closes its connection."""
    b = start_broker()
    made = b.cli("sub", "jobs", "--group", "g", "--qos", "1", "--timeout", "0.3")
    assert made.returncode == 4, made.stderr  # --timeout ran out: the group exists
    assert b.cli("pub", "jobs", "backlog", "--qos", "1").returncode == 0  # durable
    c = Client(b.addr)
    assert c.unsubscribe("jobs", group="g") == 1
    assert b.stop(signal.SIGKILL) == -signal.SIGKILL
    c.abort()  # the broker is gone: nothing to say goodbye to
    b2 = start_broker(data_dir=b.data_dir)
    assert b2.metric("blipmq_durable_groups") == 0
    again = b2.cli("unsub", "jobs", "--group", "g")
    assert again.returncode == 8, again.stderr  # NOT_FOUND: no such group

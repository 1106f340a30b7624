"""One device's traffic, made by a real broker: what the dump and export tests read.

``drive`` publishes through the real ``blipmq`` CLI (QoS 0 readings on a per-device topic,
QoS 1 orders), lets a durable group ack every order, and has a second durable group nack
its alerts until the broker moves them to ``$dlq/alerts``. It returns what was published,
so that tests can check exact counts and bytes against what the log and Spark say.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from blipmq_cli.client import Client

# two deliveries at most, a fixed short redelivery delay: dead letters come quickly
CONFIG = {"delivery": {"max_retries": 2, "retry_backoff_ms": 50, "retry_backoff_max_ms": 50}}


@dataclass
class Published:
    device: str
    counts: Counter[str] = field(default_factory=Counter)  # topic -> messages
    payload_bytes: Counter[str] = field(default_factory=Counter)  # topic -> payload bytes
    qos1: int = 0
    dead: int = 0  # messages moved to $dlq/alerts

    def add(self, topic: str, payloads: list[bytes], qos: int = 0) -> None:
        self.counts[topic] += len(payloads)
        self.payload_bytes[topic] += sum(map(len, payloads))
        self.qos1 += len(payloads) if qos else 0


def drive(b, device: str, readings: int = 30, orders: int = 12, alerts: int = 3
          ) -> Published:
    """Publish on broker ``b`` (started with ``CONFIG``) as device ``device``."""
    out = Published(device)
    temp = [f"{device} {i} {20 + i % 7}.5".encode() for i in range(readings)]
    res = b.cli("pub", f"sensors/{device}/temp", "--lines", "-", input=b"\n".join(temp) + b"\n")
    assert res.returncode == 0, res.stderr
    out.add(f"sensors/{device}/temp", temp)
    order = [f"order-{device}-{i:04d}".encode() for i in range(orders)]
    res = b.cli("pub", "orders", "--qos", "1", "--lines", "-", input=b"\n".join(order) + b"\n")
    assert res.returncode == 0, res.stderr
    out.add("orders", order, qos=1)
    res = b.cli("sub", "orders", "--group", "billing", "--qos", "1", "--from", "earliest",
                "--count", str(orders), "--timeout", "20", "--format", "lines")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == order
    with Client(b.addr) as c:
        pager = c.subscribe("alerts", group="pager", qos=1)
        alert = [f"alert-{device}-{i}".encode() for i in range(alerts)]
        for a in alert:
            c.publish("alerts", a, qos=1)
        c.flush()
        out.add("alerts", alert, qos=1)
        nacked = 0
        for _ in range(4 * alerts):  # each alert is delivered twice, then dead-lettered
            if nacked == 2 * alerts:
                break
            batch = pager.next_batch(10)
            pager.nack(*batch)
            nacked += len(batch)
        c.flush()
    b.wait_metric("blipmq_messages_dead_lettered_total", alerts)
    out.dead = alerts
    out.add("$dlq/alerts", alert, qos=1)
    return out

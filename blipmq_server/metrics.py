"""Prometheus exposition of the broker's plain counters, read at scrape time.

The core and the shell keep ints (``broker.results.Counters``, ``counters``); this module
turns them into metric families when /metrics is scraped, so the hot path never touches a
metrics object. It is handed what to read (``Sources``) and imports nothing of the server:
no trio, no import circle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from blipmq_server.broker.core import Broker
from blipmq_server.counters import ConnectionCounters, WalCounters
from blipmq_server.wal.log import Log
from blipmq_server.wal.recovery import Recovery

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True, slots=True)
class Sources:
    """What /metrics reads: the core (its counters and views), the connections' counters,
    and, with the log, the log itself, its writer's counters and what recovery found."""

    broker: Broker
    connections: ConnectionCounters
    wal: Log | None = None
    writes: WalCounters | None = None
    recovery: Recovery | None = None


class BrokerCollector:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        broker = self.sources.broker
        c = broker.counters
        s = self.sources.connections
        for name, doc, value in (
            ("published", "Messages accepted from publishers", c.published),
            ("unrouted", "Accepted messages no subscription matched", c.unrouted),
            ("enqueued", "Message copies put on subscription queues", c.enqueued),
            ("delivered", "Message copies handed to subscriber connections", c.delivered),
            ("refused", "Published messages answered with an error frame and not stored: the "
             "refused one and the rest of its batch, and QoS 1 messages the log could not "
             "store (STORAGE)", c.refused),
            ("acked", "QoS 1 deliveries acknowledged", c.acked),
            ("redelivered", "QoS 1 deliveries sent again (unacked in time, or consumer left)",
             c.redelivered),
            ("dead_lettered", "Messages moved to $dlq/<topic> after max_retries deliveries",
             c.dead_lettered),
            ("nacked", "QoS 1 deliveries given back with a negative ack", c.nacked),
        ):
            yield CounterMetricFamily(f"blipmq_messages_{name}", doc, value=value)
        dropped = CounterMetricFamily(
            "blipmq_messages_dropped", "Message copies dropped, by reason", labels=["reason"]
        )
        dropped.add_metric(["drop_oldest"], c.dropped_oldest)
        dropped.add_metric(["drop_new"], c.dropped_new)
        dropped.add_metric(["ttl"], c.dropped_ttl)
        dropped.add_metric(["no_consumer"], c.dropped_no_consumer)
        yield dropped
        yield CounterMetricFamily(
            "blipmq_connections", "Connections accepted", value=s.accepted
        )
        yield CounterMetricFamily(
            "blipmq_connections_refused", "Connections refused at max_connections",
            value=s.refused,
        )
        yield CounterMetricFamily(
            "blipmq_auth_failures", "Connections that offered a refused API key",
            value=s.auth_failures,
        )
        closed = CounterMetricFamily(
            "blipmq_connections_closed", "Connections closed, by reason (slow_consumer, "
            "keepalive_timeout, eof, goodbye, ...)", labels=["reason"])
        for reason, n in sorted(s.closed.items()):
            closed.add_metric([reason], n)
        yield closed
        yield GaugeMetricFamily(
            "blipmq_connections_open", "Open client connections", value=s.open
        )
        yield from self._wal()
        queues = broker.queues
        yield GaugeMetricFamily("blipmq_subscriptions", "Subscriptions of connected clients "
                                "(each member of a group counts)", value=broker.subscriptions)
        yield GaugeMetricFamily("blipmq_queues", "Subscription and group queues", value=len(queues))
        yield GaugeMetricFamily(
            "blipmq_queue_depth", "Messages waiting in all queues",
            value=sum(len(q.items) for q in queues),
        )
        retained = broker.retained
        yield GaugeMetricFamily("blipmq_retained_topics", "Topics holding a retained value",
                                value=len(retained))
        yield GaugeMetricFamily("blipmq_retained_bytes", "Bytes of retained message records",
                                value=retained.size)
        yield CounterMetricFamily("blipmq_retained_sent", "Retained values handed to new "
                                  "subscriptions", value=c.retained_sent)
        yield CounterMetricFamily("blipmq_retained_refused", "Retained publishes refused at "
                                  "retained.max_topics or retained.max_bytes",
                                  value=retained.refused)
        yield from self._groups()

    def _groups(self) -> Iterator[Metric]:
        broker = self.sources.broker
        groups = broker.durable_groups
        yield GaugeMetricFamily("blipmq_durable_groups", "Durable (QoS 1) consumer groups",
                                value=len(groups))
        yield CounterMetricFamily(
            "blipmq_durable_groups_expired",
            "Durable groups dropped after delivery.group_expiry_ms without a consumer",
            value=broker.counters.groups_expired,
        )
        labels = ["filter", "group"]
        behind = GaugeMetricFamily(
            "blipmq_group_backlog",
            "Logged messages of the group's own topics it has not delivered yet (counted on "
            "append; after a restart or a replay's creation, once its count is done)",
            labels=labels)
        flying = GaugeMetricFamily("blipmq_group_in_flight", "Deliveries waiting for an ack",
                                   labels=labels)
        skipped = CounterMetricFamily(
            "blipmq_group_skipped",
            "Records the retention size cap removed before the group read them", labels=labels)
        for g in groups:
            key = [g.filter, g.group]
            behind.add_metric(key, max(0, g.backlog))
            flying.add_metric(key, len(g.inflight))
            skipped.add_metric(key, g.skipped)
        yield behind
        yield flying
        yield skipped


    def _wal(self) -> Iterator[Metric]:
        wal, w, found = self.sources.wal, self.sources.writes, self.sources.recovery
        if wal is None or w is None:
            return
        for name, doc, value in (
            ("records", "Records written to the log", w.records),
            ("bytes", "Bytes written to the log", w.bytes),
            ("batches", "Group-commit batches written", w.batches),
            ("syncs", "Log syncs: each made every record written so far durable", w.syncs),
            ("fsyncs", "fsync calls on log segment files and the log directory", w.fsyncs),
            ("write_failures", "Log writes or fsyncs that failed", w.failures),
            ("records_lost", "Appended records never stored because the disk failed",
             w.records_lost),
            ("maintenance_runs", "Rounds of group expiry, checkpoints and retention",
             w.maintenance_runs),
        ):
            yield CounterMetricFamily(f"blipmq_wal_{name}", doc, value=value)
        yield CounterMetricFamily("blipmq_wal_cache_hits",
                                  "Log reads served from the recent-records cache",
                                  value=wal.cache_hits)
        yield CounterMetricFamily("blipmq_wal_cache_misses",
                                  "Log reads that went to the segment files",
                                  value=wal.cache_misses)
        yield GaugeMetricFamily("blipmq_wal_segments", "Segment files", value=len(wal.segments))
        yield GaugeMetricFamily("blipmq_wal_size_bytes", "Bytes in segment files",
                                value=wal.total_bytes)
        yield GaugeMetricFamily("blipmq_wal_pending_records", "Appended, not yet written",
                                value=wal.pending_records)
        yield GaugeMetricFamily("blipmq_wal_unsynced_records", "Written, not yet fsynced",
                                value=w.unsynced)
        if found is not None:
            yield GaugeMetricFamily("blipmq_wal_recovery_torn_bytes",
                                    "Bytes cut off a torn tail at the last start",
                                    value=found.torn_bytes)
            yield GaugeMetricFamily("blipmq_wal_recovery_quarantined",
                                    "Damaged segment parts set aside at the last start",
                                    value=len(found.quarantined))


def registry_for(sources: Sources) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(sources))  # type: ignore[arg-type]
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


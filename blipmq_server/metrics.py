"""Prometheus exposition of the broker's plain counters, read at scrape time.

The core and the shell keep ints (``broker.results.Counters``, ``counters``); this module
turns them into metric families when /metrics is scraped, so the hot path never touches a
metrics object. It is handed what to read (``Sources``) and imports nothing of the server:
no trio, no import circle. It writes the Prometheus text format (version 0.0.4) itself:
a broker's worth of counters and gauges needs a few lines, where a client library would
stay in an idle broker's memory for its whole life (docs/PERFORMANCE.md, "Idle memory").
A counter named ``x`` is exposed as ``x_total``.

A page with many groups is long (20,000 groups: 3.7 MB, some 60,000 lines), so ``pages``
writes it in parts, and the groups' samples are read as their lines are written: the
server lets its other tasks run between two parts (server/http.py). A page is therefore
not one instant's picture, only each sample is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from blipmq_server.broker.core import Broker
from blipmq_server.counters import ConnectionCounters, WalCounters
from blipmq_server.wal.log import Log
from blipmq_server.wal.recovery import Recovery

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Sample = tuple[Sequence[str], float]  # label values, value
PART_LINES = 1000  # lines of a part of the page (~1 ms to write)


class Family:
    """One metric: its name, ``counter`` or ``gauge``, help text and samples: a list, or
    any iterable read once, as the lines are written (the groups'). (A plain class: the
    broker defines it on every start, where a dataclass costs 0.3 ms.)"""

    __slots__ = ("doc", "kind", "labels", "name", "samples")

    def __init__(self, name: str, kind: str, doc: str, labels: tuple[str, ...] = (),
                 samples: Iterable[Sample] | None = None) -> None:
        self.name = name
        self.kind = kind
        self.doc = doc
        self.labels = labels
        self.samples: Iterable[Sample] = [] if samples is None else samples

    def add(self, values: Sequence[str], value: float) -> None:
        assert isinstance(self.samples, list)
        self.samples.append((tuple(values), value))

    def lines(self) -> Iterator[str]:
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        doc = self.doc.replace("\\", "\\\\").replace("\n", "\\n")
        yield f"# HELP {name} {doc}"
        yield f"# TYPE {name} {self.kind}"
        for values, value in self.samples:
            if values:
                pairs = ",".join(
                    f'{k}="{_label(v)}"' for k, v in zip(self.labels, values, strict=True))
                yield f"{name}{{{pairs}}} {float(value)!r}"
            else:
                yield f"{name} {float(value)!r}"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# the caps ``blipmq_limit_refusals_total`` counts refusals at (every one shown, 0 or not)
_LIMITS = ("queues.max_durable_groups", "mqtt.max_sessions", "auth.keys.max_durable_groups",
           "auth.keys.max_sessions", "auth.keys.max_retained_topics",
           "auth.keys.max_retained_bytes", "retained.max_per_connection",
           "retained.max_all_connections")


def counter(name: str, doc: str, value: float) -> Family:
    return Family(name, "counter", doc, samples=[((), value)])


def gauge(name: str, doc: str, value: float) -> Family:
    return Family(name, "gauge", doc, samples=[((), value)])


class Sources(NamedTuple):
    """What /metrics reads: the core (its counters and views), the connections' counters,
    and, with the log, the log itself, its writer's counters and what recovery found."""

    broker: Broker
    connections: ConnectionCounters
    wal: Log | None = None
    writes: WalCounters | None = None
    recovery: Recovery | None = None
    # the MQTT front end's figures (server.sessions.MqttSessions.stats), read at scrape time
    mqtt: Callable[[], dict[str, int]] | None = None
    # each bridge's status (server.bridge.Bridge.status), read at scrape time
    bridges: Callable[[], list[dict[str, Any]]] | None = None


class BrokerCollector:
    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Family]:
        broker = self.sources.broker
        c = broker.counters
        s = self.sources.connections
        for name, doc, value in (
            ("published", "Messages accepted from publishers", c.published),
            ("unrouted", "Accepted messages no subscription matched", c.unrouted),
            ("enqueued", "Message copies put on subscription queues", c.enqueued),
            ("delivered", "Message copies handed to subscriber connections", c.delivered),
            ("refused", "Published messages refused and not stored: a native PUBLISH's "
             "refused one and the rest of its batch (answered with an error frame), each "
             "MQTT publish refused, and QoS 1 messages the log could not store (STORAGE)",
             c.refused),
            ("acked", "QoS 1 deliveries acknowledged", c.acked),
            ("redelivered", "QoS 1 deliveries sent again (unacked in time, or consumer left)",
             c.redelivered),
            ("dead_lettered", "Messages moved to $dlq/<topic> after max_retries deliveries",
             c.dead_lettered),
            ("dead_letters_dropped", "Dead letters a group or subscription gave up on in their "
             "turn (max_retries deliveries, or given up): dropped from it, not moved to "
             "$dlq/$dlq/<topic>", c.dead_letters_dropped),
            ("nacked", "QoS 1 deliveries given back with a negative ack", c.nacked),
        ):
            yield counter(f"blipmq_messages_{name}", doc, value)
        dropped = Family("blipmq_messages_dropped", "counter", "Message copies dropped, by reason",
                         ("reason",))
        dropped.add(["drop_oldest"], c.dropped_oldest)
        dropped.add(["drop_new"], c.dropped_new)
        dropped.add(["ttl"], c.dropped_ttl)
        dropped.add(["no_consumer"], c.dropped_no_consumer)
        yield dropped
        yield counter("blipmq_connections", "Connections accepted", s.accepted)
        yield counter("blipmq_connections_refused", "Connections refused at max_connections",
                      s.refused)
        yield counter("blipmq_connections_evicted", "Connections not authenticated within a "
                      "second, closed at max_connections to make room for a newcomer",
                      s.evicted)
        yield counter("blipmq_metrics_connections_refused", "Metrics listener connections "
                      "closed at once: it was serving as many as it serves at a time",
                      s.metrics_refused)
        yield counter("blipmq_auth_failures", "Connections that offered a refused API key",
                      s.auth_failures)
        refused = Family("blipmq_auth_refused", "counter", "Refused keys and tokens, by "
                         "where they were offered (native, mqtt, metrics)", ("reason",))
        for reason, n in sorted(s.auth_refused.items()):
            refused.add([reason], n)
        yield refused
        closed = Family("blipmq_connections_closed", "counter", "Connections closed, by reason "
                        "(slow_consumer, keepalive_timeout, eof, goodbye, ...)", ("reason",))
        for reason, n in sorted(s.closed.items()):
            closed.add([reason], n)
        yield closed
        yield gauge("blipmq_connections_open", "Open client connections", s.open)
        yield counter("blipmq_reading_waits", "Reads of a connection held back until "
                      "server.max_reading_bytes had room for the large frame it is reading",
                      s.reading_waits)
        tls = Family("blipmq_tls_handshake_failures", "counter", "TLS handshakes that failed, "
                     "by reason (docs/SECURITY.md); the connection is closed", ("reason",))
        for reason, n in sorted(s.tls_errors.items()):
            tls.add([reason], n)
        yield tls
        yield from self._mqtt()
        yield from self._bridges()
        yield from self._wal()
        queues = broker.queues
        yield gauge("blipmq_subscriptions", "Subscriptions of connected clients "
                    "(each member of a group counts)", broker.subscriptions)
        yield gauge("blipmq_queues", "Subscription and group queues", len(queues))
        yield gauge("blipmq_queue_depth", "Messages waiting in all queues",
                    sum(len(q.items) for q in queues))
        yield gauge("blipmq_queue_bytes", "Bytes of messages waiting in all queues, each copy "
                    "counted (queues.max_bytes_total)", broker.registry.total.size)
        retained = broker.retained
        yield gauge("blipmq_retained_topics", "Topics holding a retained value", len(retained))
        yield gauge("blipmq_retained_bytes", "Bytes of retained message records", retained.size)
        yield counter("blipmq_retained_sent", "Retained values handed to new subscriptions",
                      c.retained_sent)
        yield counter("blipmq_retained_refused", "Retained publishes refused at "
                      "retained.max_topics or retained.max_bytes, or at the publishing key's "
                      "share of them", retained.refused)
        limited = Family("blipmq_limit_refusals", "counter", "Refusals at a cap on what the "
                         "broker holds, by the cap: queues.max_durable_groups, "
                         "mqtt.max_sessions, and a key's share (auth.keys.max_durable_groups, "
                         "_sessions, _retained_topics, _retained_bytes)", ("limit",))
        for limit in _LIMITS:
            limited.add([limit], c.limited.get(limit, 0))
        yield limited
        yield from self._groups()

    def _mqtt(self) -> Iterator[Family]:
        read = self.sources.mqtt
        if read is None:
            return
        m = read()
        sessions = Family("blipmq_mqtt_sessions", "gauge", "MQTT sessions: online (connected) "
                          "and offline (persistent sessions without a connection)", ("state",))
        sessions.add(["online"], m["online"])
        sessions.add(["offline"], m["offline"])
        yield sessions
        yield gauge("blipmq_mqtt_bridge_sessions", "Online MQTT sessions that connected as a "
                    "bridge (CONNECT level 0x84 or 0x83)", m["bridges"])
        yield gauge("blipmq_mqtt_inflight", "Outbound MQTT QoS 1/2 deliveries awaiting the "
                    "client's PUBACK, PUBREC or PUBCOMP", m["inflight"])
        yield counter("blipmq_mqtt_wills_published", "MQTT wills published (closes that were "
                      "not a DISCONNECT)", m["wills_published"])
        yield counter("blipmq_mqtt_sessions_expired", "Persistent MQTT sessions deleted after "
                      "mqtt.session_expiry_ms offline", m["sessions_expired"])
        errors = Family("blipmq_mqtt_protocol_errors", "counter", "MQTT connections closed "
                        "for breaking the protocol, and publishes dropped, by reason "
                        "(docs/MQTT.md)", ("reason",))
        for reason, n in sorted(self.sources.connections.mqtt_errors.items()):
            errors.add([reason], n)
        yield errors
        dropped = Family("blipmq_mqtt_qos0_dropped", "counter", "MQTT QoS 0 publishes "
                         "dropped, by reason: the key may not publish there (forbidden), a "
                         "topic in the broker's $SYS, $dlq or $share tree (reserved_topic), "
                         "or the code of the broker's refusal (limit, message_too_large, "
                         "invalid_topic)", ("reason",))
        for reason, n in sorted(self.sources.connections.mqtt_dropped.items()):
            dropped.add([reason], n)
        yield dropped

    def _bridges(self) -> Iterator[Family]:
        read = self.sources.bridges
        if read is None:
            return
        found = read()
        for key, kind, name, doc in _BRIDGE_FAMILIES:
            family = Family(name, kind, doc, ("bridge",))
            for b in found:
                value = b[key]
                if value is not None:
                    family.add([b["name"]], float(value))
            yield family

    def _groups(self) -> Iterator[Family]:
        broker = self.sources.broker
        groups = broker.durable_groups
        yield gauge("blipmq_durable_groups", "Durable (QoS 1) consumer groups", len(groups))
        yield counter(
            "blipmq_durable_groups_expired",
            "Durable groups dropped after delivery.group_expiry_ms without a consumer",
            broker.counters.groups_expired,
        )
        yield counter(
            "blipmq_idle_groups_dropped",
            "QoS 0 groups dropped, with their messages, beyond queues.max_idle_groups without "
            "a consumer",
            broker.counters.idle_groups_dropped,
        )
        # the groups at this instant (a tuple); each one's figures are read as its line is
        # written, a part at a time, while groups come and go
        labels = ("filter", "group")
        yield Family(
            "blipmq_group_backlog", "gauge",
            "Logged messages of the group's own topics it has not delivered yet (counted on "
            "append; after a restart or a replay's creation, once its count is done)", labels,
            (((g.filter, g.group), max(0, g.backlog)) for g in groups))
        yield Family("blipmq_group_in_flight", "gauge", "Deliveries waiting for an ack", labels,
                     (((g.filter, g.group), len(g.inflight)) for g in groups))
        yield Family(
            "blipmq_group_skipped", "counter",
            "Records the retention size cap removed before the group read them (or, "
            "counted at start, while its deliveries of them were unacked)", labels,
            (((g.filter, g.group), g.skipped) for g in groups))

    def _wal(self) -> Iterator[Family]:
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
            ("read_waits", "Reads of a connection held back while more than "
             "wal.max_unwritten_bytes waited for the disk", w.read_waits),
            ("restores", "Times the log's directory or segment files were found deleted "
             "under the running broker (the directory made again, the segment being "
             "written written back)", w.restores),
        ):
            yield counter(f"blipmq_wal_{name}", doc, value)
        yield counter("blipmq_wal_cache_hits", "Log reads served from the recent-records cache",
                      wal.cache_hits)
        yield counter("blipmq_wal_cache_misses", "Log reads that went to the segment files",
                      wal.cache_misses)
        cursors = self.sources.broker.cursors
        if cursors is not None:
            budget = cursors.budget
            yield gauge("blipmq_wal_read_ahead_bytes", "Records read ahead of log cursors' "
                        "consumers, with the topics the cursors know (wal.read_ahead_bytes)",
                        budget.held)
            yield counter("blipmq_wal_read_ahead_sheds", "Cursors that let go of their "
                          "read-ahead to keep within wal.read_ahead_bytes", budget.sheds)
        yield gauge("blipmq_wal_segments", "Segment files", len(wal.segments))
        yield gauge("blipmq_wal_size_bytes", "Bytes in segment files", wal.total_bytes)
        yield gauge("blipmq_wal_pending_records", "Appended, not yet written",
                    wal.pending_records)
        yield gauge("blipmq_wal_unsynced_records", "Written, not yet fsynced", w.unsynced)
        if found is not None:
            yield gauge("blipmq_wal_recovery_torn_bytes",
                        "Bytes cut off a torn tail at the last start", found.torn_bytes)
            yield gauge("blipmq_wal_recovery_quarantined",
                        "Damaged segment parts set aside at the last start (or, with no "
                        "room for that, left in place and skipped)",
                        len(found.quarantined) + len(found.in_place))


def pages(sources: Sources, lines: int = PART_LINES) -> Iterator[bytes]:
    """The /metrics page in parts of ``lines`` lines (the last one shorter): every family in
    the Prometheus text format. Nothing is read before the first part is asked for."""
    part: list[str] = []
    for family in BrokerCollector(sources).collect():
        for line in family.lines():
            part.append(line)
            if len(part) >= lines:
                yield ("\n".join(part) + "\n").encode()
                part = []
    if part:
        yield ("\n".join(part) + "\n").encode()


def render(sources: Sources) -> bytes:
    """The /metrics page whole, at once."""
    return b"".join(pages(sources))


_BRIDGE_FAMILIES = (
    ("connected", "gauge", "blipmq_bridge_connected", "1 while the bridge's link to its "
     "upstream is up"),
    ("backlog_messages", "gauge", "blipmq_bridge_backlog_messages", "Messages the bridge has "
     "not had acknowledged by its upstream yet (in flight included)"),
    ("backlog_bytes", "gauge", "blipmq_bridge_backlog_bytes", "Bytes of log segments the "
     "bridge's backlog keeps (from its oldest unforwarded record on)"),
    ("oldest_age_s", "gauge", "blipmq_bridge_oldest_age_seconds", "Age of the oldest message "
     "not forwarded yet"),
    ("in_flight", "gauge", "blipmq_bridge_in_flight", "Messages sent upstream, not yet "
     "acknowledged"),
    ("forwarded", "counter", "blipmq_bridge_forwarded", "Messages the upstream acknowledged "
     "(QoS 1 rules) or that were written to it (QoS 0 rules)"),
    ("redelivered", "counter", "blipmq_bridge_redelivered", "Messages sent again (with DUP) "
     "after a link was lost with them in flight"),
    ("received", "counter", "blipmq_bridge_received", "Messages from the upstream (in rules)"),
    ("reconnects", "counter", "blipmq_bridge_reconnects", "Links lost after they were up"),
    ("connect_failures", "counter", "blipmq_bridge_connect_failures", "Connection attempts "
     "that failed (refused, timed out, TLS, the upstream's CONNACK or handshake)"),
    ("refused", "counter", "blipmq_bridge_refused", "Refusals: an upstream's ERROR for a "
     "message (each time), a message the upstream's protocol cannot carry, a message from "
     "the upstream the local broker could not store"),
    ("dropped", "counter", "blipmq_bridge_dropped", "Unforwarded messages the log's size cap "
     "(wal.retention_bytes) removed (backlog = \"drop_oldest\")"),
    ("dead_lettered", "counter", "blipmq_bridge_dead_lettered", "Messages the upstream "
     "refused max_retries times, moved to $dlq/<topic>"),
    ("skipped", "counter", "blipmq_bridge_skipped", "Bridged-in messages not sent back out "
     "(loop prevention)"),
    ("duplicates_in", "counter", "blipmq_bridge_duplicates_in", "QoS 2 messages the upstream "
     "sent again under a packet id awaiting PUBREL: not logged twice"),
    ("unexpected_acks", "counter", "blipmq_bridge_unexpected_acks", "PUBREC, PUBCOMP or "
     "PUBREL for a packet id nothing waited for (ignored)"),
    ("superseded", "counter", "blipmq_bridge_superseded", "Retained values from the upstream "
     "(both rules) not stored: a value published here since is not forwarded yet"),
)

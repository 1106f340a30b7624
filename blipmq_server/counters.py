"""The shell's plain counters: what the connections and the log writer count.

They live here, not beside the Trio code that updates them, so that ``metrics`` can read
them without importing the server (the broker core's counters are in ``broker.results``).
Standard library only.

Plain slotted classes, not dataclasses: they are defined on every ``blipmq start``, where a
dataclass costs about 0.4 ms of generated code each (docs/PERFORMANCE.md, "Start-up").
Nothing compares or prints them whole.
"""

from __future__ import annotations


class ConnectionCounters:
    """What the listeners and connections count (read by ``metrics`` at scrape time)."""

    __slots__ = ("accepted", "auth_failures", "auth_refused", "closed", "evicted",
                 "metrics_refused", "mqtt_dropped", "mqtt_errors", "open", "reading_waits",
                 "refused", "tls_errors")

    def __init__(self, closed: dict[str, int] | None = None) -> None:
        self.accepted = 0
        self.refused = 0  # at max_connections
        self.evicted = 0  # unauthenticated ones closed at max_connections for a newcomer
        self.metrics_refused = 0  # metrics listener connections beyond its cap (server/http.py)
        self.auth_failures = 0
        self.auth_refused: dict[str, int] = {}  # by where: native, mqtt, metrics
        self.open = 0
        self.closed: dict[str, int] = {} if closed is None else closed  # by close reason
        self.mqtt_errors: dict[str, int] = {}  # by reason (docs/MQTT.md)
        self.mqtt_dropped: dict[str, int] = {}  # MQTT QoS 0 publishes dropped, by reason
        # TLS handshakes that failed, by reason (docs/SECURITY.md); never became a connection
        self.tls_errors: dict[str, int] = {}
        # reads held back until server.max_reading_bytes had room for a large frame
        self.reading_waits = 0


class WalCounters:
    """What the log writer (``server/flusher.py``) counts."""

    __slots__ = ("batches", "bytes", "failures", "fsyncs", "maintenance_runs", "read_waits",
                 "records", "records_lost", "restores", "syncs", "unsynced")

    def __init__(self) -> None:
        self.batches = 0
        self.records = 0
        self.bytes = 0
        self.syncs = 0  # sync rounds: each made everything written so far durable
        self.fsyncs = 0  # fsync calls those rounds made (segment files and the directory)
        self.failures = 0
        self.records_lost = 0  # appended but never written because the disk failed
        self.unsynced = 0  # records written since the last sync (a gauge)
        self.maintenance_runs = 0  # rounds of group expiry, checkpoints and retention
        self.read_waits = 0  # reads held back while too much waited for the disk (``room``)
        self.restores = 0  # files of the log found deleted under the broker (and put back)

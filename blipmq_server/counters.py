"""The shell's plain counters: what the connections and the log writer count.

They live here, not beside the Trio code that updates them, so that ``metrics`` can read
them without importing the server (the broker core's counters are in ``broker.results``).
Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ConnectionCounters:
    """What the listeners and connections count (read by ``metrics`` at scrape time)."""

    accepted: int = 0
    refused: int = 0  # at max_connections
    metrics_refused: int = 0  # metrics listener connections beyond its cap (server/http.py)
    auth_failures: int = 0
    auth_refused: dict[str, int] = field(default_factory=dict)  # by where: native, mqtt, metrics
    open: int = 0
    closed: dict[str, int] = field(default_factory=dict)  # by close reason
    mqtt_errors: dict[str, int] = field(default_factory=dict)  # by reason (docs/MQTT.md)
    # TLS handshakes that failed, by reason (docs/SECURITY.md); never became a connection
    tls_errors: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class WalCounters:
    """What the log writer (``server/flusher.py``) counts."""

    batches: int = 0
    records: int = 0
    bytes: int = 0
    syncs: int = 0  # sync rounds: each made everything written so far durable
    fsyncs: int = 0  # fsync calls those rounds made (segment files and the directory)
    failures: int = 0
    records_lost: int = 0  # appended but never written because the disk failed
    unsynced: int = 0  # records written since the last sync (a gauge)
    maintenance_runs: int = 0  # rounds of group expiry, checkpoints and retention

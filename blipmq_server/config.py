"""Broker configuration: defaults < TOML file < BLIPMQ_* environment < command-line flags.

One schema table (``SCHEMA``) drives validation, environment parsing, the commented default
file (``default_text``) and the docs test. Every refusal is a ``ConfigError`` naming the key.
Must not import trio, typer or rich.

The sections and ``Config`` itself are NamedTuples (immutable, compared by value, and only
with their own kind): defining one costs a fifth of what a frozen dataclass does, and every
``blipmq start`` defines them all. A reload swaps sections with ``Config._replace``.
"""

# Annotations are evaluated here (no `from __future__ import annotations`): as strings,
# typing compiles each NamedTuple field's into a ForwardRef, ~5 us a field on every start.

import os
import stat
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from blipmq_server.errors import ConfigError
from blipmq_server.wal import policy

MiB = 1024 * 1024


class ServerOptions(NamedTuple):
    """``[server]``: the native protocol's listener, its TLS twin, and per-connection
    limits and timeouts."""

    host: str = "127.0.0.1"
    port: int = 7878
    tls: bool = False
    tls_host: str = "127.0.0.1"
    tls_port: int = 7879
    max_connections: int = 1024
    max_message_bytes: int = 8 * MiB
    max_topic_bytes: int = 1024
    handshake_timeout_ms: int = 5000
    keepalive_ms: int = 60000
    write_timeout_ms: int = 10000
    max_pending_bytes: int = 4 * MiB
    shutdown_grace_ms: int = 5000
    max_subscriptions: int = 10_000
    max_reading_bytes: int = 64 * MiB


class KeySpec(NamedTuple):
    """One ``[[auth.keys]]`` entry: a named key, stored as its hash, and its permissions
    (docs/SECURITY.md). Immutable like the sections; a NamedTuple, as ``Key``: defining one
    costs a fifth of what a frozen dataclass does, on every start."""

    name: str
    hash: str  # "blake2b:" + the hex BLAKE2b-512 digest of the key (what `b2sum` prints)
    publish: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    admin: bool = False
    # what the key may make the broker hold (None: its default share, docs/SECURITY.md)
    max_durable_groups: int | None = None
    max_sessions: int | None = None
    max_retained_topics: int | None = None
    max_retained_bytes: int | None = None

    @property
    def limits(self) -> tuple[int | None, int | None, int | None, int | None]:
        """Its own limits, in ``access.Quota``'s order (None: its default share)."""
        return (self.max_durable_groups, self.max_sessions, self.max_retained_topics,
                self.max_retained_bytes)


class AuthOptions(NamedTuple):
    """``[auth]``: the keys clients present (both empty: authentication is off) and how
    long a refusal waits."""

    api_keys: tuple[str, ...] = ()
    keys: tuple[KeySpec, ...] = ()
    failure_delay_ms: int = 1000

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.keys)


class MqttOptions(NamedTuple):
    """``[mqtt]``: the MQTT front end (off unless enabled), its listeners and session
    limits."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    tls_host: str = "127.0.0.1"
    tls_port: int = 8883
    allow_anonymous: bool = False
    max_keepalive: int = 65535
    max_inflight: int = 64
    session_expiry_ms: int = 7 * 24 * 3600 * 1000
    max_sessions: int = 100_000
    queue_qos0: bool = False
    qos0_overflow: str = "block"


class QueueOptions(NamedTuple):
    """``[queues]``: what each subscription or group may hold, and what a full one does."""

    capacity: int = 8192
    capacity_bytes: int = 64 * MiB
    max_bytes_per_connection: int = 64 * MiB
    max_bytes_total: int = 256 * MiB
    overflow: str = "block"
    block_timeout_ms: int = 5000
    default_ttl_ms: int = 0
    expiry_interval_ms: int = 1000
    max_idle_groups: int = 256
    max_durable_groups: int = 100_000


class DeliveryOptions(NamedTuple):
    """``[delivery]``: batching, credit, redelivery and dead letters, group expiry."""

    max_batch: int = 256
    max_batch_bytes: int = 262144
    flush_interval_ms: int = 0
    default_credit: int = 256
    max_inflight_bytes: int = 16 * MiB
    max_inflight_bytes_total: int = 256 * MiB
    retry_backoff_ms: int = 5000
    retry_backoff_max_ms: int = 60000
    max_retries: int = 5
    group_expiry_ms: int = 0


class WalOptions(NamedTuple):
    """``[wal]``: the write-ahead log: fsync policy, segments, retention, cache, shutdown."""

    enabled: bool = True
    fsync: str = "always"
    include_qos0: bool = True
    segment_bytes: int = 64 * MiB
    retention_bytes: int = 1024 * MiB
    retention_ms: int = 0
    cache_bytes: int = 4 * MiB
    read_ahead_bytes: int = 64 * MiB
    maintenance_interval_ms: int = 5000
    unconfirmed_sync_ms: int = 1000
    shutdown_timeout_ms: int = 10000
    max_unwritten_bytes: int = 16 * MiB


class RetainedOptions(NamedTuple):
    """``[retained]``: how many retained values, and how many bytes of them, are kept."""

    max_topics: int = 10_000
    max_bytes: int = 16 * MiB
    max_per_connection: int = 100_000
    max_all_connections: int = 1_000_000


class MetricsOptions(NamedTuple):
    """``[metrics]``: the HTTP listener of /metrics, /health and /ready."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 9090
    tls: bool = False
    token_hash: str = ""
    open_health: bool = True


class TlsOptions(NamedTuple):
    """The certificate material every TLS listener shares (docs/SECURITY.md)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    require_client_cert: bool = False
    client_identity: str = "cn"
    min_version: str = "1.2"


class StorageOptions(NamedTuple):
    """``[storage]``: where the lock file and the log live."""

    data_dir: str = "./data"


class LogOptions(NamedTuple):
    """``[log]``: the broker's own log on stderr: level and format."""

    level: str = "info"
    format: str = "auto"


class Config(NamedTuple):
    """The whole configuration, one frozen section per TOML table (``load`` builds it)."""

    server: ServerOptions = ServerOptions()
    auth: AuthOptions = AuthOptions()
    mqtt: MqttOptions = MqttOptions()
    queues: QueueOptions = QueueOptions()
    delivery: DeliveryOptions = DeliveryOptions()
    wal: WalOptions = WalOptions()
    retained: RetainedOptions = RetainedOptions()
    metrics: MetricsOptions = MetricsOptions()
    tls: TlsOptions = TlsOptions()
    storage: StorageOptions = StorageOptions()
    log: LogOptions = LogOptions()
    # [[bridge]] tables (blipmq_server.bridge.spec.BridgeSpec), in the file's order
    bridges: tuple[Any, ...] = ()


# ----------------------------------------------------------------------------------- schema


class Key(NamedTuple):
    """One configuration key (a row of ``SCHEMA``): its type, allowed values and
    documentation."""

    section: str
    name: str
    kind: type  # int, str, bool or tuple (a list of strings)
    doc: str
    low: int | None = None
    high: int | None = None
    choices: tuple[str, ...] = ()
    check: Callable[[str], str | None] | None = None  # extra rule for strings: the problem
    empty: bool = False  # a string that may be empty ("" = none)

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"BLIPMQ_{self.section}_{self.name}".upper()

    @property
    def default(self) -> Any:
        return getattr(_SECTIONS[self.section](), self.name)

    @property
    def allowed(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.low is not None:
            return f"{self.low}-{self.high}" if self.high is not None else f">= {self.low}"
        return ""


_U32 = 2**32 - 1
_HASH_PREFIX = "blake2b:"


def _is_hash(text: str) -> bool:
    """Whether ``text`` is a key's or token's stored form: "blake2b:" and the 128 lowercase
    hex digits of its BLAKE2b-512 digest (what `b2sum` prints)."""
    hexpart = text[len(_HASH_PREFIX):]
    return (text.startswith(_HASH_PREFIX) and len(hexpart) == 128
            and all(c in "0123456789abcdef" for c in hexpart))


def _token_problem(text: str) -> str | None:
    if not text or _is_hash(text):
        return None  # no token, or a token's hash
    return ("must be \"blake2b:\" and 128 lowercase hex digits: the token's hash "
            "(printf %s \"$TOKEN\" | b2sum), never the token")


def plain_host(host: str) -> bool:
    """Whether ``host`` is plain ASCII with labels of 1-63 characters (the last may be
    empty): what the idna codec would pass through unchanged, so it need not be asked
    (importing it costs every start 0.7 ms; server/listeners.py gives such a host to
    ``getaddrinfo`` as bytes)."""
    labels = host.split(".")
    return host.isascii() and all(0 < len(label) < 64 for label in labels[:-1]) and (
        len(labels[-1]) < 64)


def _host_problem(host: str) -> str | None:
    """Why ``host`` can be no listener's address (the resolver refuses it), or None."""
    if plain_host(host):
        return None
    try:
        host.encode("idna")
    except UnicodeError as exc:
        return f"{host!r} is not a host name or an IP address ({exc})"
    return None


def _fsync_problem(text: str) -> str | None:
    parsed = policy.parse(text)
    return parsed if isinstance(parsed, str) else None


SCHEMA: tuple[Key, ...] = (
    Key("server", "host", str, "Address to listen on (loopback by default)", check=_host_problem),
    Key("server", "port", int, "TCP port for clients (0 picks a free port)", 0, 65535),
    Key("server", "tls", bool, "Also serve the native protocol over TLS, on tls_host:tls_port "
        "([tls] names the certificate; docs/SECURITY.md)"),
    Key("server", "tls_host", str, "Address of the native TLS listener", check=_host_problem),
    Key("server", "tls_port", int, "Port of the native TLS listener (0 picks a free port)",
        0, 65535),
    Key("server", "max_connections", int, "Client connections served at once", 1, 100_000),
    Key("server", "max_message_bytes", int, "Largest payload accepted", 1, 256 * MiB),
    Key("server", "max_topic_bytes", int, "Longest topic name or filter in bytes (MQTT "
        "and the native protocol)", 1, 65535),
    Key("server", "handshake_timeout_ms", int, "Time to complete HELLO+AUTH (MQTT: CONNECT); "
        "over TLS the TLS handshake before it gets as long (0 = no limit)", 0, _U32),
    Key("server", "keepalive_ms", int, "A connection silent this long gets a PING; silent "
        "as long again, it is closed. Also the TCP keepalive idle time (0 = off)", 0, _U32),
    Key("server", "write_timeout_ms", int, "A connection that takes none of what is sent to "
        "it for this long is closed as a slow consumer (0 = never)", 0, _U32),
    Key("server", "max_pending_bytes", int, "Output a connection may owe before the broker "
        "stops reading from it until it catches up", 64 * 1024, 1024 * MiB),
    Key("server", "shutdown_grace_ms", int, "How long shutdown waits to drain deliveries",
        0, _U32),
    Key("server", "max_subscriptions", int, "Subscriptions one connection (native or MQTT) may "
        "hold at once; one more is refused", 1, 10_000_000),
    Key("server", "max_reading_bytes", int, "Frames over 64 KiB that connections (native and "
        "MQTT) are part way through reading, all together; past it a connection waits before "
        "reading its large frame (bounds memory; never less than the largest frame)",
        1 * MiB, 64 * 1024 * MiB),
    Key("auth", "api_keys", tuple, "Accepted API keys, each with full access (the older way: "
        "prefer [[auth.keys]], named and hashed, with permissions); both empty = "
        "authentication disabled"),
    Key("auth", "failure_delay_ms", int, "A refused key is answered after this long (slows "
        "guessing; the broker serves others meanwhile)", 0, 60_000),
    Key("mqtt", "enabled", bool, "Serve MQTT 3.1.1 and 3.1 clients (docs/MQTT.md)"),
    Key("mqtt", "host", str, "Address of the MQTT listener", check=_host_problem),
    Key("mqtt", "port", int, "Port of the MQTT listener (0 picks a free port)", 0, 65535),
    Key("mqtt", "tls", bool, "With mqtt.enabled: also serve MQTT over TLS (mqtts), on "
        "tls_host:tls_port"),
    Key("mqtt", "tls_host", str, "Address of the MQTT TLS listener", check=_host_problem),
    Key("mqtt", "tls_port", int, "Port of the MQTT TLS listener (0 picks a free port)",
        0, 65535),
    Key("mqtt", "allow_anonymous", bool, "Allow a non-loopback MQTT address while "
        "authentication is disabled (auth.api_keys empty)"),
    Key("mqtt", "max_keepalive", int, "Longest keepalive (seconds) a client may ask for; "
        "a CONNECT asking more is refused (CONNACK 2, identifier rejected); 0 from a client "
        "(none) is accepted", 1, 65535),
    Key("mqtt", "max_inflight", int, "Unacknowledged QoS 1/2 deliveries per MQTT "
        "subscription", 1, 65535),
    Key("mqtt", "session_expiry_ms", int, "A persistent session (clean session 0) offline "
        "this long is deleted with its backlog (0 = never)", 0, 2**50),
    Key("mqtt", "max_sessions", int, "Persistent sessions (clean session 0) the broker keeps, "
        "online and offline; a CONNECT that would make one more gets CONNACK 3 (server "
        "unavailable). Each key has a share of it too (docs/SECURITY.md)", 1, 10_000_000),
    Key("mqtt", "queue_qos0", bool, "Keep what a persistent session's QoS 0 subscriptions "
        "match while it is offline (its QoS 1/2 subscriptions keep every message they match, "
        "QoS 0 ones included: docs/MQTT.md)"),
    Key("mqtt", "qos0_overflow", str, "What an MQTT QoS 0 subscription's full queue does with "
        "a new message: block holds its publishers as queues.overflow = block does (a "
        "stalled subscriber holds them up to queues.block_timeout_ms); drop_oldest or "
        "drop_new (mosquitto's) let them go on at once",
        choices=("block", "drop_oldest", "drop_new")),
    Key("queues", "capacity", int, "Messages each subscription or group may hold", 1,
        10_000_000),
    Key("queues", "capacity_bytes", int, "Bytes of messages each subscription or group may "
        "hold (at least server.max_message_bytes)", 1024, 2**50),
    Key("queues", "max_bytes_per_connection", int, "Bytes of messages the queues one "
        "connection reads from may hold together (a group's queue counts for each member); "
        "past it they are full, whatever their own room (0 = no limit)", 0, 2**50),
    Key("queues", "max_bytes_total", int, "Bytes of messages all the queues may hold "
        "together; past it a connection holding its share (this over the connections "
        "reading queues) takes no more, and a queue nobody reads drops its oldest (0 = no "
        "limit)", 0, 2**50),
    Key("queues", "overflow", str, "What a full queue does with a new message",
        choices=("drop_oldest", "drop_new", "block")),
    Key("queues", "block_timeout_ms", int, "With overflow = block: a queue full this long "
        "while publishers wait has its consumers disconnected as slow consumers (0 = never)",
        0, _U32),
    Key("queues", "default_ttl_ms", int, "TTL of messages published without one (0 = never)",
        0, _U32),
    Key("queues", "expiry_interval_ms", int, "How often expired messages are purged (0 = only "
        "when taken)", 0, _U32),
    Key("queues", "max_idle_groups", int, "QoS 0 groups kept with their messages after their "
        "last consumer left; beyond this, the one left longest ago is dropped (0 = a QoS 0 "
        "group goes with its last consumer)", 0, 1_000_000),
    Key("queues", "max_durable_groups", int, "Durable groups (and MQTT persistent sessions' "
        "subscriptions) the broker holds; a subscription that would make one more is "
        "refused. Each key has a share of it too (docs/SECURITY.md)", 1, 10_000_000),
    Key("delivery", "max_batch", int, "Most messages in one DELIVER frame", 1, 65535),
    Key("delivery", "max_batch_bytes", int, "Approximate byte cap of one DELIVER frame",
        1024, 64 * MiB),
    Key("delivery", "flush_interval_ms", int, "Linger before sending a delivery batch "
        "(0 = send as soon as the writer is free)", 0, 10_000),
    Key("delivery", "default_credit", int, "Unacked QoS 1 deliveries a consumer may hold when "
        "it asks for no window", 1, 65535),
    Key("delivery", "max_inflight_bytes", int, "Message bytes the QoS 1 consumers of one "
        "connection (native QoS 1 subscriptions, MQTT QoS 1/2 ones, a bridge's link) may hold "
        "unacked together whatever their windows; past it nothing more is sent to them until "
        "acks make room (one always goes; 0 = no limit)", 0, 2**40),
    Key("delivery", "max_inflight_bytes_total", int, "Message bytes all client connections "
        "together may hold unacked; past it only a connection holding none gets one more "
        "until acks make room (bridges are bounded by their inflight only; 0 = no limit)",
        0, 2**40),
    Key("delivery", "retry_backoff_ms", int, "An unacked QoS 1 delivery is redelivered after "
        "this, doubling each time", 1, _U32),
    Key("delivery", "retry_backoff_max_ms", int, "Cap of the redelivery delay", 1, _U32),
    Key("delivery", "max_retries", int, "Deliveries before a message moves to $dlq/<topic> "
        "(a dead letter is dropped then, not moved again)", 1, 1000),
    Key("delivery", "group_expiry_ms", int, "Drop a durable group that has had no consumer "
        "this long (0 = never)", 0, 2**50),
    Key("wal", "enabled", bool, "Keep the write-ahead log (needed for QoS 1)"),
    Key("wal", "fsync", str, "When appends are forced to disk: always, every_n:N, "
        "interval_ms:M or none (docs/OPERATIONS.md says what each can lose)",
        check=_fsync_problem),
    Key("wal", "include_qos0", bool, "Log QoS 0 messages too (for replay and fleet analytics)"),
    Key("wal", "segment_bytes", int, "Size at which a log segment file is closed", 4096,
        1024 * MiB),
    Key("wal", "retention_bytes", int, "Delete the oldest segments beyond this total "
        "(0 = no cap)", 0, 2**50),
    Key("wal", "retention_ms", int, "Delete segments whose newest record is older "
        "(0 = keep)", 0, 2**50),
    Key("wal", "cache_bytes", int, "Recently written records kept in memory for durable "
        "consumers (0 = read the segment files)", 0, 1024 * MiB),
    Key("wal", "read_ahead_bytes", int, "Records read from the log ahead of durable and "
        "replaying consumers, with the topics their cursors know, all cursors together; past "
        "it the cursors used least recently let go of theirs and read again when their "
        "consumer takes (bounds memory however many replays run)", 1 * MiB, 2**40),
    Key("wal", "maintenance_interval_ms", int, "How often retention and group expiry run",
        100, 3_600_000),
    Key("wal", "unconfirmed_sync_ms", int, "With fsync = always: longest a written record "
        "no publisher waits on (QoS 0, group and ack records) stays unsynced "
        "(0 = sync every batch)", 0, 3_600_000),
    Key("wal", "shutdown_timeout_ms", int, "How long shutdown waits for the log's last "
        "write and fsync", 1, _U32),
    Key("wal", "max_unwritten_bytes", int, "Appended records waiting for the disk beyond "
        "which the broker stops reading publishers until the log caught up (bounds memory "
        "under a flood faster than the disk)", 1 * MiB, 1024 * MiB),
    Key("retained", "max_topics", int, "Topics that may hold a retained value; a retained "
        "publish to one more is refused (0 = retained publishes are refused). Each key has "
        "a share of it too (docs/SECURITY.md)", 0, 10_000_000),
    Key("retained", "max_bytes", int, "Bytes of retained messages kept (also capped at half "
        "of wal.segment_bytes); a retained publish past it is refused. Each key has a share "
        "of it too", 0, 2**40),
    Key("retained", "max_per_connection", int, "Retained values the subscriptions of one "
        "connection may start with, all together (each counts the values its filter matched "
        "when it was made, for as long as it lasts); a subscription that would pass it is "
        "refused (LIMIT; MQTT: SUBACK 0x80). Each waiting value costs memory until sent "
        "(0 = no limit)", 0, 2**40),
    Key("retained", "max_all_connections", int, "Retained values the subscriptions of all "
        "connections may start with together, counted as for max_per_connection (0 = no "
        "limit)", 0, 2**40),
    Key("metrics", "enabled", bool, "Serve /metrics, /health and /ready over HTTP"),
    Key("metrics", "host", str, "Address of the metrics listener", check=_host_problem),
    Key("metrics", "port", int, "Port of the metrics listener (0 picks a free port)", 0, 65535),
    Key("metrics", "tls", bool, "Serve the metrics listener over HTTPS instead of HTTP"),
    Key("metrics", "token_hash", str, "The hash (\"blake2b:<hex>\", from `b2sum`) of a token "
        "that /metrics then requires: Authorization: Bearer <token>, or basic auth with the "
        "token as the password (empty = no token)", check=_token_problem, empty=True),
    Key("metrics", "open_health", bool, "With token_hash: /health and /ready stay open "
        "without the token"),
    Key("tls", "cert_file", str, "PEM file of the broker's certificate (and its chain); "
        "needed once a listener serves TLS", empty=True),
    Key("tls", "key_file", str, "PEM file of the certificate's private key (empty: it is in "
        "cert_file)", empty=True),
    Key("tls", "ca_file", str, "PEM file of the CAs whose client certificates are accepted "
        "(empty: clients are not asked for one)", empty=True),
    Key("tls", "require_client_cert", bool, "Refuse TLS clients without a certificate from "
        "ca_file (on every TLS listener, metrics too)"),
    Key("tls", "client_identity", str, "The client certificate's field that names the "
        "client: its subject's common name, or its first DNS, email or URI subject "
        "alternative name", choices=("cn", "san_dns", "san_email", "san_uri")),
    Key("tls", "min_version", str, "Oldest TLS version accepted (1.3 is negotiated whenever "
        "the client has it)", choices=("1.2", "1.3")),
    Key("storage", "data_dir", str, "Data directory: the lock file and the log (wal/)"),
    Key("log", "level", str, "Log level", choices=("debug", "info", "warning", "error")),
    Key("log", "format", str, "auto = rich on a terminal, plain otherwise",
        choices=("auto", "plain", "rich", "json")),
)

_SECTIONS: dict[str, Callable[..., Any]] = {
    "server": ServerOptions,
    "auth": AuthOptions,
    "mqtt": MqttOptions,
    "queues": QueueOptions,
    "delivery": DeliveryOptions,
    "wal": WalOptions,
    "retained": RetainedOptions,
    "metrics": MetricsOptions,
    "tls": TlsOptions,
    "storage": StorageOptions,
    "log": LogOptions,
}
_BY_DOTTED = {k.dotted: k for k in SCHEMA}
_BY_ENV = {k.env: k for k in SCHEMA}
_ENV_PREFIXES = tuple(f"BLIPMQ_{s.upper()}_" for s in _SECTIONS)
# BLIPMQ_* names that are not broker settings: the client commands' (blipmq_cli) and what
# ``blipmq sub --exec`` gives its children (one of which starts with a section's prefix)
_OTHER_ENV = frozenset({
    "BLIPMQ_ADDR", "BLIPMQ_API_KEY", "BLIPMQ_TIMEOUT", "BLIPMQ_CAFILE", "BLIPMQ_CERT",
    "BLIPMQ_CERT_KEY", "BLIPMQ_INSECURE", "BLIPMQ_TOPIC", "BLIPMQ_OFFSET", "BLIPMQ_QOS",
    "BLIPMQ_KEY", "BLIPMQ_DELIVERY_COUNT",
})


def _describe(value: object) -> str:
    kind = {bool: "boolean", int: "integer", str: "string", float: "number"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} {value!r}"


def _check(key: Key, value: object, name: str) -> object:
    """Validate an already-typed value for ``key``; ``name`` is what the error names."""
    want = {int: "an integer", str: "a string", bool: "a boolean", tuple: "a list of strings"}
    if key.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif key.kind is tuple:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, key.kind)
    if not ok:
        raise ConfigError(f"expected {want[key.kind]}, got {_describe(value)}", name)
    if key.kind is int:
        assert isinstance(value, int)
        if (key.low is not None and value < key.low) or (
            key.high is not None and value > key.high
        ):
            raise ConfigError(f"{value} is out of range ({key.allowed})", name)
    if key.kind is str:
        assert isinstance(value, str)
        if key.choices and value not in key.choices:
            raise ConfigError(f"{value!r} is not {key.allowed}", name)
        if not value.strip() and not key.empty:
            raise ConfigError("must not be empty", name)
        if "\0" in value:  # no path, host, name or key holds one
            raise ConfigError("must not contain a NUL character", name)
        if key.check is not None:
            problem = key.check(value)
            if problem:
                raise ConfigError(problem, name)
    if key.kind is tuple:
        return tuple(str(v) for v in value)  # type: ignore[union-attr]
    return value


def _parse_text(key: Key, text: str, name: str) -> object:
    """A string from the environment or a flag, converted to the key's type."""
    if key.kind is int:
        try:
            return int(text.strip())
        except ValueError:
            raise ConfigError(f"expected an integer, got {text!r}", name) from None
    if key.kind is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"expected true or false, got {text!r}", name)
    if key.kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


_MAX_FILE_CHARS = 4 << 20  # a config file, [[bridge]] tables and all, is far smaller


def _read_file(path: str | os.PathLike[str], regular: bool = False
               ) -> dict[str, dict[str, object]]:
    """``regular``: refuse anything but a regular file (a reload: the pipe of
    ``--config <(...)`` was read once, at the start, and a FIFO would hold the read until
    someone writes to it). Checked on the opened descriptor, so a FIFO renamed into the
    file's place between a check and the open cannot slip through."""
    import tomllib  # only with a file: a broker on its defaults, flags and environment
    # never loads it (nor the datetime module it brings)

    p = os.fspath(path)  # not pathlib: the broker process does not need it otherwise
    try:
        fd = os.open(p, os.O_RDONLY | (os.O_NONBLOCK if regular else 0))
        if regular and not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"config file {p} is not a regular file (a pipe or a device): "
                              "a reload reads the file again, so it must be one")
        with open(fd, encoding="utf-8") as f:
            text = f.read(_MAX_FILE_CHARS + 1)  # /dev/zero, a log given by mistake: not all
        if len(text) > _MAX_FILE_CHARS:
            raise ConfigError(f"config file {p} is over {_MAX_FILE_CHARS >> 20} MiB: not a "
                              "configuration")
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {p}: {exc}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: {_syntax_error(str(exc))}") from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        raise ConfigError(f"{p}: arrays or tables nested too deeply: not a configuration"
                          ) from None
    out: dict[str, dict[str, object]] = {}
    for section, table in doc.items():
        if section == "bridge":  # [[bridge]]: an array of tables
            from blipmq_server.bridge.spec import parse_bridges

            out["bridge"] = {"bridges": parse_bridges(table)}
            continue
        if section not in _SECTIONS:
            raise ConfigError(f"unknown section (known: {', '.join(_SECTIONS)})", f"[{section}]")
        if not isinstance(table, dict):
            raise ConfigError("must be a table", f"[{section}]")
        for name, value in table.items():
            if (section, name) == ("auth", "keys"):
                out.setdefault(section, {})[name] = _key_specs(value)
                continue
            key = _BY_DOTTED.get(f"{section}.{name}")
            if key is None:
                raise ConfigError("unknown key", f"{section}.{name}")
            out.setdefault(section, {})[name] = _check(key, value, key.dotted)
    return out


def _hashed(key: str) -> str:
    """An ``api_keys`` entry as the broker keeps it: its digest, as ``[[auth.keys]]`` has
    it (one already in that form stays)."""
    if _is_hash(key):
        return key
    try:  # hashlib's blake2b without hashlib (which loads OpenSSL's libcrypto)
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - a Python built without the module
        from hashlib import blake2b
    return _HASH_PREFIX + blake2b(key.encode("utf-8")).hexdigest()
_SPEC_LISTS = ("publish", "publish_deny", "subscribe", "subscribe_deny")
# a key's own limits (``KeySpec``): the most each may be
_SPEC_LIMITS = {"max_durable_groups": 10_000_000, "max_sessions": 10_000_000,
                "max_retained_topics": 10_000_000, "max_retained_bytes": 2**40}


def _key_specs(value: object) -> tuple[KeySpec, ...]:
    """``[[auth.keys]]`` tables as KeySpecs; a ConfigError names the entry and field."""
    from blipmq_server.protocol.names import WIRE_TOPIC_BYTES, filter_problem

    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError("must be an array of tables ([[auth.keys]])", "auth.keys")
    specs: list[KeySpec] = []
    seen: set[str] = set()
    for i, table in enumerate(value):
        where = f"auth.keys[{i}]"
        unknown = sorted(set(table) - {"name", "hash", "admin", *_SPEC_LISTS, *_SPEC_LIMITS})
        if unknown:
            raise ConfigError(f"unknown field {unknown[0]!r} (known: name, hash, publish, "
                              "publish_deny, subscribe, subscribe_deny, admin, "
                              f"{', '.join(_SPEC_LIMITS)})", where)
        name = table.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError("needs a name (a non-empty string)", where)
        where = f"auth.keys[{i}] ({name})"
        if name == "*":  # what the api_keys keys make belongs to "*": not a named key's
            raise ConfigError("the name '*' is the identity of auth.api_keys (full access): "
                              "choose another", where)
        if name in seen:
            raise ConfigError("a second key with this name", where)
        seen.add(name)
        digest = table.get("hash")
        if not isinstance(digest, str) or not _is_hash(digest):
            raise ConfigError("hash must be \"blake2b:\" and 128 lowercase hex digits (what "
                              "`blipmq keys new` prints; never the key itself)", where)
        lists: dict[str, tuple[str, ...]] = {}
        for field_name in _SPEC_LISTS:
            filters = table.get(field_name, [])
            if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
                raise ConfigError(f"{field_name} must be a list of topic filters", where)
            for f in filters:
                problem = filter_problem(f, WIRE_TOPIC_BYTES)
                if problem:
                    raise ConfigError(f"{field_name}: {problem}", where)
            lists[field_name] = tuple(filters)
        admin = table.get("admin", False)
        if not isinstance(admin, bool):
            raise ConfigError("admin must be true or false", where)
        limits: dict[str, int] = {}
        for field_name, high in _SPEC_LIMITS.items():
            if field_name not in table:
                continue
            n = table[field_name]
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= high:
                raise ConfigError(f"{field_name} must be an integer from 0 to {high} (absent: "
                                  "the key's share of the broker-wide cap)", where)
            limits[field_name] = n
        specs.append(KeySpec(name, digest, admin=admin, **lists, **limits))
    return tuple(specs)


def _syntax_error(message: str) -> str:
    """tomllib's "Invalid value (at line 2, column 8)" as "TOML syntax error at line 2,
    column 8: invalid value"."""
    what, _, where = message.rpartition(" (")
    if not what or not where.startswith("at ") or not where.endswith(")"):
        return f"TOML syntax error: {message}"
    return f"TOML syntax error {where[:-1]}: {what[:1].lower()}{what[1:]}"


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    regular: bool = False,
) -> Config:
    """Build the configuration; raises ConfigError naming the first bad key. ``regular``:
    the file must be a regular one (a reload's)."""
    values = _read_file(path, regular) if path is not None else {}
    for name, text in (os.environ if env is None else env).items():
        if not name.startswith(_ENV_PREFIXES) or name in _OTHER_ENV:
            continue
        key = _BY_ENV.get(name)
        if key is None:
            raise ConfigError("unknown setting (see docs/CONFIG.md for the names)", name)
        value = _check(key, _parse_text(key, text, name), name)
        values.setdefault(key.section, {})[key.name] = value
    for dotted, raw in (overrides or {}).items():
        if dotted == "auth.keys":  # KeySpecs, or tables as a TOML file has them
            specs = raw if all(isinstance(k, KeySpec) for k in raw) else _key_specs(raw)  # type: ignore[union-attr]
            values.setdefault("auth", {})["keys"] = tuple(specs)
            continue
        key = _BY_DOTTED.get(dotted)
        if key is None:
            raise ConfigError("unknown key", dotted)
        value = _parse_text(key, raw, dotted) if isinstance(raw, str) else raw
        values.setdefault(key.section, {})[key.name] = _check(key, value, dotted)
    auth = values.get("auth", {})
    if auth.get("api_keys"):  # kept hashed from here on, like [[auth.keys]] (never in clear)
        auth["api_keys"] = tuple(_hashed(k) for k in auth["api_keys"])  # type: ignore[union-attr]
    config = Config(**{s: factory(**values.get(s, {})) for s, factory in _SECTIONS.items()},
                    bridges=values.get("bridge", {}).get("bridges", ()))  # type: ignore[arg-type]
    _check_together(config)
    return config


def env_doubts(env: Mapping[str, str] | None = None) -> list[str]:
    """Lines for ``BLIPMQ_*`` names that are no setting yet look like a misspelled one
    (``BLIPMQ_SERVR_PORT``). ``load`` refuses a misspelled key after a section's prefix;
    these, outside every section, may be another program's, so they are only reported."""
    lines = []
    for name in sorted(os.environ if env is None else env):
        if not name.startswith("BLIPMQ_") or name.startswith(_ENV_PREFIXES) or name in _OTHER_ENV:
            continue
        import difflib  # only when such a name is there

        close = difflib.get_close_matches(name, _BY_ENV, n=1, cutoff=0.85)
        if close:
            lines.append(f"{name} is not a setting and is ignored; did you mean {close[0]}?")
    return lines


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    import ipaddress  # here, not at the top: the broker defers it (deferred.py)

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _check_keys(auth: AuthOptions) -> None:
    """One key is one identity: a hash listed twice (in ``api_keys``, in ``[[auth.keys]]``
    or across the two) is refused, naming both entries; otherwise which entry's permissions
    the key had would depend on the order of the entries."""
    first: dict[str, str] = {}
    entries = [*((f"auth.api_keys[{i}]", h) for i, h in enumerate(auth.api_keys)),
               *((f"auth.keys[{i}] ({spec.name})", spec.hash)
                 for i, spec in enumerate(auth.keys))]
    for where, key_hash in entries:
        earlier = first.setdefault(key_hash, where)
        if earlier != where:
            raise ConfigError(f"the same key (hash) as {earlier}: a key is one identity, "
                              "list it once", where)


def _check_together(config: Config) -> None:
    """Refuse combinations of values that cannot work together."""
    _check_keys(config.auth)
    check_anonymous(config)
    _check_bridges(config)
    largest = config.server.max_message_bytes
    if config.queues.capacity_bytes < largest:
        raise ConfigError(
            f"{config.queues.capacity_bytes} is less than server.max_message_bytes ({largest}): "
            "a queue could never hold the largest message", "queues.capacity_bytes")
    check_tls(config)


def check_anonymous(config: Config, reloading: bool = False) -> None:
    """Refuse authentication off while an MQTT listener is reachable beyond loopback
    (unless ``mqtt.allow_anonymous`` or, over TLS, ``tls.require_client_cert``). A reload
    (``reloading``) asks it of the listeners in force with the new keys: ``[mqtt]``
    changes only with a restart, so its advice differs."""
    m = config.mqtt
    if not m.enabled or config.auth.enabled or m.allow_anonymous:
        return
    if not _loopback(m.host):
        where, key, what = m.host, "mqtt.host", "MQTT"
    elif m.tls and not config.tls.require_client_cert and not _loopback(m.tls_host):
        where, key, what = m.tls_host, "mqtt.tls_host", "MQTT over TLS"
    else:
        return
    if reloading:
        without = ("without keys or tls.require_client_cert" if key == "mqtt.tls_host"
                   else "without keys")
        raise ConfigError(
            f"{what} listens on {where}: a configuration {without} would admit anyone "
            "there with full access; keep a key, or move the listener to loopback (or set "
            "mqtt.allow_anonymous = true) and restart", key)
    also = " or tls.require_client_cert" if key == "mqtt.tls_host" else ""
    raise ConfigError(
        f"{what} would listen on {where} with authentication disabled: set auth.api_keys"
        f"{also}, listen on loopback, or set mqtt.allow_anonymous = true to allow it", key)


def _check_bridges(config: Config) -> None:
    """Bridges read the log, and their rules' filters must be ones the broker takes."""
    if not config.bridges:
        return
    if not config.wal.enabled:
        raise ConfigError("bridges forward from the write-ahead log: wal.enabled must be true "
                          "(or remove the [[bridge]] tables)", "bridge")
    cap = config.server.max_topic_bytes
    for i, spec in enumerate(config.bridges):
        for rule in spec.rules:
            size = len(rule.local_filter.encode("utf-8"))
            if size > cap:
                text = rule.text()  # a filter too long is long: its start says which
                shown = repr(text) if len(text) <= 80 else repr(text[:60]) + "..."
                raise ConfigError(f"the rule {shown}: the local filter is {size} bytes long, "
                                  f"server.max_topic_bytes is {cap}",
                                  f"bridge[{i}] ({spec.name})")


def tls_listeners(config: Config) -> tuple[str, ...]:
    """The switches of the listeners that serve TLS (``server.tls``, ...): empty, no TLS."""
    on = (("server.tls", config.server.tls),
          ("mqtt.tls", config.mqtt.enabled and config.mqtt.tls),
          ("metrics.tls", config.metrics.enabled and config.metrics.tls))
    return tuple(name for name, served in on if served)


def check_tls(config: Config) -> None:
    """A listener that serves TLS needs a certificate file and key that exist; client
    certificates need the CA that issues them. The files' contents are checked when the
    server loads them (blipmq_server/server/tls.py): that needs ssl, this module does not."""
    users = tls_listeners(config)
    if not users:
        return
    t = config.tls
    if not t.cert_file.strip():
        raise ConfigError(f"must be set: {users[0]} is on", "tls.cert_file")
    if t.require_client_cert and not t.ca_file.strip():
        raise ConfigError("must be set: tls.require_client_cert is on", "tls.ca_file")
    for name in ("cert_file", "key_file", "ca_file"):
        path = getattr(t, name)
        if not path:
            continue
        if not os.path.isfile(path):
            raise ConfigError(f"{path} not found" if not os.path.exists(path)
                              else f"{path} is not a file", f"tls.{name}")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{path} is not readable by this user", f"tls.{name}")


# ----------------------------------------------------------------------------- default file


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


# Where the file `blipmq config init` writes differs from the code's defaults: MQTT is on
# (on 127.0.0.1:1883) for a broker set up to serve devices, and off in the code so that
# tests and scripts starting several brokers do not fight over port 1883.
_WRITTEN: dict[str, object] = {"mqtt.enabled": True}


def default_text() -> str:
    """The commented default configuration (what `blipmq config init` writes): the code's
    defaults, except ``_WRITTEN``."""
    lines = [
        "# BlipMQ broker configuration. Every key is optional; shown here with its default.",
        "# Environment variables override this file (BLIPMQ_<SECTION>_<KEY>, e.g.",
        "# BLIPMQ_SERVER_PORT=7900), and `blipmq start` flags override both.",
        "# Reference: docs/CONFIG.md",
    ]
    section = None
    for key in SCHEMA:
        if key.section != section:
            section = key.section
            lines += ["", f"[{section}]"]
        allowed = f" ({key.allowed})" if key.allowed else ""
        lines.append(f"# {key.doc}{allowed}")
        value = _WRITTEN.get(key.dotted, key.default)
        lines.append(f"{key.name} = {_toml_value(value)}")
        if key.dotted == "auth.api_keys":
            lines += _KEYS_EXAMPLE
    return "\n".join([*lines, "", *_BRIDGE_EXAMPLE]) + "\n"


_KEYS_EXAMPLE = [
    "# Named keys, stored as hashes, with permissions (docs/SECURITY.md). `blipmq keys new",
    "# NAME --publish F --subscribe F` mints a key and prints its stanza, such as:",
    "# [[auth.keys]]",
    "# name = \"hall-sensor\"",
    "# hash = \"blake2b:<128 hex digits>\"",
    "# publish = [\"sensors/hall/#\"]",
    "# subscribe = [\"cmd/hall/#\"]",
    "# admin = false",
    "# A key's share of what the broker holds, when the default (docs/SECURITY.md) does not",
    "# fit: max_durable_groups, max_sessions, max_retained_topics, max_retained_bytes, e.g.",
    "# max_retained_topics = 8000",
]


_BRIDGE_EXAMPLE = [
    "# Bridges to upstream brokers: store and forward through outages (docs/BRIDGE.md).",
    "# Rules in mosquitto's vocabulary: <pattern> [out|in|both [qos [local-prefix",
    "# remote-prefix]]]. Any number of [[bridge]] tables, such as:",
    "# [[bridge]]",
    "# name = \"cloud\"",
    "# addresses = [\"mqtt.example.net:8883\"]",
    "# tls = true",
    "# username = \"gateway-17\"",
    "# password = \"secret\"",
    "# topics = [\"sensors/# out 1 '' site17/\", \"cmd/# in 1 '' site17/\"]",
]


def write_default(path: str | os.PathLike[str]) -> None:
    p = os.fspath(path)
    if os.path.exists(p):
        raise ConfigError(f"{p} already exists; not overwriting it")
    with open(p, "w", encoding="utf-8") as f:
        f.write(default_text())


def option_fields() -> list[str]:
    """Every dotted key of ``Config`` but ``auth.keys`` (an array of tables, read apart and
    documented in docs/SECURITY.md); tests check SCHEMA covers exactly these."""
    return [f"{s}.{f}" for s in Config._fields if s in _SECTIONS
            for f in _SECTIONS[s]._fields
            if (s, f) != ("auth", "keys")]

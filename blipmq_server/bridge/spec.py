"""``[[bridge]]`` tables: one upstream broker, its addresses and credentials, and topic
rules in mosquitto.conf's vocabulary (docs/CONFIG.md, "Bridges").

A rule is ``<pattern> [out|in|both [<qos> [<local-prefix> <remote-prefix>]]]``, as
mosquitto's ``topic`` line: the local topic is ``local-prefix + pattern`` and the remote
one ``remote-prefix + pattern``; ``""`` writes an empty prefix, and an empty pattern maps
the one topic the prefixes name. QoS 2 rules need an MQTT upstream. Pure: no I/O.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from blipmq_server.broker.access import matches
from blipmq_server.broker.core import BRIDGE_GROUPS
from blipmq_server.errors import ConfigError
from blipmq_server.protocol.names import (
    WIRE_TOPIC_BYTES,
    filter_problem,
    group_problem,
    topic_problem,
)

DIRECTIONS = ("out", "in", "both")
PROTOCOLS = ("mqtt", "blipmq")
BACKLOG_POLICIES = ("drop_oldest", "block")
QOS2_INFLIGHT = 20  # the default window of a bridge with an out rule at QoS 2


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    direction: str = "out"
    qos: int = 0
    local_prefix: str = ""
    remote_prefix: str = ""

    @property
    def local_filter(self) -> str:
        return self.local_prefix + self.pattern

    @property
    def remote_filter(self) -> str:
        return self.remote_prefix + self.pattern

    @property
    def sends(self) -> bool:
        return self.direction in ("out", "both")

    @property
    def receives(self) -> bool:
        return self.direction in ("in", "both")

    def to_remote(self, topic: str) -> str:
        """A local topic this rule's local filter matched, as the upstream names it: the
        local prefix swapped for the remote one, and the prefix's parent level for the
        other's (``edge`` <-> ``cloud`` for ``# both 1 edge/ cloud/``: ``edge/#`` matches
        ``edge`` too). One to one: ``to_local(to_remote(t)) == t``. "" when the upstream has
        no name for it that the remote filter matches: the parent level of a prefix whose
        counterpart has none (``edge`` for ``# out 1 edge/ ""``: upstream's ``edge`` is
        ``edge/edge``'s name), or a name starting with ``$`` under a wildcard."""
        return self._seen(_swap(topic, self.local_prefix, self.remote_prefix),
                          self.remote_filter)

    def to_local(self, topic: str) -> str:
        """An upstream topic this rule's remote filter matched, as the local log names it
        (``to_remote`` the other way round; "" when it has no local name: the upstream
        cannot write, say, ``$SYS/...`` here through ``# in 1 '' cloud/``)."""
        return self._seen(_swap(topic, self.remote_prefix, self.local_prefix),
                          self.local_filter)

    def _seen(self, name: str, topic_filter: str) -> str:
        """``name`` when this rule's filter on the other side matches it, else ""."""
        if name and (matches(topic_filter, name) if self.pattern else name == topic_filter):
            return name
        return ""

    def text(self) -> str:
        return " ".join([self.pattern or '""', self.direction, str(self.qos),
                         self.local_prefix or '""', self.remote_prefix or '""'])


def _swap(topic: str, old: str, new: str) -> str:
    """``topic`` (matched by ``old + pattern``) with the prefix ``old`` swapped for ``new``:
    the only topic such a filter matches that does not start with its prefix is the
    prefix's parent level (``a/#`` matches ``a``), which becomes the other's, if it has
    one; "" when the result is no topic name."""
    if topic.startswith(old):
        return new + topic[len(old):]
    if old.endswith("/") and topic == old[:-1] and new.endswith("/"):
        return new[:-1]
    return ""


@dataclass(frozen=True, slots=True)
class BridgeSpec:
    name: str
    addresses: tuple[tuple[str, int], ...]
    rules: tuple[Rule, ...]
    protocol: str = "mqtt"
    client_id: str = ""  # MQTT; "" = "blipmq-bridge-<name>"
    username: str = ""
    password: str = field(default="", repr=False)  # MQTT password, or the native API key
    keepalive_s: int = 60
    inflight: int = 100
    max_rate: int = 0  # messages per second out, 0 = as fast as acks come
    max_retries: int = 5
    # payload bytes an out message may have (0 = no limit): a larger one goes to the local
    # dead letters, not to an upstream known to drop it (AWS IoT Core takes 128 KiB)
    max_message_bytes: int = 0
    backoff_min_ms: int = 1000
    backoff_max_ms: int = 60000
    connect_timeout_ms: int = 10000
    outgoing_retain: bool = True
    # MQTT: CONNECT as a bridge (protocol level 0x84, as mosquitto's bridges do): a mosquitto
    # upstream then sends the bridge none of its own messages back; one that refuses it is
    # asked again with plain 3.1.1
    try_private: bool = True
    backlog: str = "drop_oldest"
    state_topic: str = ""  # upstream topic for "1"/"0" (birth and will); "" = none
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    insecure: bool = False
    alpn: tuple[str, ...] = ()

    @property
    def mqtt_client_id(self) -> str:
        return self.client_id or f"blipmq-bridge-{self.name}"

    @property
    def sends_qos2(self) -> bool:
        """Whether an out rule forwards at QoS 2 (its exchanges outlive a link)."""
        return any(r.sends and r.qos == 2 for r in self.rules)

    @property
    def persistent(self) -> bool:
        """Whether the MQTT session upstream must outlive a link (clean session 0): in rules
        (what arrives while the link is down), out rules at QoS 2 (packet ids in flight)."""
        return self.sends_qos2 or any(r.receives for r in self.rules)

    @property
    def group(self) -> str:
        """The durable group whose cursor is this bridge's backlog."""
        return BRIDGE_GROUPS + self.name


def native_problem(rules: tuple[Rule, ...], client_id: str) -> str | None:
    """Why these rules cannot run over the native protocol, or None. Its in rules read a
    durable group on the upstream named by the client id; and as a native upstream cannot
    tell the bridge's own messages from others', an in rule may not meet an out rule there
    (what went out would come straight back in)."""
    receiving = [r for r in rules if r.receives]
    if not receiving:
        return None
    for r in receiving:
        for s in rules:
            if s.sends and filters_meet(r.remote_filter, s.remote_filter):
                what = (f"the rule {r.text()!r} goes both ways" if r is s else
                        f"the rules {r.text()!r} and {s.text()!r} meet on the upstream")
                return (f"{what}: over the native protocol what goes out would come back in "
                        "(use protocol = \"mqtt\", or in and out rules that do not overlap)")
    problem = group_problem(client_id)
    if problem is None and client_id.startswith(BRIDGE_GROUPS):
        problem = f"names starting with {BRIDGE_GROUPS!r} are the upstream's own bridges'"
    if problem:
        return (f"client_id {client_id!r} names the upstream's group for the in rules "
                f"over the native protocol: {problem}")
    return None


def filters_meet(a: str, b: str) -> bool:
    """Whether some topic matches both filters."""
    left, right = a.split("/"), b.split("/")
    for i in range(max(len(left), len(right))):
        x = left[i] if i < len(left) else None
        y = right[i] if i < len(right) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != y and x != "+" and y != "+":
            return False
    return True


_INTS = {"keepalive_s": (0, 65535), "inflight": (1, 65535), "max_rate": (0, 10_000_000),
         "max_retries": (1, 1000), "max_message_bytes": (0, 268_435_455),
         "backoff_min_ms": (1, 3_600_000),
         "backoff_max_ms": (1, 3_600_000), "connect_timeout_ms": (1, 600_000)}
_STRS = ("protocol", "client_id", "username", "password", "backlog", "state_topic",
         "ca_file", "cert_file", "key_file", "server_name")
_BOOLS = ("outgoing_retain", "try_private", "tls", "insecure")
_KNOWN = ("name", "addresses", "topics", "alpn", *_INTS, *_STRS, *_BOOLS)
# options that mean TLS: one of them set turns ``tls`` on (as a CA file, a certificate or
# --insecure does for the CLI, and bridge_cafile and the like do for mosquitto)
TLS_OPTIONS = ("ca_file", "cert_file", "key_file", "server_name", "insecure", "alpn")


def credentials_problem(options: dict[str, object], protocol: str) -> str | None:
    """Why the client id and credentials cannot go in the CONNECT (or the native HELLO and
    AUTH), or None: each is a string with a u16 length there, and MQTT's strings hold no
    U+0000 and its CONNECT no password without a user name (MQTT-3.1.2-22). (The will is
    the state topic, checked as a topic, and ``0``.)"""
    for key in ("client_id", "username", "password"):
        text = str(options.get(key, ""))
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            return f"{key} is not valid UTF-8"
        if size > 0xFFFF:
            carrier = "an MQTT CONNECT" if protocol == "mqtt" else "the native handshake"
            return (f"{key} is {size} bytes long in UTF-8: {carrier} carries at most "
                    "65,535")
        if protocol == "mqtt" and key != "password" and "\0" in text:
            return f"{key} holds U+0000, which MQTT strings may not"
    if protocol == "mqtt" and options.get("password") and not options.get("username"):
        return ("password needs a username: MQTT 3.1.1 sends no password without one "
                "(MQTT-3.1.2-22)")
    return None


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or text.endswith("]"):  # no port: HOST, or [IPv6]
        host, port = text, str(default_port)
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    if (not host or not port.isdigit() or not 0 < int(port) < 65536
            or not (_ip(host, 6) if bracketed else _host_name(host))):
        raise ValueError(f"bad address {text!r} (HOST:PORT, HOST a name, an IPv4 address or "
                         "a bracketed IPv6 one: [::1]:1883)")
    return host, int(port)


def _host_name(host: str) -> bool:
    """A DNS name (labels of 1-63 letters, digits, hyphens or non-ASCII letters, as IDNA
    encodes them, the last one not all digits) or an IPv4 address."""
    if _NUMERIC.fullmatch(host):
        return _ip(host, 4)
    try:
        ascii_name = host.encode("idna").decode("ascii")
    except UnicodeError:
        return False
    labels = ascii_name.rstrip(".").split(".")
    return len(ascii_name) <= 253 and all(_LABEL.fullmatch(label) for label in labels)


def _ip(host: str, version: int) -> bool:
    """Whether ``host`` is an IP address of that version (4 or 6)."""
    import ipaddress  # here: the broker defers it (deferred.py)

    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == version


_NUMERIC = re.compile(r"[0-9.]+|.*\.[0-9]+\.?")  # dotted numbers, or a numeric last label
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def parse_rule(text: str) -> Rule:
    """One ``topics`` entry; ValueError says what is wrong."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    if not 1 <= len(words) <= 5 or len(words) == 4:
        raise ValueError(f"{text!r}: expected '<pattern> [out|in|both [<qos> [<local-prefix> "
                         "<remote-prefix>]]]'")
    pattern = words[0]
    direction = words[1] if len(words) > 1 else "out"
    if direction not in DIRECTIONS:
        raise ValueError(f"{text!r}: direction must be out, in or both, not {direction!r}")
    qos_text = words[2] if len(words) > 2 else "0"
    if qos_text not in ("0", "1", "2"):
        raise ValueError(f"{text!r}: qos must be 0, 1 or 2, not {qos_text!r}")
    local, remote = (words[3], words[4]) if len(words) == 5 else ("", "")
    rule = Rule(pattern, direction, int(qos_text), local, remote)
    if not pattern and not (local or remote):
        raise ValueError(f"{text!r}: an empty pattern needs a prefix naming the topic")
    for prefix in (local, remote):
        if "+" in prefix or "#" in prefix:
            raise ValueError(f"{text!r}: a prefix may not hold wildcards")
    for what, name in (("local", rule.local_filter), ("remote", rule.remote_filter)):
        problem = (filter_problem(name, WIRE_TOPIC_BYTES) if pattern
                   else topic_problem(name, WIRE_TOPIC_BYTES))
        if problem:
            raise ValueError(f"{text!r}: the {what} topic {name!r}: {problem}")
    return rule


def parse_bridges(value: object) -> tuple[BridgeSpec, ...]:
    """``[[bridge]]`` tables as BridgeSpecs; a ConfigError names the table and the field."""
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ConfigError("must be an array of tables ([[bridge]])", "bridge")
    specs: list[BridgeSpec] = []
    for i, table in enumerate(value):
        where = f"bridge[{i}]"
        unknown = sorted(set(table) - set(_KNOWN))
        if unknown:
            raise ConfigError(f"unknown field {unknown[0]!r} (known: {', '.join(_KNOWN)})", where)
        name = table.get("name")
        if not isinstance(name, str) or not name or not all(
                c.isalnum() or c in "-_." for c in name):
            raise ConfigError("needs a name of letters, digits, '-', '_' and '.'", where)
        where = f"bridge[{i}] ({name})"
        if any(s.name == name for s in specs):
            raise ConfigError("a second bridge with this name", where)
        options: dict[str, object] = {}
        for key, (low, high) in _INTS.items():
            if key in table:
                v = table[key]
                if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                    raise ConfigError(f"{key} must be an integer from {low} to {high}", where)
                options[key] = v
        for key in _STRS:
            if key in table:
                if not isinstance(table[key], str):
                    raise ConfigError(f"{key} must be a string", where)
                options[key] = table[key]
        for key in _BOOLS:
            if key in table:
                if not isinstance(table[key], bool):
                    raise ConfigError(f"{key} must be true or false", where)
                options[key] = table[key]
        alpn = table.get("alpn", [])
        if not isinstance(alpn, list) or not all(isinstance(a, str) and a for a in alpn):
            raise ConfigError("alpn must be a list of protocol names", where)
        protocol = options.get("protocol", "mqtt")
        if protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {', '.join(PROTOCOLS)}", where)
        if options.get("backlog", "drop_oldest") not in BACKLOG_POLICIES:
            raise ConfigError(f"backlog must be one of {', '.join(BACKLOG_POLICIES)}", where)
        if alpn:
            options["alpn"] = tuple(alpn)
        tls_set = [k for k in TLS_OPTIONS if options.get(k)]
        if tls_set and options.get("tls") is False:
            raise ConfigError(f"tls = false, but {tls_set[0]} is set, which means TLS "
                              f"(remove tls = false, or {tls_set[0]})", where)
        if tls_set:
            options["tls"] = True
        default_port = {"mqtt": 8883 if options.get("tls") else 1883,
                        "blipmq": 7879 if options.get("tls") else 7878}[str(protocol)]
        raw = table.get("addresses")
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list) or not raw or not all(isinstance(a, str) for a in raw):
            raise ConfigError("addresses must list one or more HOST:PORT", where)
        try:
            addresses = tuple(parse_address(a, default_port) for a in raw)
        except ValueError as exc:
            raise ConfigError(str(exc), where) from None
        topics = table.get("topics")
        if not isinstance(topics, list) or not topics or not all(
                isinstance(t, str) for t in topics):
            raise ConfigError("topics must list one or more rules, e.g. "
                              "\"sensors/# out 1 '' site1/\"", where)
        try:
            rules = tuple(parse_rule(t) for t in topics)
        except ValueError as exc:
            raise ConfigError(str(exc), where) from None
        if protocol == "blipmq" and any(r.qos == 2 for r in rules):
            raise ConfigError("QoS 2 rules need protocol = \"mqtt\" (the native protocol "
                              "carries QoS 0 and 1)", where)
        if protocol == "blipmq":
            problem = native_problem(rules, str(options.get("client_id") or
                                                f"blipmq-bridge-{name}"))
            if problem:
                raise ConfigError(problem, where)
        if options.get("backoff_min_ms", 1000) > options.get("backoff_max_ms", 60000):  # type: ignore[operator]
            raise ConfigError("backoff_min_ms is larger than backoff_max_ms", where)
        if "inflight" not in options and any(r.sends and r.qos == 2 for r in rules):
            # mosquitto closes the link of a 3.1.1 client with more QoS 2 messages coming
            # in unreleased than its max_inflight_messages, 20 unless configured
            options["inflight"] = QOS2_INFLIGHT
        if (options.get("cert_file") or options.get("key_file")) and not (
                options.get("cert_file") and options.get("key_file")):
            raise ConfigError("cert_file and key_file go together (a client certificate)", where)
        state = str(options.get("state_topic", ""))
        if state and topic_problem(state, WIRE_TOPIC_BYTES):
            raise ConfigError(f"state_topic: {topic_problem(state, WIRE_TOPIC_BYTES)}", where)
        problem = credentials_problem(options, str(protocol))
        if problem:
            raise ConfigError(problem, where)
        specs.append(BridgeSpec(name, addresses, rules, **options))  # type: ignore[arg-type]
    return tuple(specs)

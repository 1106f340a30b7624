"""Checks of the arguments of the clients' calls, shared by ``Client`` and ``AsyncClient``.

A bad argument is one ``ConfigError`` that names it (``qos: must be 0 or 1, not '1'``),
raised before anything is queued or sent (docs/CLIENT.md, "Errors"). What the broker
decides (a topic's name, a size against WELCOME's limits) stays with the connection and
comes out as a ``BrokerError``. On the hot paths (``publish_many``) these run only once the
codec has refused a message, to say which argument was wrong.

Imports only ``blipmq_server.errors``.
"""

from __future__ import annotations

from blipmq_server.errors import ConfigError

U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF
_BYTES = (bytes, bytearray, memoryview)


def whole(name: str, value: object, high: int = U32) -> int:
    """``value`` if it is a whole number from 0 to ``high``."""
    if type(value) is not int or not 0 <= value <= high:
        raise ConfigError(f"must be a whole number from 0 to {high}, not {value!r}", name)
    return value


def qos(value: object) -> int:
    if type(value) is not int or value not in (0, 1):
        raise ConfigError(f"must be 0 or 1, not {value!r}", "qos")
    return value


def text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"must be a str, not {type(value).__name__}", name)
    return value


def data(name: str, value: object, optional: bool = False) -> None:
    """``value`` is bytes (or a bytearray or memoryview); None too if ``optional``."""
    if isinstance(value, _BYTES) or (optional and value is None):
        return
    hint = ": encode a str first, e.g. 'text'.encode()" if isinstance(value, str) else ""
    raise ConfigError(f"must be bytes, not {type(value).__name__}{hint}", name)


def seconds(name: str, value: object) -> float:
    """A positive number of seconds (a wait of 0 would fail every call at once)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value < 1e9):
        raise ConfigError(f"must be a positive number of seconds, not {value!r}", name)
    return float(value)


def count(name: str, value: object) -> int:
    """A whole number of at least 1."""
    if type(value) is not int or value < 1:
        raise ConfigError(f"must be a whole number of at least 1, not {value!r}", name)
    return value


def message(topic: object, payload: object, qos_: object = 0, ttl_ms: object = 0,
            key: object = None) -> None:
    """Every argument of one message to publish."""
    text("topic", topic)
    data("payload", payload)
    qos(qos_)
    whole("ttl_ms", ttl_ms)
    data("key", key, optional=True)


def given(m: object) -> None:
    """Whatever is wrong with an item given to ``publish_many`` (a ``Message`` or a
    (topic, payload) pair); returns quietly if its arguments are fine."""
    if not isinstance(m, tuple) or len(m) < 2:
        raise ConfigError(f"give a Message or a (topic, payload) pair, not {m!r:.60}",
                          "publish_many")
    message(*m[:5])


def subscription(topic_filter: object, group: object, qos_: object, credit: object,
                 start_offset: object) -> None:
    text("topic_filter", topic_filter)
    text("group", group)
    qos(qos_)
    whole("credit", credit)
    whole("start_offset", start_offset, U64)


def nack(delay_ms: object, reason: object) -> None:
    whole("delay_ms", delay_ms)
    text("reason", reason)

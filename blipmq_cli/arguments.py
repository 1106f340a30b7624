"""Checks of the arguments of the clients' calls, shared by ``Client`` and ``AsyncClient``.

A bad argument is one ``ConfigError`` that names it (``qos: must be 0 or 1, not '1'``),
raised before anything is queued or sent (docs/CLIENT.md, "Errors"). What the broker
decides (a topic's name, a size against WELCOME's limits) stays with the connection and
comes out as a ``BrokerError``. On the hot paths (``publish_many``) these run only once the
codec has refused a message, to say which argument was wrong.

Imports only ``blipmq_server.errors`` and ``blipmq_server.protocol`` (which the clients
import anyway; ``ssl`` only to check an ``ssl_context`` given).
"""

from __future__ import annotations

from blipmq_server.errors import ConfigError
from blipmq_server.protocol.codec import Delivery, Start
from blipmq_server.protocol.connection import Reconnect

U32 = 0xFFFFFFFF
U64 = 0xFFFFFFFFFFFFFFFF
_BYTES = (bytes, bytearray, memoryview)
_STARTS = frozenset(s.value for s in Start)


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


def wire_text(name: str, value: object) -> str:
    """A str the wire carries: valid UTF-8 (no lone surrogates), 65535 bytes at most."""
    text(name, value)
    try:
        size = len(value.encode("utf-8"))  # type: ignore[union-attr]
    except UnicodeEncodeError:
        raise ConfigError(f"must be valid UTF-8 (it holds a lone surrogate), not "
                          f"{value!r:.60}", name) from None
    if size > 0xFFFF:
        raise ConfigError(f"must be at most 65535 bytes in UTF-8, not {size}", name)
    return value  # type: ignore[return-value]


def wait(name: str, value: object) -> float | None:
    """A call's own timeout: None (the client's, or no deadline where the call says so) or
    a number of seconds from 0 (look, do not wait) up."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
        raise ConfigError(f"must be None or a number of seconds from 0 up, not {value!r}",
                          name)
    return float(value)


def connection(api_key: object, name: object, ssl_context: object) -> None:
    """The arguments of a client's connection besides its addresses and timeout."""
    wire_text("api_key", api_key)
    wire_text("name", name)
    if ssl_context is not None:
        import ssl

        if not isinstance(ssl_context, ssl.SSLContext):
            raise ConfigError(f"must be an ssl.SSLContext or None, not "
                              f"{type(ssl_context).__name__}", "ssl_context")


def deliveries(given: tuple[object, ...]) -> tuple[int, ...]:
    """The offsets of the deliveries given to ack or nack."""
    for d in given:
        if not isinstance(d, Delivery):
            raise ConfigError(f"give the Delivery objects a subscription handed out, not "
                              f"{d!r:.60}", "deliveries")
    return tuple(d.offset for d in given)  # type: ignore[attr-defined]


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
                 start_offset: object, start: object = Start.LATEST) -> None:
    names(topic_filter, group)
    if isinstance(start, bool) or not isinstance(start, int) or start not in _STARTS:
        raise ConfigError(f"must be a Start (Start.EARLIEST, say), not {start!r}", "start")
    qos(qos_)
    whole("credit", credit)
    whole("start_offset", start_offset, U64)


def names(topic_filter: object, group: object) -> None:
    """A topic filter and a group name (subscribe, unsubscribe)."""
    wire_text("topic_filter", topic_filter)
    wire_text("group", group)


def nack(delay_ms: object, reason: object) -> None:
    whole("delay_ms", delay_ms)
    text("reason", reason)


def reconnect(value: object) -> Reconnect | None:
    """The reconnect policy: True for ``Reconnect()``'s, False or None for none, or a
    ``Reconnect`` (``5`` or ``"yes"`` would fail only at the first lost connection)."""
    if value is True:
        return Reconnect()
    if value is False or value is None:
        return None
    if isinstance(value, Reconnect):
        return value
    raise ConfigError(f"must be True, False or a Reconnect policy (Reconnect(attempts=5)), "
                      f"not {value!r}", "reconnect")

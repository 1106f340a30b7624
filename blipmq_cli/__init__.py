"""BlipMQ's Python client library and command-line toolkit.

The library's public names, in one place (docs/CLIENT.md):

    from blipmq_cli import Client, AsyncClient, Message, Start, BrokerError

``Client`` is synchronous (plain sockets); ``AsyncClient`` runs under Trio. Both are thin
shells over the one sans-IO connection in ``blipmq_server.protocol.connection``. Names load
on first use, so ``blipmq pub`` (which imports this package) pays for none it does not use:
``AsyncClient`` alone brings in Trio.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blipmq_cli.aio import AsyncClient, AsyncSubscription
    from blipmq_cli.client import Client, Subscription
    from blipmq_server.errors import (
        BlipError,
        BrokerError,
        ConfigError,
        ConnectError,
        ProtocolError,
        TlsError,
    )
    from blipmq_server.protocol.codec import DeadLetter, Delivery, ErrorCode, Message, Start
    from blipmq_server.protocol.connection import Gap, Reconnect

__all__ = [
    "AsyncClient", "AsyncSubscription", "BlipError", "BrokerError", "Client", "ConfigError",
    "ConnectError", "DeadLetter", "Delivery", "ErrorCode", "Gap", "Message", "ProtocolError",
    "Reconnect", "Start", "Subscription", "TlsError",
]

_HOME = {
    "AsyncClient": "blipmq_cli.aio", "AsyncSubscription": "blipmq_cli.aio",
    "Gap": "blipmq_server.protocol.connection",
    "Reconnect": "blipmq_server.protocol.connection",
    "Client": "blipmq_cli.client", "Subscription": "blipmq_cli.client",
    "BlipError": "blipmq_server.errors", "BrokerError": "blipmq_server.errors",
    "ConfigError": "blipmq_server.errors", "ConnectError": "blipmq_server.errors",
    "ProtocolError": "blipmq_server.errors", "TlsError": "blipmq_server.errors",
    "DeadLetter": "blipmq_server.protocol.codec", "Delivery": "blipmq_server.protocol.codec",
    "ErrorCode": "blipmq_server.protocol.codec", "Message": "blipmq_server.protocol.codec",
    "Start": "blipmq_server.protocol.codec",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'blipmq_cli' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

"""Opening the broker's TCP listeners, so that a failure names which one could not bind.

Two listeners start side by side (clients and /metrics); "Address already in use" alone
would leave an operator guessing which of them clashed.
"""

from __future__ import annotations

import trio


async def open_listeners(host: str, port: int, what: str) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``; an OSError's text says ``what`` and ``host:port``."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(exc.errno, f"{exc.strerror or exc} on {where} (the {what})") from exc

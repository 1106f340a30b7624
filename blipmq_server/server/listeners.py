"""Opening the broker's TCP listeners, so that a failure names which one could not bind.

Two listeners start side by side (clients and /metrics); "Address already in use" alone
would leave an operator guessing which of them clashed.
"""

from __future__ import annotations

import trio

from blipmq_server.config import plain_host


def _ascii(host: str) -> str | bytes:
    """``host`` as bytes when the idna codec would make plain ASCII bytes of it
    (``config.plain_host``), else as it is. ``getaddrinfo`` encodes a str host with that
    codec, and its first use imports it (``encodings.idna``, ``stringprep``): 0.7 ms of
    every start, before the listeners open. Given bytes it does not; any other host still
    goes through the codec (the configuration refused those it refuses)."""
    return host.encode("ascii") if plain_host(host) else host


async def open_listeners(host: str, port: int, what: str) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``; an OSError's text says ``what`` and ``host:port``."""
    try:
        return await trio.open_tcp_listeners(port, host=_ascii(host))
    except OSError as exc:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise OSError(exc.errno, f"{exc.strerror or exc} on {where} (the {what})") from exc

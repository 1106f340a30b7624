"""Readiness notes for systemd (``Type=notify``): ``READY=1`` once the broker listens,
``RELOADING=1``/``READY=1`` around a reload, ``STOPPING=1`` when shutdown begins.

The sd_notify protocol is one datagram to the AF_UNIX socket named by ``$NOTIFY_SOCKET``
(a path, or ``@name`` in the abstract namespace), holding ``KEY=VALUE`` lines; no
dependency is needed for it. Without ``$NOTIFY_SOCKET`` (not started by systemd, or not as
``Type=notify``) nothing is sent. In the onefile executable the notes come from the
broker, the bootloader's child, not from the unit's main process: the unit says
``NotifyAccess=all`` (packaging/blipmq.service). A note that cannot be sent is dropped:
the broker serves whether systemd heard it or not.

Until READY=1, ``Starting`` asks for more time every 10 s (EXTEND_TIMEOUT_USEC): recovering
a large log on an SD card can take longer than systemd's TimeoutStartSec (90 s by default),
which would kill the start and restart it, again and again. Standard library only; no trio.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping


def address(environ: Mapping[str, str] | None = None) -> str | None:
    """Where notes go: ``$NOTIFY_SOCKET`` as a socket address (``@`` becomes the abstract
    namespace's NUL), or None when there is none this can send to."""
    value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # unset, or a kind this does not speak (vsock:)


def send(*lines: str, environ: Mapping[str, str] | None = None) -> bool:
    """One note of ``lines`` (``"READY=1"``, ``"STATUS=..."``); whether it was sent."""
    where = address(environ)
    if where is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, where)
    except OSError:
        return False
    return True


def ready(status: str = "") -> bool:
    return send("READY=1", *([f"STATUS={status}"] if status else []))


def reloading() -> bool:
    # MONOTONIC_USEC: systemd 253 and later match the note to the reload it asked for
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return send("RELOADING=1", f"MONOTONIC_USEC={usec}")


def stopping() -> bool:
    return send("STOPPING=1")


class Starting:
    """While the broker starts, asks systemd for ``by_s`` more every ``every_s`` (a thread:
    log recovery holds the event loop); ``end`` once READY=1 is sent."""

    def __init__(self, every_s: float = 10.0, by_s: float = 30.0) -> None:
        self._done = threading.Event()
        if address() is not None:
            threading.Thread(target=self._extend, args=(every_s, by_s), daemon=True,
                             name="blipmq-notify").start()

    def _extend(self, every_s: float, by_s: float) -> None:
        while not self._done.wait(every_s):
            send(f"EXTEND_TIMEOUT_USEC={int(by_s * 1_000_000)}", "STATUS=starting")

    def end(self) -> None:
        self._done.set()

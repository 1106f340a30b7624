"""Signals that reach ``blipmq start`` before the broker can act on them.

Until the broker's own handling runs (server/app.py ``run``), SIGHUP, SIGINT and SIGTERM
would take their default action: death, with no line logged, and a supervisor that takes
death by SIGHUP for a clean exit does not restart the service (docs/OPERATIONS.md,
"Signals during start-up"). ``hold`` records them instead, as the first thing ``main`` does
for ``start``; what was held is then applied:

- SIGHUP asks to read the configuration again. One that came before the start read the
  file is answered by that reading (``forget_reloads``, just before it); one that came
  after is a reload once the broker listens. So a SIGHUP is never dropped, and never
  applied before the configuration it could have missed was read;
- SIGINT or SIGTERM before the broker took its data directory: it logs a line and exits 0
  (``stop_held``); after that, the broker starts and shuts down as on any SIGTERM.

Must not import anything but the standard library: ``main`` calls ``hold`` before the
broker's modules are imported.
"""

from __future__ import annotations

import signal
from types import FrameType

HELD = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
_held: list[int] = []  # in the order they came, each once


def _hold(signum: int, frame: FrameType | None) -> None:
    if signum not in _held:
        _held.append(signum)


def hold() -> None:
    """Record SIGHUP, SIGINT and SIGTERM from now on instead of dying of them."""
    for signum in HELD:
        signal.signal(signum, _hold)


def ignore() -> None:
    """The command is over: from now on these signals are ignored. Python's exit puts the
    default action back in place of a handler of its own, and in the onefile executable
    the bootloader's forwarded copy of a signal to the group can come that late: it would
    turn the exit code (0, 1, 2) into death by the signal."""
    for signum in HELD:
        signal.signal(signum, signal.SIG_IGN)


def forget_reloads() -> None:
    """The configuration is about to be read: a SIGHUP held so far is answered by that."""
    if signal.SIGHUP in _held:
        _held.remove(signal.SIGHUP)


def stop_held() -> int:
    """The SIGINT or SIGTERM held so far (taken), or 0."""
    for signum in list(_held):
        if signum != signal.SIGHUP:
            _held.remove(signum)
            return signum
    return 0


def take() -> list[int]:
    """Every signal held so far, in the order they came; none is held any more."""
    taken = []
    while _held:  # one at a time: a signal handled meanwhile is appended, not lost
        taken.append(_held.pop(0))
    return taken

"""The open-file limit (RLIMIT_NOFILE) against what the broker may open.

Every client connection is a descriptor, and so is everything else the broker opens: log
segments (the one written, those read for consumers), the lock, listeners, metrics
connections, bridge links, a connection being refused. systemd's default soft limit is 1024,
the default ``server.max_connections`` too: 1015 idle clients then left no descriptor for the
next log segment, and the write failed ("Too many open files; 200 record(s) not stored").

At start (``daemon.start``, before anything is opened) the broker raises its soft limit to
the hard limit (at most ``CEILING``), and when ``server.max_connections`` plus what it needs
besides (``reserve``) is still more than that, it serves fewer connections: the effective
limit is lowered to fit and one warning says so. A connection past it gets
TOO_MANY_CONNECTIONS, as at any ``max_connections``, and the log always has its
descriptors. ``plan`` decides (pure); ``apply`` reads and sets the limit.
"""

from __future__ import annotations

import resource
from typing import NamedTuple

from blipmq_server.config import Config

CEILING = 1 << 20  # Linux's default fs.nr_open: a larger soft limit buys nothing
# Besides client connections: standard streams, the data directory's two locks, the event
# loop's own (epoll, wake-up pipes), files opened for a moment (a reload's config file,
# certificates, a frozen executable's lazy imports, the log's directory for fsync)
_BASE = 32
_LOG = 16  # the segment written, the one sealed, wal.disk.READ_FDS read ones, the reserve
_LISTENER = 2  # per listener: a host name can bind IPv4 and IPv6
_METRICS = 16 + 16 + 16 + 1  # served, lingering, refused tokens held; one closed at once
_BRIDGE = 4  # its link(s) and a name lookup
_REFUSING = 32  # connections past max_connections held for up to 1 s while refused


class Budget(NamedTuple):
    """What ``plan`` decided: the soft limit to set, the connections to serve, and the
    warning to log ("" when none)."""

    soft: int
    max_connections: int
    warning: str


def reserve(config: Config) -> int:
    """Descriptors the broker may need besides its client connections."""
    listeners = 1 + config.server.tls + (config.mqtt.enabled * (1 + config.mqtt.tls))
    need = _BASE + _REFUSING + _LISTENER * listeners + _BRIDGE * len(config.bridges)
    if config.wal.enabled:
        need += _LOG
    if config.metrics.enabled:
        need += _LISTENER + _METRICS
    return need


def plan(soft: int, hard: int, max_connections: int, besides: int) -> Budget:
    """The soft limit raised to ``hard`` (``-1``: unlimited; at most ``CEILING``, never
    lowered), and ``max_connections`` lowered when it and ``besides`` do not fit."""
    top = CEILING if hard < 0 else min(hard, CEILING)
    new = max(soft, top) if soft >= 0 else soft
    limit = CEILING if new < 0 else new
    if max_connections + besides <= limit:
        return Budget(new, max_connections, "")
    serve = max(1, limit - besides)
    return Budget(new, serve, (
        f"server.max_connections = {max_connections} lowered to {serve}: the open-file limit "
        f"is {limit} (RLIMIT_NOFILE, hard limit {'unlimited' if hard < 0 else hard}) and the "
        f"broker keeps {besides} for its log, listeners, metrics and bridges; raise the hard "
        "limit (LimitNOFILE= in the unit, ulimit -Hn) to serve more"))


def apply(config: Config) -> Budget:
    """Raise this process's soft limit as ``plan`` says; the budget (the soft limit is
    left as it was when the system refuses, and the budget says what it is)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = plan(soft, hard, config.server.max_connections, reserve(config))
    if budget.soft != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (budget.soft, hard))
        except (OSError, ValueError):
            budget = plan(soft, soft, config.server.max_connections, reserve(config))
    return budget

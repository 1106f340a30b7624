"""Exit codes of the ``blipmq`` client commands, and the mapping from errors to them.

The table is repeated in README.md ("Exit codes"); tests hold the two together.
"""

from __future__ import annotations

from enum import IntEnum

from blipmq_server.errors import BrokerError, ConfigError, ConnectError, TlsError
from blipmq_server.protocol.codec import ErrorCode


class Terminated(BaseException):
    """SIGTERM while a command has something to finish or to say (``sub --exec`` ends its
    commands, ``pub -l -q 1`` says how far it got): then it dies of the signal."""


def terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: raises ``Terminated``."""
    raise Terminated


def die_of_sigterm() -> None:
    """End this process by SIGTERM, as if no handler had caught it (exit status 143)."""
    import os
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


class Exit(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug: please report it
    USAGE = 2  # bad arguments, bad config, unreadable input file
    UNREACHABLE = 3  # broker unreachable or silent, or the connection was lost
    TIMEOUT = 4  # sub --timeout ran out before --count messages (or any) arrived; bench hung
    AUTH = 5  # API key refused, or the key may not do this (a permission)
    TOO_LARGE = 6  # message larger than the broker's max_message_bytes
    BAD_NAME = 7  # invalid topic, filter or group name
    NOT_FOUND = 8  # unsub of a group that does not exist
    REFUSED = 9  # any other refusal by the broker (queue full, connection limit, ...)
    MISSING = 10  # blipmq export: the spark extra or Java is not installed
    JOB_FAILED = 11  # blipmq export: the Spark job failed (its first error line is printed)
    TLS = 12  # the TLS handshake failed (a certificate refused either way, not a TLS port)
    INTERRUPTED = 130  # Ctrl-C


_BY_CODE = {
    ErrorCode.AUTH_FAILED: Exit.AUTH,
    ErrorCode.NOT_AUTHENTICATED: Exit.AUTH,
    ErrorCode.FORBIDDEN: Exit.AUTH,
    ErrorCode.MESSAGE_TOO_LARGE: Exit.TOO_LARGE,
    ErrorCode.FRAME_TOO_LARGE: Exit.TOO_LARGE,
    ErrorCode.INVALID_TOPIC: Exit.BAD_NAME,
    ErrorCode.INVALID_REQUEST: Exit.BAD_NAME,
    ErrorCode.NOT_FOUND: Exit.NOT_FOUND,
    # the handshake ran out of time, or GOODBYE TIMEOUT after an unanswered keepalive PING
    ErrorCode.TIMEOUT: Exit.UNREACHABLE,
}


def for_error(exc: BaseException) -> Exit:
    if isinstance(exc, BrokerError):
        return _BY_CODE.get(exc.code, Exit.REFUSED)  # type: ignore[call-overload]
    if isinstance(exc, TlsError):
        return Exit.TLS
    if isinstance(exc, ConnectError):
        return Exit.UNREACHABLE
    if isinstance(exc, ConfigError):
        return Exit.USAGE
    if isinstance(exc, TimeoutError):
        return Exit.UNREACHABLE
    return Exit.INTERNAL

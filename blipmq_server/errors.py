"""The one exception tree of BlipMQ.

Exceptions are for bugs and for input we refuse; normal conditions (a full queue, a
closed connection, a torn log tail) are values. Imports nothing from the project.
"""

from __future__ import annotations


class BlipError(Exception):
    """Root of every error BlipMQ raises on purpose."""


class ProtocolError(BlipError):
    """A frame that breaks docs/PROTOCOL.md. ``code`` is the wire error code to answer with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the protocol cannot carry (our bug or our caller's)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame."""


class WalError(BlipError):
    """The write-ahead log cannot do what was asked (disk fault, unreadable segment)."""


class ConfigError(BlipError):
    """A configuration file, environment variable or flag we refuse.

    ``key`` is the dotted key (``server.port``) the problem is about, when there is one.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


class ConnectError(BlipError):
    """The broker could not be reached, or the connection to it broke."""


class TlsError(ConnectError):
    """The TLS handshake with the broker failed: one side refused the other's certificate,
    no TLS version in common, or the other side does not speak TLS on that port."""


class NotBrokerError(ConnectError):
    """What answered is not a BlipMQ broker: the first bytes it sent back are not the
    protocol's (an HTTP server, a TLS server answering plain TCP with an alert). Dialling
    again will not change that."""


class BrokerError(BlipError):
    """The broker answered with an ERROR (or a closing GOODBYE) frame.

    ``code`` is the wire error code (``protocol.codec.ErrorCode``).
    """

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code
        self.text = text

"""TLS for the client: the context from the options, the handshake, and a socket wrapper.

Imported only when a connection uses TLS (``tls://``, ``--tls``, a CA file, a client
certificate or ``--insecure``): a plain ``blipmq pub`` never loads ssl. The broker's
certificate is verified against the system's CAs, or ``--cafile``'s, and must name the host
connected to; ``--insecure`` turns both checks off (the link is still encrypted, but anyone
in the middle can read it).

Every failure is a ``TlsError`` (exit code 12) or, for an option's file, a ``ConfigError``
(exit code 2), with one line a person can act on.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from typing import Any

from blipmq_server.errors import ConfigError, ConnectError, TlsError


def context(cafile: str | None = None, cert: str | None = None, key: str | None = None,
            insecure: bool = False) -> ssl.SSLContext:
    """A client context: TLS 1.2 at least, the broker's certificate verified unless
    ``insecure``, ``cert`` (with ``key``, or a key inside it) presented when asked."""
    try:
        ctx = ssl.create_default_context(cafile=cafile or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(_file_problem(cafile, exc, "CA certificates"), "--cafile") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if key and not cert:
        raise ConfigError("a key without a certificate: give --cert too", "--cert-key")
    if cert:
        try:
            ctx.load_cert_chain(cert, key or None, password=lambda: b"")
        except (OSError, ssl.SSLError) as exc:
            which, path = ("--cert-key", key) if key and _cert_loads(cert) else ("--cert", cert)
            raise ConfigError(_file_problem(path, exc, "a PEM certificate and unencrypted key"),
                              which) from None
    return ctx


def _cert_loads(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"-----BEGIN CERTIFICATE-----" in f.read()
    except OSError:
        return False


def _file_problem(path: str | None, exc: BaseException, wanted: str) -> str:
    if isinstance(exc, ssl.SSLError):
        if exc.reason == "KEY_VALUES_MISMATCH":
            return f"{path} is not the key of the certificate given with --cert"
        return f"cannot load {path}: {_text(exc)} ({wanted} needed)"
    assert isinstance(exc, OSError)
    return f"cannot read {path}: {exc.strerror or exc}"


def connect(sock: socket.socket, ctx: ssl.SSLContext, host: str, addr: str,
            deadline: float) -> TlsSocket:
    """The TLS handshake on a connected socket, by ``deadline`` (time.monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ConnectError(f"cannot connect to {addr}: the TLS handshake timed out")
    sock.settimeout(left)
    try:
        wrapped = ctx.wrap_socket(sock, server_hostname=host)
    except TimeoutError:
        raise ConnectError(f"cannot connect to {addr}: the TLS handshake did not finish "
                           "in time (is it a TLS port?)") from None
    except ssl.SSLError as exc:
        raise problem(exc, addr) from None
    except OSError as exc:
        raise TlsError(f"{addr} closed the connection during the TLS handshake "
                       f"({exc.strerror or exc}): is it the broker's TLS port?") from None
    return TlsSocket(wrapped, addr)


# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_EMAIL_MISMATCH,
# X509_V_ERR_IP_ADDRESS_MISMATCH: a trusted certificate made for other names
_NAME_MISMATCH = (62, 63, 64)


def problem(exc: ssl.SSLError, addr: str) -> TlsError:
    """What a failed TLS step means, for a person."""
    code = exc.reason or ""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code in _NAME_MISMATCH:
        # the CA vouched for it (the chain is checked first): it names other hosts
        return TlsError(f"the certificate of {addr} does not name the host connected to: "
                        f"{exc.verify_message} (connect with a host name or address the "
                        "certificate names, as its subjectAltName lists them, or --insecure "
                        "to skip the check)")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return TlsError(f"the certificate of {addr} is not trusted: {exc.verify_message} "
                        "(give the CA that signed it with --cafile, or --insecure to skip "
                        "the check)")
    if code in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                "UNKNOWN_PROTOCOL", "UNEXPECTED_EOF_WHILE_READING") or isinstance(
                    exc, ssl.SSLEOFError):
        return TlsError(f"{addr} does not speak TLS: is it the broker's TLS port "
                        "(server.tls_port), not its plain one?")
    if code in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "PEER_DID_NOT_RETURN_A_CERTIFICATE"):
        return TlsError(f"the broker at {addr} requires a client certificate "
                        "(--cert, --cert-key)")
    if code in ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE",
                "SSLV3_ALERT_CERTIFICATE_EXPIRED", "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
                "SSLV3_ALERT_CERTIFICATE_REVOKED", "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE"):
        return TlsError(f"the broker at {addr} refused this client's certificate "
                        f"({code.split('ALERT_', 1)[1].lower().replace('_', ' ')})")
    if code in ("TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL",
                "NO_PROTOCOLS_AVAILABLE"):
        return TlsError(f"no TLS version in common with {addr}")
    return TlsError(f"TLS with {addr} failed: {_text(exc)}")


def closed_after_handshake(addr: str) -> TlsError:
    """A broker that closed the connection once the TLS handshake was done, before our
    HELLO was answered: TLS 1.3 lets the client finish its side before the broker has
    looked at its certificate, so a refused or missing one shows up only then."""
    return TlsError(f"the broker at {addr} closed the connection after the TLS handshake: "
                    "it may want a client certificate (--cert, --cert-key) or refuse this "
                    "one")


def _text(exc: ssl.SSLError) -> str:
    """OpenSSL's reason in words, or its message without "[SSL]" and "(_ssl.c:123)"."""
    if exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    return re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(exc.strerror or exc))


class TlsSocket:
    """An ``ssl.SSLSocket`` that behaves as the client's plain non-blocking socket does: a
    read or write that cannot go on now raises BlockingIOError (not SSLWantReadError or
    SSLWantWriteError), any other TLS failure a TlsError saying what it means, and a read
    also takes what TLS already decrypted (``pending``: the socket may show nothing while
    a record's rest waits in the TLS buffer, so waits ask ``pending`` first)."""

    def __init__(self, sock: ssl.SSLSocket, addr: str) -> None:
        self.sock = sock
        self.addr = addr
        self.pending = sock.pending

    def recv(self, size: int) -> bytes:
        sock = self.sock
        try:
            data = sock.recv(size)
            while data and len(data) < size and sock.pending():  # the rest of the record
                data += sock.recv(size - len(data))
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLError as exc:
            raise problem(exc, self.addr) from None
        return data

    def send(self, data: bytes | memoryview) -> int:
        try:
            return self.sock.send(data)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError from None
        except ssl.SSLError as exc:
            raise problem(exc, self.addr) from None

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def __getattr__(self, name: str) -> Any:  # setblocking, setsockopt, getpeercert, ...
        return getattr(self.sock, name)

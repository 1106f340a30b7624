"""TLS for the broker's listeners: the server context built from ``[tls]``, the handshake
of an accepted connection, the client certificate's identity, and reloading the files; and
the client context of a bridge to an upstream over TLS (``client_context``).

Imported only when a listener serves TLS (``config.tls_listeners``) or a bridge links over
TLS: a broker without TLS never loads ssl, nor OpenSSL's libraries
(blipmq_server/deferred.py). One context serves every TLS listener; ``reload`` swaps it for
one built from the files as they are now, which new connections use while the open ones
keep theirs.

A handshake runs before the connection becomes a session and is bounded by
``server.handshake_timeout_ms``; a failure costs only that connection and is counted by
reason (``ConnectionCounters.tls_errors``, ``blipmq_tls_handshake_failures_total``):

    timeout           nothing, or not enough, arrived in time
    not_tls           the first bytes are not a TLS record (plain text on a TLS port)
    protocol_version  no TLS version in common (an old client; tls.min_version)
    no_client_cert    tls.require_client_cert and the client sent no certificate
    bad_client_cert   a client certificate tls.ca_file does not vouch for, or expired
    no_identity       a required client certificate without tls.client_identity's field
    peer_refused      the client refused the broker's certificate (an alert)
    closed            the client closed or reset the connection during the handshake
    other             anything else (the log line says what)
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import ssl
from typing import TYPE_CHECKING

import trio

from blipmq_server.config import TlsOptions
from blipmq_server.errors import ConfigError
from blipmq_server.server.hush import EVERY_S, Hush
from blipmq_server.server.session import peer_of

if TYPE_CHECKING:
    from blipmq_server.bridge.spec import BridgeSpec

log = logging.getLogger("blipmq.tls")

# OpenSSL's reason codes (SSLError.reason) and what they mean for the counter
_REASONS = {
    "WRONG_VERSION_NUMBER": "not_tls",
    "HTTP_REQUEST": "not_tls",
    "HTTPS_PROXY_REQUEST": "not_tls",
    "UNKNOWN_PROTOCOL": "not_tls",
    "PACKET_LENGTH_TOO_LONG": "not_tls",
    "RECORD_LAYER_FAILURE": "not_tls",
    "UNSUPPORTED_PROTOCOL": "protocol_version",
    "VERSION_TOO_LOW": "protocol_version",
    "NO_PROTOCOLS_AVAILABLE": "protocol_version",
    "TLSV1_ALERT_PROTOCOL_VERSION": "protocol_version",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no_client_cert",
    "CERTIFICATE_VERIFY_FAILED": "bad_client_cert",
    "UNEXPECTED_EOF_WHILE_READING": "closed",
}
_SAN = {"san_dns": "DNS", "san_email": "email", "san_uri": "URI"}
_FILES = ("cert_file", "key_file", "ca_file")
_ALERT_WAIT_S = 1  # for the alert that says why a handshake failed


def _no_password() -> bytes:
    """An encrypted key fails to load instead of OpenSSL asking on the terminal."""
    return b""


def context(options: TlsOptions) -> ssl.SSLContext:
    """The server context: TLS 1.2 at least (1.3 when the client has it, which OpenSSL
    prefers by itself), Python's default ciphers, client certificates as configured.
    Raises ConfigError naming the key of the file it could not use."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = (ssl.TLSVersion.TLSv1_3 if options.min_version == "1.3"
                           else ssl.TLSVersion.TLSv1_2)
    for name in _FILES:
        _readable(options, name)
    _load_pair(ctx, options.cert_file, options.key_file, "tls.")
    if options.ca_file:
        try:
            ctx.load_verify_locations(cafile=options.ca_file)
        except ssl.SSLError as exc:
            raise ConfigError(f"cannot load {options.ca_file}: {_text(exc)} (PEM CA "
                              "certificates are needed)", "tls.ca_file") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if options.require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(spec: BridgeSpec, where: str) -> ssl.SSLContext:
    """A bridge's TLS to its upstream: the upstream's certificate verified (``ca_file``, or
    the system's CAs) and its name checked unless ``insecure``, a client certificate when
    given (mutual TLS), ALPN when asked. Raises ConfigError naming ``where``'s option
    (``bridge[0] (cloud).ca_file``) and the file it could not use."""
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(spec, name)
        if path:
            _read(path, f"{where}.{name}")
    try:
        ctx = ssl.create_default_context(cafile=spec.ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load {spec.ca_file}: {_why(exc)} (PEM CA certificates are "
                          "needed)", f"{where}.ca_file") from None
    if spec.cert_file:
        _load_pair(ctx, spec.cert_file, spec.key_file, f"{where}.", "")
    if spec.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if spec.alpn:
        ctx.set_alpn_protocols(list(spec.alpn))
    return ctx


def _load_pair(ctx: ssl.SSLContext, cert_file: str, key_file: str, prefix: str,
               said: str = "tls.") -> None:
    """``cert_file`` (with ``key_file``, or a key inside it) into ``ctx``; a ConfigError
    names ``prefix + "cert_file"`` or ``"key_file"``, whichever could not be used
    (``said``: how the text names the certificate's option)."""
    try:
        ctx.load_cert_chain(cert_file, key_file or None, password=_no_password)
    except (OSError, ssl.SSLError) as exc:
        if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(f"{key_file} is not the key of {said}cert_file's "
                              "certificate", f"{prefix}key_file") from None
        name = "key_file" if key_file and _holds_cert(cert_file) else "cert_file"
        path = key_file if name == "key_file" else cert_file
        raise ConfigError(f"cannot load {path}: {_why(exc)} (a PEM certificate and an "
                          "unencrypted PEM key are needed)", prefix + name) from None


def _why(exc: OSError) -> str:
    return _text(exc) if isinstance(exc, ssl.SSLError) else str(exc.strerror or exc)


def _readable(options: TlsOptions, name: str) -> bytes:
    path = getattr(options, name)
    return _read(path, f"tls.{name}") if path else b""


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", key) from None


def _holds_cert(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"-----BEGIN CERTIFICATE-----" in f.read()
    except OSError:
        return False


def _text(exc: ssl.SSLError) -> str:
    """OpenSSL's reason in words ("CERTIFICATE_VERIFY_FAILED" -> "certificate verify
    failed"), or its message without the "[SSL]" and "(_ssl.c:123)" around it."""
    if exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    return re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(exc.strerror or exc))


def identity(cert: dict | None, field: str) -> str | None:
    """The client certificate's name by ``tls.client_identity``: the subject's common name,
    or the first subject alternative name of that kind; None without one."""
    if not cert:
        return None
    if field == "cn":
        for rdn in cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return None
    kind = _SAN[field]
    for key, value in cert.get("subjectAltName", ()):
        if key == kind:
            return str(value)
    return None


def failure(exc: BaseException | None) -> tuple[str, str]:
    """Why a handshake failed, as (reason for the counter, text for the log)."""
    if isinstance(exc, ssl.SSLError):
        code = exc.reason or ""
        text = getattr(exc, "verify_message", None) or _text(exc)
        if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError):
            return "closed", text
        if code in _REASONS:
            return _REASONS[code], text
        if code.startswith(("SSLV3_ALERT_", "TLSV1_ALERT_", "TLSV13_ALERT_")):
            return "peer_refused", text
        return "other", text
    if isinstance(exc, OSError) or exc is None:
        return "closed", (exc.strerror or str(exc)) if exc is not None else "end of stream"
    return "other", f"{type(exc).__name__}: {exc}"


class Tls:
    """The broker's TLS: the context new connections get, and their handshakes."""

    def __init__(self, options: TlsOptions, errors: dict[str, int]) -> None:
        self.options = options
        self.errors = errors  # ConnectionCounters.tls_errors
        self._hush = Hush()
        self.context = context(options)
        self._digests = self._read_digests(options)

    def _read_digests(self, options: TlsOptions) -> dict[str, str]:
        return {name: hashlib.sha256(_readable(options, name)).hexdigest()
                for name in _FILES if getattr(options, name)}

    def reload(self, options: TlsOptions | None = None) -> str:
        """Build a new context from the files as they are now (``options``: new settings)
        and use it for new connections; one line saying what changed. A file that cannot
        be used raises ConfigError, and the context and settings in use stay."""
        options = options or self.options
        fresh = context(options)
        digests = self._read_digests(options)
        changed = [f"tls.{name}" for name in _FILES if digests.get(name) != self._digests.get(name)]
        if options != self.options:
            changed.append("settings")
        self.options, self.context, self._digests = options, fresh, digests
        if not changed:
            return "tls: certificate files unchanged"
        return f"tls: reloaded {', '.join(changed)}; new connections use them"

    async def accept(self, stream: trio.SocketStream, timeout: float
                     ) -> tuple[trio.SSLStream[trio.SocketStream], str | None] | None:
        """The TLS handshake of an accepted connection, within ``timeout`` seconds (0: no
        limit): the stream and the client certificate's identity, or None once the
        failure is counted and logged (the caller closes ``stream``).

        ``https_compatible``: a peer that closes without TLS's close_notify has ended the
        stream, not been cut off: both protocols frame their messages, so a truncated
        one is incomplete and never taken."""
        peer = peer_of(stream)  # now: a client that gave up is no longer connected
        tls = trio.SSLStream(stream, self.context, server_side=True, https_compatible=True)
        reason = text = ""
        with trio.move_on_after(timeout or math.inf) as waited:
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                reason, text = failure(exc.__cause__)
        if waited.cancelled_caught:
            reason, text = "timeout", f"not completed within {timeout:g} s"
        if not reason:
            try:
                cert = tls.getpeercert()
            except ValueError:  # pragma: no cover - the handshake is done
                cert = None
            name = identity(cert, self.options.client_identity)
            if name is not None or not self.options.require_client_cert:
                return tls, name
            reason = "no_identity"
            text = f"the client certificate has no {self.options.client_identity}"
        self.errors[reason] = self.errors.get(reason, 0) + 1
        said = self._hush.due(peer, reason)  # a flood: one line a minute
        if said is not None:
            log.info("TLS handshake from %s failed: %s (%s)%s; further such failures from "
                     "there are counted, not logged, for %d s "
                     "(blipmq_tls_handshake_failures_total)", peer, reason, text,
                     f", and {said[1]} more since the last line" if said[1] else "", EVERY_S)
        alert = _alert(tls)
        if alert:  # so the client can say why ("certificate required", "protocol version")
            with trio.move_on_after(_ALERT_WAIT_S):
                try:
                    await stream.send_all(alert)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        return None


def _alert(tls: trio.SSLStream[trio.SocketStream]) -> bytes:
    """The TLS alert OpenSSL wrote when the handshake failed, which trio's SSLStream does not
    send (it marks itself broken first). Read from its outgoing buffer, a private
    attribute: without it (another trio), the client sees the connection close instead."""
    outgoing = getattr(tls, "_outgoing", None)
    return outgoing.read() if isinstance(outgoing, ssl.MemoryBIO) else b""

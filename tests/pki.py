"""Certificates for the TLS tests, made on the fly with trustme (never checked in).

``make_pki(directory)`` writes a CA, the broker's certificate (127.0.0.1 and localhost) with
its key, a client certificate (common name ``device-7``, email ``device-7@example.org``), an
expired client certificate, and a second CA that signed none of them.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Pki:
    ca: Path  # signed everything below
    cert: Path  # the broker's certificate
    key: Path
    client_cert: Path
    client_key: Path
    expired_cert: Path
    expired_key: Path
    other_ca: Path  # trusts none of the above
    authority: trustme.CA

    def client_context(self, cafile: Path | None = None, cert: bool = False) -> ssl.SSLContext:
        """A client context trusting ``cafile`` (the CA by default), with the client
        certificate when ``cert``."""
        ctx = ssl.create_default_context(cafile=str(cafile or self.ca))
        if cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx

    def reissue(self, directory: Path, authority: trustme.CA | None = None) -> tuple[Path, Path]:
        """A new broker certificate and key (from ``authority``, or this CA) written over
        the files in ``directory``: (cert, key)."""
        issued = (authority or self.authority).issue_cert("127.0.0.1", "localhost")
        cert, key = directory / "broker.pem", directory / "broker.key"
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        return cert, key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    broker = ca.issue_cert("127.0.0.1", "localhost")
    broker.cert_chain_pems[0].write_to_path(str(directory / "broker.pem"))
    broker.private_key_pem.write_to_path(str(directory / "broker.key"))
    client = ca.issue_cert("device-7@example.org", common_name="device-7")
    client.cert_chain_pems[0].write_to_path(str(directory / "client.pem"))
    client.private_key_pem.write_to_path(str(directory / "client.key"))
    expired = ca.issue_cert("old-device@example.org", common_name="old-device",
                            not_before=datetime.datetime(2020, 1, 1),
                            not_after=datetime.datetime(2021, 1, 1))
    expired.cert_chain_pems[0].write_to_path(str(directory / "expired.pem"))
    expired.private_key_pem.write_to_path(str(directory / "expired.key"))
    other = trustme.CA()
    other.cert_pem.write_to_path(str(directory / "other-ca.pem"))
    return Pki(directory / "ca.pem", directory / "broker.pem", directory / "broker.key",
               directory / "client.pem", directory / "client.key", directory / "expired.pem",
               directory / "expired.key", directory / "other-ca.pem", ca)


def broker_tls(pki: Pki, **sections: dict) -> dict:
    """A broker config (for ``start_broker``) with every listener on a free port, the
    native and MQTT ones plain and over TLS; ``sections`` add to or replace its keys."""
    config: dict = {
        "server": {"tls": True, "tls_port": 0},
        "mqtt": {"enabled": True, "port": 0, "tls": True, "tls_port": 0},
        "tls": {"cert_file": str(pki.cert), "key_file": str(pki.key)},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config

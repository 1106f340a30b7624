"""TLS on the broker's listeners: the real broker process with trustme certificates, driven
by openssl s_client, the mosquitto clients and raw sockets; then the server in-process for
what only it can show (the client certificate's identity on the session, reloading the
certificates without dropping connections).

The client side (``blipmq`` over TLS, the Python client) is in tests/test_tls_cli.py.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomlkit
import trio
from mqttpeer import mosquitto, mosquitto_spawn, reap
from pki import Pki, broker_tls, make_pki

from blipmq_cli.client import Client
from blipmq_server import config as config_module
from blipmq_server.errors import BrokerError, ConfigError, TlsError
from blipmq_server.protocol import codec
from blipmq_server.server import admission
from blipmq_server.server.app import Bound, Server
from tests.test_e2e_metrics import _read_once_closed


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(autouse=True)
def _reap_mosquitto() -> Iterator[None]:
    yield
    reap()


def _wait_closed(sock: socket.socket, within: float) -> float:
    """Seconds until the broker closed ``sock`` (read b"" or a reset), failing after
    ``within``."""
    sock.settimeout(within)
    started = time.monotonic()
    try:
        while sock.recv(4096):  # a TLS alert may come first
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {within} s") from None
    return time.monotonic() - started


# ------------------------------------------------------------------- listeners and startup


def test_plain_and_tls_listeners_side_by_side(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki))
    line = b.wait_log("listening on")
    # the beginning is what it always was; the TLS listeners come after the rest
    assert re.search(r"listening on 127\.0\.0\.1:\d+, metrics on http://127\.0\.0\.1:\d+/metrics"
                     r", mqtt on 127\.0\.0\.1:\d+, mqtts on 127\.0\.0\.1:\d+, tls on "
                     r"127\.0\.0\.1:\d+; ", line), line
    assert len({b.port, b.mqtt_port, b.mqtts_port, b.tls_port, b.metrics_port}) == 5
    # MQTT plain and over TLS into one broker, out to a native subscriber
    sub = b.spawn("sub", "side/by/side", "--count", "2")
    b.wait_subscribers(1)
    assert mosquitto("mosquitto_pub", b.mqtt_port, "-t", "side/by/side", "-m", "plain",
                     "-q", "1").returncode == 0
    done = mosquitto("mosquitto_pub", b.mqtts_port, "--cafile", str(pki.ca), "-t",
                     "side/by/side", "-m", "tls", "-q", "1")
    assert done.returncode == 0, done.stderr
    out, err = sub.communicate(timeout=30)
    assert (sub.returncode, out) == (0, b"plain\ntls\n"), err


def test_openssl_negotiates_tls13_and_tls11_is_refused(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki))
    s_client = ["openssl", "s_client", "-connect", f"127.0.0.1:{b.mqtts_port}",
                "-CAfile", str(pki.ca), "-verify_return_error"]
    done = subprocess.run([*s_client, "-brief"], input=b"", capture_output=True, timeout=30)
    text = done.stdout.decode() + done.stderr.decode()
    assert "Protocol version: TLSv1.3" in text, text
    assert "Verification: OK" in text, text
    # TLS 1.2 is still accepted (tls.min_version = "1.2")
    done = subprocess.run([*s_client, "-brief", "-tls1_2"], input=b"", capture_output=True,
                          timeout=30)
    assert "Protocol version: TLSv1.2" in done.stdout.decode() + done.stderr.decode()
    # a TLS 1.1 client (seclevel 0 so that OpenSSL offers it at all) is refused
    done = subprocess.run([*s_client, "-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"], input=b"",
                          capture_output=True, timeout=30)
    text = done.stdout.decode() + done.stderr.decode()
    assert done.returncode != 0 and "protocol version" in text, text
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="protocol_version")


def test_mosquitto_round_trip_over_mqtts(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki))
    tls = ("--cafile", str(pki.ca))
    sub = mosquitto_spawn("mosquitto_sub", b.mqtts_port, *tls, "-t", "secure/#", "-q", "1",
                          "-C", "1", "-v")
    b.wait_metric("blipmq_subscriptions", 1)
    done = mosquitto("mosquitto_pub", b.mqtts_port, *tls, "-t", "secure/hall", "-m", "21.5",
                     "-q", "1")
    assert done.returncode == 0, done.stderr
    out, err = sub.communicate(timeout=30)
    assert (sub.returncode, out) == (0, b"secure/hall 21.5\n"), err
    assert b.metric("blipmq_messages_published_total") == 1
    # a client that does not trust the broker's CA gives up; the broker counts its alert
    done = mosquitto("mosquitto_pub", b.mqtts_port, "--cafile", str(pki.other_ca), "-t", "x",
                     "-m", "x")
    assert done.returncode != 0
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="peer_refused")


# --------------------------------------------------------------------------- bad handshakes


def test_bad_handshakes_cost_only_their_connection(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki, server={"handshake_timeout_ms": 1000}))
    silent = socket.create_connection(("127.0.0.1", b.tls_port))  # connects, sends nothing
    # timed from its connect, meanwhile: the checks below may take longer than the timeout
    silent_for = concurrent.futures.ThreadPoolExecutor(1).submit(_wait_closed, silent, 10)
    plain = socket.create_connection(("127.0.0.1", b.tls_port))
    plain.sendall(b"HELLO, this is plain text\r\n")  # not a TLS record
    mqtt_plain = socket.create_connection(("127.0.0.1", b.mqtts_port))
    mqtt_plain.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")  # a plain CONNECT
    try:
        assert _wait_closed(plain, 5) < 1
        assert _wait_closed(mqtt_plain, 5) < 1
        # meanwhile a TLS client is served as usual, on the same listener
        tls = {"BLIPMQ_ADDR": f"tls://127.0.0.1:{b.tls_port}", "BLIPMQ_CAFILE": str(pki.ca)}
        done = b.cli("pub", "-q", "1", "still/served", "yes", **tls)
        assert done.returncode == 0, done.stderr
        # the silent one is cut once server.handshake_timeout_ms has passed
        assert 0.5 < silent_for.result(15) < 5
    finally:
        for sock in (silent, plain, mqtt_plain):
            sock.close()
    b.wait_metric("blipmq_tls_handshake_failures_total", 2, reason="not_tls")
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="timeout")
    assert b.metric("blipmq_messages_published_total") == 1
    # the first failure from an address is logged; the next ones from there only counted
    line = b.wait_log("TLS handshake from 127.0.0.1:")
    assert "failed: not_tls" in line
    assert "such failures from there are counted, not logged, for 60 s" in line
    # a failed handshake never became a connection: nothing of it is counted as closed
    assert b.metric("blipmq_connections_closed_total", reason="handshake_timeout") == 0


def test_a_flood_of_failed_handshakes_is_counted_not_logged_line_by_line(
        start_broker, pki: Pki) -> None:
    # regression: every failed handshake wrote an INFO line: a peer sending plain text to
    # the mqtts port in a loop wrote 14,800 lines (1.7 MB) in 3 s to the device's journal
    b = start_broker(broker_tls(pki))
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", b.mqtts_port)) as sock:
            sock.sendall(b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00")
            _wait_closed(sock, 5)
    b.wait_metric("blipmq_tls_handshake_failures_total", 200, reason="not_tls")
    assert b.cli("ping").returncode == 0
    assert sum("TLS handshake from" in line for line in list(b.log)) == 1


def test_client_certificates_required(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki, tls={"ca_file": str(pki.ca), "require_client_cert": True}))
    ca = ("--cafile", str(pki.ca))
    cert = ("--cert", str(pki.client_cert), "--key", str(pki.client_key))
    sub = mosquitto_spawn("mosquitto_sub", b.mqtts_port, *ca, *cert, "-t", "devices/+",
                          "-q", "1", "-C", "1", "-v")
    b.wait_metric("blipmq_subscriptions", 1)
    # without a certificate: refused, and nothing arrives
    done = mosquitto("mosquitto_pub", b.mqtts_port, *ca, "-t", "devices/anon", "-m", "x",
                     "-q", "1")
    assert done.returncode != 0
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="no_client_cert")
    # an expired one, from the right CA: refused too
    expired = ("--cert", str(pki.expired_cert), "--key", str(pki.expired_key))
    done = mosquitto("mosquitto_pub", b.mqtts_port, *ca, *expired, "-t", "devices/old",
                     "-m", "x", "-q", "1")
    assert done.returncode != 0
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="bad_client_cert")
    assert "certificate has expired" in b.wait_log("bad_client_cert")
    # with its certificate: accepted
    done = mosquitto("mosquitto_pub", b.mqtts_port, *ca, *cert, "-t", "devices/seven",
                     "-m", "here", "-q", "1")
    assert done.returncode == 0, done.stderr
    out, err = sub.communicate(timeout=30)
    assert (sub.returncode, out) == (0, b"devices/seven here\n"), err
    # the plain listeners are not affected: they ask for no certificate
    assert b.cli("pub", "devices/plain", "x").returncode == 0


def test_metrics_over_https(start_broker, pki: Pki) -> None:
    b = start_broker(broker_tls(pki, metrics={"tls": True}))
    assert f"metrics on https://127.0.0.1:{b.metrics_port}/metrics" in b.wait_log("listening")
    b.metrics_tls = pki.client_context()
    assert b.metric("blipmq_connections_open") == 0
    # plain HTTP to it is a failed handshake, counted like any other
    with socket.create_connection(("127.0.0.1", b.metrics_port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _wait_closed(sock, 5) < 5
    b.wait_metric("blipmq_tls_handshake_failures_total", 1, reason="not_tls")


def test_https_answers_survive_a_body_left_unread(start_broker, pki: Pki) -> None:
    """Over HTTPS too, the broker ends its side after the answer and reads what the client
    still sends before it closes: a POST with a 40 KB body gets its 405 (closing with the
    body unread reset the connection, and the client lost the answer)."""
    b = start_broker(broker_tls(pki, metrics={"tls": True}))
    raw = socket.create_connection(("127.0.0.1", b.metrics_port), timeout=10)
    with pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 40000\r\n\r\n"
                  + b"x" * 40000)
        got = _read_once_closed(s)
    assert got.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n"), got
    assert b"\r\nAllow: GET, HEAD\r\n" in got


def test_sighup_reloads_the_certificate_without_dropping_connections(
    start_broker, pki: Pki, tmp_path: Path
) -> None:
    cert, key = pki.reissue(tmp_path)
    b = start_broker(broker_tls(pki, tls={"cert_file": str(cert), "key_file": str(key)}))
    addr = f"tls://127.0.0.1:{b.tls_port}"
    with Client(addr, ssl_context=pki.client_context()) as before:
        other = make_pki(tmp_path / "other")
        pki.reissue(tmp_path, other.authority)  # new files in place
        b.proc.send_signal(signal.SIGHUP)
        assert "tls: reloaded tls.cert_file, tls.key_file" in b.wait_log("reloaded:")
        with Client(addr, ssl_context=other.client_context()) as after:  # the new one
            after.publish("t", b"x", qos=1)
        with pytest.raises(TlsError, match="not trusted"):  # the old one is gone
            Client(addr, ssl_context=pki.client_context())
        assert before.ping() < 5  # a connection made before goes on
    assert b.proc.poll() is None


def test_a_client_certificate_names_the_key(start_broker, pki: Pki) -> None:
    """tls.client_identity (cn here: "device-7") names the [[auth.keys]] entry of a client
    that offers no key of its own, with that key's permissions; a key, if given, decides."""
    from blipmq_cli.keys import mint

    stanza = mint("device-7", ["devices/seven/#"], ["cmd/seven/#"], False)
    seven = dict(tomlkit.parse(stanza.split("\n", 3)[3])["auth"]["keys"][0])
    admin_key, admin_text = _admin_key()
    b = start_broker(broker_tls(pki, tls={"ca_file": str(pki.ca), "require_client_cert": True,
                                          "client_identity": "cn"},
                                auth={"keys": [seven, admin_text]}))
    ca = ("--cafile", str(pki.ca))
    cert = ("--cert", str(pki.client_cert), "--key", str(pki.client_key))
    done = mosquitto("mosquitto_pub", b.mqtts_port, *ca, *cert, "-t", "devices/seven/t",
                     "-m", "mine", "-q", "1")
    assert done.returncode == 0, done.stderr
    # another device's topic: acknowledged (MQTT 3.1.1 has no refusal), not routed
    done = mosquitto("mosquitto_pub", b.mqtts_port, *ca, *cert, "-t", "devices/eight/t",
                     "-m", "not mine", "-q", "1")
    assert done.returncode == 0
    b.wait_metric("blipmq_mqtt_protocol_errors_total", 1, reason="forbidden")
    # the native protocol, no key: the certificate's key; its rules apply
    with Client(f"tls://127.0.0.1:{b.tls_port}",
                ssl_context=pki.client_context(cert=True)) as client:
        with pytest.raises(BrokerError, match="may not publish"):
            client.publish("devices/eight/t", b"x", qos=1)
    # a wrong key is not rescued by the certificate
    with pytest.raises(BrokerError, match="refused"):
        Client(f"tls://127.0.0.1:{b.tls_port}", api_key="bmq_wrong",
               ssl_context=pki.client_context(cert=True)).__enter__()
    log = b.cli("sub", "devices/#", "--from", "earliest", "-e", "--addr",
                f"tls://127.0.0.1:{b.tls_port}", "--cafile", str(pki.ca), "--cert",
                str(pki.client_cert), "--cert-key", str(pki.client_key),
                BLIPMQ_API_KEY=admin_key)
    assert (log.returncode, log.stdout) == (0, b"mine\n"), log.stderr


def _admin_key() -> tuple[str, dict]:
    from blipmq_cli.keys import mint

    text = mint("ops", ["#"], ["#"], True)
    return text.splitlines()[0], dict(tomlkit.parse(text.split("\n", 3)[3])["auth"]["keys"][0])


def test_sighup_with_a_bad_certificate_changes_nothing(start_broker, pki: Pki,
                                                      tmp_path: Path) -> None:
    # regression: a certificate file that cannot be used at a reload killed the broker
    cert, key = pki.reissue(tmp_path)
    b = start_broker(broker_tls(pki, tls={"cert_file": str(cert), "key_file": str(key)}))
    addr = f"tls://127.0.0.1:{b.tls_port}"
    cert.write_text("not a certificate")
    b.proc.send_signal(signal.SIGHUP)
    assert "tls.cert_file" in b.wait_log("reload refused")
    assert b.proc.poll() is None
    with Client(addr, ssl_context=pki.client_context()) as client:  # the old one in force
        assert client.ping() < 5


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("tls", "needle"),
    [
        ({}, "tls.cert_file: must be set: server.tls is on"),
        ({"cert_file": "/nonexistent/broker.pem"},
         "tls.cert_file: /nonexistent/broker.pem not found"),
        ({"cert_file": "{key}"}, "tls.cert_file: cannot load"),
        ({"cert_file": "{cert}", "key_file": "{client_key}"},
         "is not the key of tls.cert_file's certificate"),
        ({"cert_file": "{cert}", "key_file": "{key}", "require_client_cert": True},
         "tls.ca_file: must be set: tls.require_client_cert is on"),
    ],
)
def test_certificate_problems_stop_the_broker_in_one_line(
    start_broker, pki: Pki, tls: dict, needle: str
) -> None:
    names = {"key": pki.key, "cert": pki.cert, "client_key": pki.client_key}
    tls = {k: v.format(**names) if isinstance(v, str) else v for k, v in tls.items()}
    b = start_broker({"server": {"tls": True, "tls_port": 0}, "tls": tls}, expect_ready=False)
    assert b.proc.wait(30) == 2
    assert b.log_ended.wait(10)
    assert len(b.log) == 1 and needle in b.log[0], b.log
    assert b.log[0].startswith("blipmq: config error: ")


def test_tls_settings_matter_only_with_a_tls_listener() -> None:
    # a certificate named but no listener serving TLS: nothing is checked or loaded
    cfg = config_module.load(None, env={}, overrides={"tls.cert_file": "/nonexistent.pem"})
    assert config_module.tls_listeners(cfg) == ()
    on = config_module.load(None, env={}, overrides={"metrics.tls": True,
                                                     "tls.cert_file": __file__})
    assert config_module.tls_listeners(on) == ("metrics.tls",)
    # MQTT over TLS beyond loopback needs keys, client certificates or allow_anonymous
    beyond = {"mqtt.enabled": True, "mqtt.tls": True, "mqtt.tls_host": "0.0.0.0",
              "tls.cert_file": __file__}
    with pytest.raises(ConfigError) as info:
        config_module.load(None, env={}, overrides=beyond)
    assert info.value.key == "mqtt.tls_host"
    assert config_module.load(None, env={}, overrides={
        **beyond, "tls.require_client_cert": True, "tls.ca_file": __file__})


# ----------------------------------------------------------------------------- in-process


def _config(pki: Pki, **tls: object) -> config_module.Config:
    overrides = {"server.port": 0, "server.tls": True, "server.tls_port": 0,
                 "metrics.enabled": False, "wal.enabled": False,
                 "tls.cert_file": str(pki.cert), "tls.key_file": str(pki.key)}
    overrides.update({f"tls.{k}": v for k, v in tls.items()})
    return config_module.load(None, env={}, overrides=overrides)


async def _hello(port: int, ctx: ssl.SSLContext) -> trio.SSLStream[trio.SocketStream]:
    """A native connection over TLS, through HELLO and AUTH."""
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), ctx,
                            server_hostname="127.0.0.1")
    await stream.send_all(codec.encode(codec.Hello(codec.VERSION, "t", 1))
                          + codec.encode(codec.Auth("", 2)))
    decoder = codec.Decoder(1 << 20)
    frames: list[codec.Frame] = []
    while len(frames) < 2:
        data = await stream.receive_some(65536)
        assert data, "closed before WELCOME and AUTH_OK"
        decoder.feed(data)
        frames += decoder.frames()
    assert [type(f) for f in frames] == [codec.Welcome, codec.AuthOk]
    return stream


async def _ping(stream: trio.SSLStream[trio.SocketStream]) -> None:
    await stream.send_all(codec.encode(codec.Ping(b"p", 9)))
    decoder = codec.Decoder(1 << 20)
    while True:
        decoder.feed(await stream.receive_some(65536))
        frames = decoder.frames()
        if frames:
            assert isinstance(frames[0], codec.Pong)
            return


@pytest.mark.parametrize(("field", "name"), [("cn", "device-7"),
                                              ("san_email", "device-7@example.org")])
async def test_the_session_knows_the_client_certificate(
    nursery: trio.Nursery, pki: Pki, field: str, name: str
) -> None:
    server = Server(_config(pki, ca_file=str(pki.ca), require_client_cert=True,
                            client_identity=field))
    bound: Bound = await nursery.start(server.serve)
    assert bound.tls_port
    stream = await _hello(bound.tls_port, pki.client_context(cert=True))
    (session,) = server.sessions.values()
    assert session.tls is not None and session.tls_identity == name
    await stream.aclose()


async def test_without_a_required_identity_the_handshake_fails(
    nursery: trio.Nursery, pki: Pki
) -> None:
    # the client certificate has no DNS name: with san_dns it names nobody
    server = Server(_config(pki, ca_file=str(pki.ca), require_client_cert=True,
                            client_identity="san_dns"))
    bound: Bound = await nursery.start(server.serve)
    assert bound.tls_port
    with pytest.raises(trio.BrokenResourceError):
        await _hello(bound.tls_port, pki.client_context(cert=True))
    assert server.counters.tls_errors == {"no_identity": 1}
    assert not server.sessions


async def test_reload_swaps_the_certificate_for_new_connections(
    nursery: trio.Nursery, pki: Pki, tmp_path: Path
) -> None:
    cert, key = pki.reissue(tmp_path)
    config = _config(pki, cert_file=str(cert), key_file=str(key))
    server = Server(config)
    bound: Bound = await nursery.start(server.serve)
    assert bound.tls_port
    before = await _hello(bound.tls_port, pki.client_context())
    assert server.reload_tls() == "tls: certificate files unchanged"
    # a certificate from another CA replaces the files: new connections get it
    other = make_pki(tmp_path / "other")
    pki.reissue(tmp_path, other.authority)
    assert server.reload_tls() == ("tls: reloaded tls.cert_file, tls.key_file; new "
                                   "connections use them")
    after = await _hello(bound.tls_port, other.client_context())
    with pytest.raises(trio.BrokenResourceError):
        await _hello(bound.tls_port, pki.client_context())
    await _ping(before)  # the connection made before the reload goes on
    await _ping(after)
    # a file that cannot be used: a ConfigError, and the certificate in use stays
    key.write_text("not a key\n")
    with pytest.raises(ConfigError) as info:
        server.reload_tls()
    assert info.value.key == "tls.key_file"
    await (await _hello(bound.tls_port, other.client_context())).aclose()
    # a new configuration naming other files (what a SIGHUP reload passes)
    renamed = config_module.load(None, env={}, overrides={
        "tls.cert_file": str(other.cert), "tls.key_file": str(other.key)})
    assert "tls.cert_file" in server.reload_tls(renamed)
    await (await _hello(bound.tls_port, other.client_context())).aclose()
    for stream in (before, after):
        await stream.aclose()


async def test_reload_without_tls_says_nothing(nursery: trio.Nursery) -> None:
    server = Server(config_module.load(None, env={}, overrides={
        "server.port": 0, "metrics.enabled": False, "wal.enabled": False}))
    assert server.tls is None and server.reload_tls() == ""


def test_a_reload_may_not_open_mqtts_beyond_loopback_to_anyone(pki: Pki) -> None:
    # regression: with no keys and MQTT over TLS beyond loopback, client certificates were
    # all that kept strangers out, and a reload could turn them off (only dropping the last
    # key was checked): `blipmq start` refuses that configuration, a reload must too
    base = {"server.port": 0, "metrics.enabled": False, "wal.enabled": False,
            "mqtt.enabled": True, "mqtt.tls": True, "mqtt.tls_host": "0.0.0.0",
            "tls.cert_file": str(pki.cert), "tls.key_file": str(pki.key),
            "tls.ca_file": str(pki.ca)}
    server = Server(config_module.load(None, env={}, overrides={
        **base, "tls.require_client_cert": True}))  # not served: nothing binds 0.0.0.0
    before = server.config
    opened = config_module.load(None, env={}, overrides={
        **base, "mqtt.tls_host": "127.0.0.1", "tls.require_client_cert": False})
    with pytest.raises(ConfigError) as info:
        server.reload(opened)
    assert info.value.key == "mqtt.tls_host"
    assert "tls.require_client_cert" in str(info.value)
    assert server.config == before and server.config.tls.require_client_cert
    # allow_anonymous in the same edit does not help: [mqtt] changes only with a restart
    with pytest.raises(ConfigError):
        server.reload(opened._replace(mqtt=opened.mqtt._replace(allow_anonymous=True)))
    # a reload that keeps client certificates required goes through
    assert server.reload(config_module.load(None, env={}, overrides={
        **base, "tls.require_client_cert": True, "log.level": "debug"}))


def test_idle_sockets_give_way_at_max_connections(start_broker, pki: Pki) -> None:
    """h34 #8, h35 #1: sockets that never finish a handshake (TLS, or HELLO/CONNECT on a
    plain port) held every slot of server.max_connections until their handshakes timed out:
    whoever kept opening them kept every other client out, the loopback services too
    (CONNACK 3), and one per source address from many addresses did it as well as many from
    one. At the cap, a connection unproven for a second or more now gives way to a
    newcomer; an authenticated connection never does."""
    b = start_broker(broker_tls(pki, server={"max_connections": 6,
                                             "handshake_timeout_ms": 60_000}))
    flood = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{i}", 0))
             for i, port in enumerate((b.mqtts_port, b.tls_port, b.mqtt_port, b.port,
                                       b.mqtts_port, b.mqtts_port), start=2)]
    # six slots from six addresses, none of them ever says a word
    try:
        b.wait_metric("blipmq_connections_total", 6)
        time.sleep(admission.PATIENCE_S + 0.1)  # what makes them give way: their age
        # an MQTT device on the plain port is served all the same: one of the flood gives way
        done = mosquitto("mosquitto_pub", b.mqtt_port, "-t", "served/mqtt", "-m", "x", "-q", "1")
        assert done.returncode == 0, done.stderr
        assert b.metric("blipmq_connections_evicted_total") == 1
        # it left: room for one native subscriber; the second one takes another flood slot
        subs = [b.spawn("sub", "full/0")]
        b.wait_subscribers(1)
        subs.append(b.spawn("sub", "full/1"))
        b.wait_subscribers(2)
        assert b.metric("blipmq_connections_evicted_total") == 2
        tls = {"BLIPMQ_ADDR": f"tls://127.0.0.1:{b.tls_port}", "BLIPMQ_CAFILE": str(pki.ca)}
        done = b.cli("pub", "-q", "1", "served/tls", "z", **tls)
        assert done.returncode == 0, done.stderr
        assert b.metric("blipmq_connections_evicted_total") == 3
        assert b.metric("blipmq_connections_refused_total") == 0
        assert sum(_wait_closed_or_open(s) for s in flood) == 3  # three of the flood only
        line = b.wait_log("closed a connection from 127.0.0.")
        assert "at max_connections (6)" in line
        # authenticated connections never give way: six subscribers fill the broker
        for s in flood:
            s.close()
        b.wait_metric("blipmq_connections_open", 2)
        subs += [b.spawn("sub", f"full/{i}") for i in range(2, 6)]
        b.wait_subscribers(6)
        refused = b.cli("pub", "full/0", "no")
        assert refused.returncode != 0 and b"max_connections" in refused.stderr
        assert b.metric("blipmq_connections_refused_total") == 1
        assert b.metric("blipmq_subscriptions") == 6
        for sub in subs:
            sub.terminate()
            sub.wait(10)
    finally:
        for s in flood:
            s.close()


def _wait_closed_or_open(sock: socket.socket) -> bool:
    """Whether the broker closed ``sock`` (looked at for up to 2 s)."""
    try:
        return _wait_closed(sock, 2) < 2
    except AssertionError:
        return False

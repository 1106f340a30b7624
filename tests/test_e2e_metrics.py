"""What /metrics and the start-up log say agree with the docs, on a real broker."""

from __future__ import annotations

import re
import socket

from blipmq_server.protocol import codec


def raw_session(addr: str, *frames: codec.Frame) -> list[codec.Frame]:
    """Send frames after the handshake on a plain socket; return the broker's answers up to
    the PONG of a closing PING."""
    host, port = addr.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"".join(codec.encode(f) for f in (
            codec.Hello(codec.VERSION, "raw", 1), codec.Auth("", 2), *frames,
            codec.Ping(b"end", 99))))
        dec = codec.Decoder(1 << 24)
        got: list[codec.Frame] = []
        while not any(isinstance(f, codec.Pong) for f in got):
            data = s.recv(65536)
            assert data, "the broker closed the connection"
            dec.feed(data)
            got += dec.frames()
        return got


def publish(rid: int, *topics: str) -> codec.Publish:
    records = [codec.message_record(codec.Message(t, b"x")) for t in topics]
    return codec.decode_one(codec.encode_publish(records, rid))  # type: ignore[return-value]


def test_refused_messages_are_counted(start_broker) -> None:
    b = start_broker({"retained": {"max_topics": 0}})
    # a bad topic second in a batch of three: it and the one after it are not stored
    bad = codec.Publish((*publish(0, "ok").messages, publish(0, "$dlq/bad").messages[0],
                         *publish(0, "later").messages), 5)
    retained = codec.message_record(codec.Message("r", b"v", retain=True))
    answers = raw_session(b.addr, bad, codec.Publish(
        codec.decode_one(codec.encode_publish([retained])).messages, 6))  # type: ignore[union-attr]
    errors = [(f.code, f.request_id) for f in answers if isinstance(f, codec.Error)]
    assert errors == [(codec.ErrorCode.INVALID_TOPIC, 5), (codec.ErrorCode.LIMIT, 6)]
    assert b.metric("blipmq_messages_refused_total") == 3
    assert b.metric("blipmq_messages_published_total") == 1


def test_the_listening_line_follows_the_log_recovery_line(start_broker) -> None:
    """docs/OPERATIONS.md: recovery is logged first, then the line that says where the
    broker listens (the line scripts wait for)."""
    b = start_broker()
    listening = b.wait_log("listening on")
    assert b.log.index(listening) == 1
    assert " wal: " in b.log[0] and "recovered in" in b.log[0]
    assert f"listening on {b.addr}" in listening and "/metrics" in listening
    nolog = start_broker({"wal": {"enabled": False}})
    assert nolog.wait_log("listening on") == nolog.log[0]  # no log: nothing to recover


def test_metrics_parse_with_an_independent_parser_even_for_odd_filters(start_broker) -> None:
    """/metrics is written by the broker itself (blipmq_server/metrics.py); Prometheus's own
    Python parser must read all of it, and a durable group whose filter holds a quote, a
    backslash and a newline must come back with that filter as its label."""
    from prometheus_client.parser import text_string_to_metric_families

    b = start_broker()
    odd = 'odd"filter\\with/\nnewline'
    assert b.cli("pub", "--qos", "1", odd.replace("\n", "x"), "one").returncode == 0
    res = b.cli("sub", odd, "--group", "g", "--qos", "1", "--from", "earliest", "-e")
    assert res.returncode == 0, res.stderr
    families = {f.name: f for f in text_string_to_metric_families(b.metrics())}
    assert families["blipmq_messages_published"].type == "counter"
    assert families["blipmq_messages_published"].samples[0].value == 1
    assert families["blipmq_connections_open"].type == "gauge"
    labels = [s.labels for s in families["blipmq_group_in_flight"].samples]
    assert {"filter": odd, "group": "g"} in labels


def test_the_broker_does_not_load_openssl(start_broker) -> None:
    """trio imports ssl and hmac; the broker defers them (blipmq_server/deferred.py), so an
    idle broker's memory holds neither libssl nor libcrypto (docs/PERFORMANCE.md)."""
    b = start_broker()
    assert b.cli("pub", "t", "x").returncode == 0
    b.metric("blipmq_messages_published_total")  # the HTTP side has served a request too
    maps = open(f"/proc/{b.proc.pid}/maps").read()
    assert "libssl" not in maps and "libcrypto" not in maps


def test_metrics_can_require_a_token(start_broker) -> None:
    """metrics.token_hash: /metrics wants the token (bearer, or basic auth's password);
    /health and /ready stay open (metrics.open_health), unless switched off."""
    import base64
    import hashlib
    import urllib.error
    import urllib.request

    token = "scrape-" + "t" * 24
    hashed = "blake2b:" + hashlib.blake2b(token.encode()).hexdigest()
    b = start_broker({"metrics": {"token_hash": hashed}})
    base = f"http://127.0.0.1:{b.metrics_port}"

    def status(path: str, **headers: str) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers),
                                        timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            assert exc.code != 401 or exc.headers["WWW-Authenticate"] == "Bearer"
            return exc.code

    assert status("/metrics") == 401
    assert status("/metrics", Authorization="Bearer wrong") == 401
    assert status("/metrics", Authorization=f"Bearer {token}") == 200
    basic = base64.b64encode(f"prometheus:{token}".encode()).decode()
    assert status("/metrics", Authorization=f"Basic {basic}") == 200
    assert status("/metrics", Authorization="Basic !!!") == 401
    assert (status("/health"), status("/ready")) == (200, 200)
    assert token not in "\n".join(b.log)
    b.metrics_token = token
    assert b.metric("blipmq_auth_refused_total", reason="metrics") == 3
    closed = start_broker({"metrics": {"token_hash": hashed, "open_health": False}})
    base = f"http://127.0.0.1:{closed.metrics_port}"
    assert status("/health") == 401
    assert status("/health", Authorization=f"Bearer {token}") == 200


def test_metrics_connections_are_capped(start_broker) -> None:
    """The metrics listener serves 16 connections at once (each for at most 5 s of TLS
    handshake and 5 s for its request); one more is closed as soon as it is accepted and
    counted, so stalled connections cannot pile up file descriptors. Client connections are
    not affected."""
    import select
    import time

    b = start_broker({"server": {"max_connections": 2}})
    stalled = [socket.create_connection(("127.0.0.1", b.metrics_port), timeout=10)
               for _ in range(40)]
    closed: set[socket.socket] = set()
    deadline = time.monotonic() + 3  # well within the 5 s a served one may stay silent
    while len(closed) < 24 and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in stalled if s not in closed], [], [], 0.1)
        for s in readable:
            try:
                assert s.recv(1) == b""  # closed without a word
            except ConnectionResetError:
                pass
            closed.add(s)
    assert len(closed) == 24
    assert select.select([s for s in stalled if s not in closed], [], [], 0.2)[0] == []
    res = b.cli("pub", "t", "still served")  # a client connection is not held back
    assert res.returncode == 0, res.stderr
    for s in stalled:
        s.close()
    refused, turned_away = _refused_once_free(b)  # the served ones end with their peers
    assert refused == 24 + turned_away


def test_head_has_no_body_and_bare_newlines_end_a_request(start_broker) -> None:
    """HEAD gets the headers GET would (its Content-Length too), and no body (it had one);
    a request whose lines end in bare newlines is answered (it waited for CRLF CRLF until
    the timeout, then got nothing)."""
    b = start_broker()

    def ask(request: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", b.metrics_port), timeout=10) as s:
            s.sendall(request)
            got = b""
            while chunk := s.recv(65536):  # until the broker closes (Connection: close)
                got += chunk
            return got

    head = ask(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n"), head
    assert b"Content-Length: 3\r\n" in head
    bare = ask(b"GET /health HTTP/1.0\nHost: x\n\n")
    assert bare.startswith(b"HTTP/1.1 200 OK\r\n") and bare.endswith(b"\r\n\r\nok\n"), bare
    assert ask(b"\r\n\r\n").startswith(b"HTTP/1.1 400 Bad Request")


def test_the_metrics_docs_tell_to_watch_are_exported(start_broker) -> None:
    """docs/OPERATIONS.md's "What to watch in Prometheus" (its table and alert rules) names
    only series the broker exports: a rule on a name it no longer has is silently empty
    (regression: the group-lag alert used blipmq_group_log_behind, long replaced)."""
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    from tests.upstream import free_port

    doc = (Path(__file__).parent.parent / "docs" / "OPERATIONS.md").read_text()
    section = doc.split("### What to watch in Prometheus", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\bblipmq_[a-z0-9_]+", section))
    assert len(named) >= 10
    nobody = free_port()  # a bridge whose upstream refuses: its series are there
    b = start_broker({"bridge": [{"name": "up", "addresses": [f"127.0.0.1:{nobody}"],
                                  "topics": ["up/# out 1"]}]})
    assert b.cli("pub", "--qos", "1", "t", "one").returncode == 0
    assert b.cli("sub", "t", "--group", "g", "--qos", "1", "--from", "earliest",
                 "-e").returncode == 0
    exported = set()
    for family in text_string_to_metric_families(b.metrics()):
        exported |= {family.name, *(s.name for s in family.samples)}
    assert sorted(named - exported) == []


def _token_hash(token: str) -> str:
    import hashlib

    return "blake2b:" + hashlib.blake2b(token.encode()).hexdigest()


def test_a_refused_metrics_token_costs_what_a_refused_key_costs(start_broker) -> None:
    """A wrong token is answered 401 only after auth.failure_delay_ms, as a refused API key
    is, with its connection's slot held meanwhile (16 at once: more are closed at once and
    counted), while clients are served; the first refusal from an address is logged, the
    next ones are counted (it was answered at once: 10,000 guesses in 2 s, none logged)."""
    import select
    import time

    token = "scrape-" + "t" * 24
    b = start_broker({"metrics": {"token_hash": _token_hash(token)},
                      "auth": {"failure_delay_ms": 1000}})
    guess = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess\r\n\r\n"
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", b.metrics_port), timeout=10) as s:
        s.sendall(guess)
        assert s.recv(12) == b"HTTP/1.1 401"
    assert time.monotonic() - t0 >= 0.9
    line = b.wait_log("refused a metrics token from 127.0.0.1")
    assert "guess" not in line

    guessers = [socket.create_connection(("127.0.0.1", b.metrics_port), timeout=10)
                for _ in range(24)]
    t0 = time.monotonic()
    for s in guessers:
        s.sendall(guess)
    # the broker serves its clients while the guessers wait
    assert any(isinstance(f, codec.Pong) for f in raw_session(b.addr))
    assert time.monotonic() - t0 < 0.9
    answered = closed = 0
    for s in guessers:
        assert select.select([s], [], [], 10)[0], "no answer, no close"
        try:
            first = s.recv(12)
        except ConnectionResetError:
            first = b""
        if first:
            assert first == b"HTTP/1.1 401" and time.monotonic() - t0 >= 0.9
            answered += 1
        else:
            closed += 1
        s.close()
    assert answered <= 16 and closed >= 8 and answered + closed == 24
    b.metrics_token = token
    refused, turned_away = _refused_once_free(b)  # free once the guessers are seen to go
    assert refused == closed + turned_away
    assert b.metric("blipmq_auth_refused_total", reason="metrics") == 1 + answered
    assert sum("refused a metrics token" in line for line in b.log) == 1


def _refused_once_free(b, timeout: float = 10) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """``blipmq_metrics_connections_refused_total`` once the metrics listener takes a
    scrape again, and how many scrapes it turned away meanwhile (each one counted)."""
    import http.client
    import time

    deadline = time.monotonic() + timeout
    turned_away = 0
    while True:  # bounded by the deadline
        try:
            return b.metric("blipmq_metrics_connections_refused_total"), turned_away
        except (OSError, http.client.HTTPException):
            assert time.monotonic() < deadline, "the metrics listener stays full"
            turned_away += 1
            time.sleep(0.05)


def _read_once_closed(s: socket.socket, timeout: float = 10) -> bytes:
    """The answer, read only once the broker has ended the connection, as a client on a
    slow link reads it: a broker that closes with unread input resets the connection (RST)
    and the client's read fails (ECONNRESET) instead of returning the answer."""
    import time

    deadline = time.monotonic() + timeout
    while s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1:  # ESTABLISHED
        assert time.monotonic() < deadline, "the broker did not end the connection"
        time.sleep(0.01)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def _ask(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        return _read_once_closed(s)


def test_the_answer_survives_input_the_broker_did_not_read(start_broker) -> None:
    """A request with a body (or a head too long) left input unread, and closing then reset
    the connection: the client lost the answer (ECONNRESET). The broker now ends its side
    after the answer and reads what still comes before it closes. A 405 says what is
    allowed; a head over 8 KiB is answered 431 (it was answered from its first 8 KiB)."""
    b = start_broker()
    got = _ask(b.metrics_port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5000"
               b"\r\n\r\n" + b"x" * 5000)
    assert got.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n"), got
    assert b"\r\nAllow: GET, HEAD\r\n" in got
    got = _ask(b.metrics_port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nCookie: " + b"a" * 20000
               + b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), got
    got = _ask(b.metrics_port, b"GET /health HTTP/1.1\r\nHost: x\r\nCookie: " + b"a" * 8000
               + b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nok\n"), got


def test_absolute_targets_and_an_empty_line_before_the_request(start_broker) -> None:
    """RFC 9112: a server must accept a target in absolute form (it was a 404), and should
    skip an empty line before the request line (it was a 400)."""
    b = start_broker()
    port = b.metrics_port
    got = _ask(port, f"GET http://127.0.0.1:{port}/health HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"ok\n"), got
    got = _ask(port, b"GET HTTP://example.org/metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"blipmq_messages_published_total" in got
    got = _ask(port, b"\r\nGET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"ready\n"), got
    assert _ask(port, b"\r\n\r\n").startswith(b"HTTP/1.1 400 Bad Request")

"""The metrics listener's pieces without a socket: the request head's reading
(server/http.py ``head_of``)."""

from __future__ import annotations

from blipmq_server.server.http import head_of


def test_a_head_ends_at_its_empty_line() -> None:
    assert head_of(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nbody", ended=False) == (
        b"GET /metrics HTTP/1.1\r\nHost: x")
    assert head_of(b"GET /health HTTP/1.0\nHost: x\n\n", ended=False) == (
        b"GET /health HTTP/1.0\nHost: x")
    assert head_of(b"GET /metrics HTTP/1.1\r\nHost: x\r\n", ended=False) is None
    assert head_of(b"GET /metrics HTTP/1.1\r\n", ended=True) == b"GET /metrics HTTP/1.1\r\n"


def test_one_empty_line_before_the_request_line_is_skipped() -> None:
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request
    line (it was the request line: 400). A second one is still a bad request."""
    assert head_of(b"\r\nGET /health HTTP/1.1\r\n\r\n", ended=False) == b"GET /health HTTP/1.1"
    assert head_of(b"\nGET /health HTTP/1.1\n\n", ended=False) == b"GET /health HTTP/1.1"
    assert head_of(b"\r\n", ended=False) is None
    assert head_of(b"\r\n\r\n", ended=False) == "400 Bad Request"


def test_a_head_over_8_kib_is_refused_with_431() -> None:
    """It was answered from its first 8 KiB (or more), as if that were all of it."""
    line = b"GET /metrics HTTP/1.1\r\nCookie: " + b"a" * 9000
    assert head_of(line, ended=False) == "431 Request Header Fields Too Large"
    assert head_of(line + b"\r\n\r\n", ended=False) == "431 Request Header Fields Too Large"
    assert head_of(line[:8000], ended=False) is None
    assert head_of(line[:8000] + b"\r\n\r\n", ended=False) == line[:8000]

"""Opening listeners: an ASCII address reaches getaddrinfo as bytes (no idna codec to load
at start-up), and every other address as before."""

import pytest

from blipmq_server.server.listeners import _ascii, open_listeners


def test_what_the_idna_codec_would_encode_as_plain_ascii_is_passed_as_bytes() -> None:
    for host in ("127.0.0.1", "::1", "0.0.0.0", "localhost", "broker.example.", ""):
        assert _ascii(host) == host.encode("idna") == host.encode("ascii")
    # the codec refuses these (or changes them): they still go to it as str
    for host in ("a..b", "x" * 64 + ".example", "bücher.example"):
        assert _ascii(host) == host


async def test_listeners_open_on_an_ascii_address_and_say_where() -> None:
    listeners = await open_listeners("127.0.0.1", 0, "client listener")
    try:
        assert listeners[0].socket.getsockname()[0] == "127.0.0.1"
    finally:
        for listener in listeners:
            await listener.aclose()


async def test_an_address_the_idna_codec_refuses_is_refused_as_before() -> None:
    with pytest.raises(UnicodeError):
        await open_listeners("a..b", 0, "client listener")

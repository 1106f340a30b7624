"""`pub -l` and `pubfile` dialling their first connection: what is retried within
`--reconnect-for` and what is final. Real CLI processes, real sockets on 127.0.0.1: a port
nobody listens on, and tiny servers that are not BlipMQ brokers (an HTTP server, a TLS port
answering a plain connection with an alert)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import BLIPMQ

from blipmq_cli.exits import Exit

_HTTP = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_TLS_ALERT = b"\x15\x03\x03\x00\x02\x02\x46"  # TLS 1.2 record: a fatal protocol_version alert


def _env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
    env["BLIPMQ_ADDR"] = f"127.0.0.1:{port}"
    return env


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 bound by this test and not listening: a connection is refused,
    and nobody else can take the port meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


class _Stranger:
    """A server that is not a BlipMQ broker: each connection gets ``answer`` once the
    client wrote something, then is closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(4096)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("answer", [_HTTP, _TLS_ALERT], ids=["http", "tls-alert"])
@pytest.mark.parametrize("command", [["pub", "t", "-l", "-q", "1"],
                                     ["pubfile", "t", "-", "--reconnect-for", "60s"]],
                         ids=["pub-l", "pubfile"])
def test_a_port_that_is_not_a_broker_is_final(answer: bytes, command: list[str]) -> None:
    """Bytes back that are not BlipMQ's protocol: not a broker, and dialling again will not
    change it: exit 3 at once (was: retried for the whole --reconnect-for window)."""
    stranger = _Stranger(answer)
    try:
        began = time.monotonic()
        res = subprocess.run([BLIPMQ, *command], input=b"one\n", capture_output=True,
                             env=_env(stranger.port), timeout=30)
        took = time.monotonic() - began
    finally:
        stranger.close()
    err = res.stderr.decode()
    assert res.returncode == Exit.UNREACHABLE, err
    assert took < 5, (took, err)
    assert "trying again" not in err, err
    assert stranger.accepted == 1, err
    assert "malformed frame" in err, err
    # the hint for a plain connection to a TLS port stays
    assert f"(if it is a TLS port, connect to tls://127.0.0.1:{stranger.port})" in err, err
    assert err.count("\n") == 1, err


def test_pub_lines_with_nothing_to_send_does_not_wait(closed_port: int) -> None:
    """`printf '' | blipmq pub -l t` with no broker: stdin ended and nothing is held, so
    nothing can be lost: exit 0 saying so (was: waited the whole window, then exit 3 with
    "0 of 0 line(s) confirmed")."""
    began = time.monotonic()
    res = subprocess.run([BLIPMQ, "pub", "t", "-l", "-q", "1"], input=b"",
                         capture_output=True, env=_env(closed_port), timeout=30)
    took = time.monotonic() - began
    err = res.stderr.decode()
    assert res.returncode == Exit.OK, err
    assert took < 5, (took, err)
    assert err.splitlines()[-1] == ("blipmq: stdin ended with nothing to send: not waiting "
                                    "for the broker"), err


def test_pub_lines_with_a_last_line_still_waits(closed_port: int) -> None:
    """A last line without its newline is something to send: `pub -l` keeps trying until
    the window is spent, and counts it as not sent."""
    res = subprocess.run([BLIPMQ, "pub", "t", "-l", "-q", "1", "--reconnect-for", "1s"],
                         input=b"last", capture_output=True, env=_env(closed_port),
                         timeout=30)
    err = res.stderr.decode()
    assert res.returncode == Exit.UNREACHABLE, err
    assert err.endswith("; 0 of 1 line(s) confirmed; 1 not sent\n"), err


@pytest.mark.parametrize("command", [["pubfile", "t", "-"], ["pub", "t", "-f", "-"]],
                         ids=["pubfile", "pub-f"])
def test_pubfile_without_reconnect_says_the_message_was_not_sent(
        closed_port: int, command: list[str]) -> None:
    """By default a broker it cannot reach is exit 3 at once, and the error ends saying the
    message was not sent, as README promises (was: the connect error alone)."""
    res = subprocess.run([BLIPMQ, *command, "-q", "1"], input=b"payload",
                         capture_output=True, env=_env(closed_port), timeout=30)
    err = res.stderr.decode()
    assert res.returncode == Exit.UNREACHABLE, err
    assert err == (f"blipmq: cannot connect to 127.0.0.1:{closed_port}: Connection refused; "
                   "0 of 1 message(s) confirmed; 1 not sent\n"), err


def test_reconnect_for_spans_its_window(closed_port: int) -> None:
    """`--reconnect-for 2s`: the attempts span about 2 s of pauses (was: 1.4 s, only the
    whole doubling pauses that fit, shortened by their jitter)."""
    began = time.monotonic()
    res = subprocess.run([BLIPMQ, "pub", "t", "-l", "--reconnect-for", "2s"],
                         input=b"one\n", capture_output=True, env=_env(closed_port),
                         timeout=30)
    took = time.monotonic() - began
    err = res.stderr.decode()
    assert res.returncode == Exit.UNREACHABLE, err
    assert 1.8 <= took < 6, (took, err)
    said = re.search(r"gave up connecting after (\d+\.\d) s", err)
    assert said and float(said.group(1)) >= 1.8, err

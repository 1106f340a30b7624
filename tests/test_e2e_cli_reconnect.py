"""`producer | blipmq pub -l` across a broker restart (a `systemctl restart`, an upgrade):
the publisher connects again and sends every line not yet confirmed, so with QoS 1 every
line reaches the log at least once, in order; past `--reconnect-for` it gives up (exit 3).
Real broker processes on one port and data directory, the real CLI, a real pipe."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from conftest import BLIPMQ

from blipmq_cli.exits import Exit


def _published(b) -> float:
    return b.metric("blipmq_messages_published_total")


def _wait_published(b, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while _published(b) < n:
        assert time.monotonic() < deadline, f"{_published(b)} published, waited for {n}"
        time.sleep(0.02)


@contextlib.contextmanager
def _running(b, *args: str, lines: bytes = b"", **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """`blipmq ARGS` against ``b``, once ``lines`` (if any) are written to its stdin and
    published; killed on the way out, so that a failed step leaves nothing running."""
    proc = b.spawn(*args, **env)
    assert proc.stdin is not None
    try:
        if lines:
            proc.stdin.write(lines)
            proc.stdin.flush()
            _wait_published(b, lines.count(b"\n"))
        yield proc
    finally:
        proc.kill()
        proc.stdin.close()


def _ended(proc: subprocess.Popen[bytes], timeout: float = 15, said: str = "") -> tuple[int, str]:
    """``proc``'s exit code and its stderr (after ``said``, what was read of it before)."""
    rc = proc.wait(timeout)
    return rc, said + (proc.stderr.read().decode() if proc.stderr else "")


def _numbered(first: int, last: int) -> list[bytes]:
    return [b"line%d" % i for i in range(first, last + 1)]


def _text(lines: list[bytes]) -> bytes:
    return b"".join(x + b"\n" for x in lines)


def _in_order_at_least_once(got: list[bytes], want: list[bytes]) -> bool:
    """``got`` is ``want`` with some lines repeated (a line sent again after the restart
    may come twice), nothing missing and nothing out of order."""
    i = 0
    for line in got:
        if i < len(want) and line == want[i]:
            i += 1
        elif i == 0 or line not in want[:i]:
            return False
    return i == len(want)


def _logged(b, topic: str = "rs/t") -> list[bytes]:
    res = b.cli("sub", topic, "--from", "earliest", "-e")
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


@pytest.mark.parametrize("qos", ["0", "1"])
def test_pub_lines_goes_on_across_a_broker_restart(start_broker, qos: str) -> None:
    b = start_broker()
    lines = _numbered(1, 60)
    with _running(b, "pub", "rs/t", "-l", "-q", qos, lines=_text(lines[:20])) as pub:
        assert b.stop() == 0  # SIGTERM: the broker says GOODBYE (shutting down)
        # written while the broker is down: taken as they come, sent once it is back
        pub.stdin.write(_text(lines[20:40]))
        pub.stdin.flush()
        time.sleep(0.5)
        b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
        pub.stdin.write(_text(lines[40:]))
        pub.stdin.close()
        rc, err = _ended(pub, 30)
    assert rc == Exit.OK, err
    assert "reconnecting" in err and f"reconnected to 127.0.0.1:{b.port}" in err, err
    got = _logged(b2)
    if qos == "1":  # every line at least once, in order
        assert _in_order_at_least_once(got, lines), got
    else:  # QoS 0: what was in flight at the restart may be lost, not the lines after it
        assert got[:20] == lines[:20] and got[-20:] == lines[40:], got


def test_pub_lines_gives_up_after_reconnect_for(start_broker) -> None:
    b = start_broker()
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "1s",
                  lines=b"one\ntwo\n") as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL  # and it does not come back
        began = time.monotonic()
        rc, err = _ended(pub)
    assert rc == Exit.UNREACHABLE, err
    assert time.monotonic() - began < 10
    last = err.splitlines()[-1]
    assert last.startswith("blipmq: gave up reconnecting after ") and last.endswith(
        " of 2 line(s) confirmed"), err


def test_a_lost_connection_is_dialled_again_for_the_whole_window(start_broker) -> None:
    """A broker killed mid-stream and back 7.2 s later, within `--reconnect-for 9s`: every
    line arrives (was: exit 3 after 5.7 to 7.1 s, the whole backoff pauses that fit, less
    their jitter; only the first connection was dialled for the whole window)."""
    b = start_broker()
    lines = _numbered(1, 40)
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "9s",
                  lines=_text(lines[:20])) as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        pub.stdin.write(_text(lines[20:]))
        pub.stdin.flush()
        said = _wait_stderr(pub, "reconnecting")
        lost = time.monotonic()
        time.sleep(7.2)
        b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
        assert time.monotonic() - lost < 8.8, "the broker took too long to start"
        pub.stdin.close()
        rc, err = _ended(pub, 30, said)
    assert rc == Exit.OK, err
    assert f"reconnected to 127.0.0.1:{b.port}" in err, err
    assert _in_order_at_least_once(_logged(b2), lines)


def test_a_lost_connection_is_given_up_once_the_window_is_spent(start_broker) -> None:
    """`--reconnect-for 5s` and a broker that does not come back: exit 3 once the pauses add
    up to 5 s, not sooner (was: after at most 3.1 s, the whole backoff pauses that fit)."""
    b = start_broker()
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "5s",
                  lines=b"one\n") as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        pub.stdin.write(b"two\n")
        pub.stdin.flush()
        said = _wait_stderr(pub, "reconnecting")
        lost = time.monotonic()
        rc, err = _ended(pub, 30, said)
        took = time.monotonic() - lost
    assert rc == Exit.UNREACHABLE, err
    assert 4.9 < took < 15, (took, err)
    assert re.search(r"gave up reconnecting after (\d+\.\d) s \(\d+ attempts\)", err), err


def test_a_lost_connection_is_not_dialled_again_on_a_refused_key(start_broker) -> None:
    """A broker back with other API keys: exit 5 at once, as for a first connection (was:
    dialled again until --reconnect-for was spent, then exit 3)."""
    b = start_broker({"auth": {"api_keys": ["s3cret"]}})
    with _running(b, "pub", "rs/t", "-l", "-q", "1", lines=b"one\n",
                  BLIPMQ_API_KEY="s3cret") as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        start_broker({"server": {"port": b.port}, "auth": {"api_keys": ["other"]}},
                     data_dir=b.data_dir)
        pub.stdin.write(b"two\n")
        pub.stdin.flush()
        rc, err = _ended(pub, 20)  # well within the 60 s of --reconnect-for
    assert rc == Exit.AUTH, err
    assert "reconnecting" in err and "gave up" not in err, err


def test_reconnect_for_zero_exits_on_the_restart_and_needs_lines(start_broker) -> None:
    b = start_broker()
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "0",
                  lines=b"one\n") as pub:
        assert b.stop() == 0
        rc, err = _ended(pub)
    assert rc == Exit.REFUSED, err  # the broker's GOODBYE: shutting down
    # its confirm may still have been on the way when the broker stopped
    assert re.fullmatch(r"blipmq: broker is shutting down; [01] of 1 line\(s\) confirmed\n",
                        err), err
    for args, text in ((("--reconnect-for", "1s", "-m", "x"), "--reconnect-for is for -l"),
                       (("-l", "--reconnect-for", "soon"), "--reconnect-for 'soon'")):
        res = subprocess.run([BLIPMQ, "pub", "rs/t", *args], capture_output=True,
                             input=b"", env=b.env, timeout=30)
        assert res.returncode == Exit.USAGE, res
        assert res.stderr.decode().startswith(f"blipmq: {text}") and \
            res.stderr.count(b"\n") == 1, res.stderr


@pytest.mark.parametrize("end", ["SIGINT", "SIGTERM", "give up"])
def test_pub_lines_counts_lines_read_while_the_broker_is_away(start_broker, end: str) -> None:
    """Lines read during the outage are in the closing note as read and not sent, on every
    way out (was: "2 of 2 messages confirmed" with 4 lines given)."""
    b = start_broker()
    window = "3s" if end == "give up" else "60s"
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", window,
                  lines=b"one\ntwo\n") as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        time.sleep(0.5)
        pub.stdin.write(b"three\nfour\n")
        pub.stdin.flush()
        time.sleep(1)
        if end != "give up":
            pub.send_signal(getattr(signal, end))
        rc, err = _ended(pub)
    want = {"SIGINT": 130, "SIGTERM": -signal.SIGTERM, "give up": Exit.UNREACHABLE}[end]
    assert rc == want, err
    # a confirm may still have been on the way when the broker was killed
    assert re.search(r"; [0-2] of 4 line\(s\) confirmed; 2 not sent$", err.splitlines()[-1]), err


def test_pub_lines_counts_an_unfinished_last_line_as_not_sent(start_broker) -> None:
    """h36 F6: a last line without its newline, read before the broker went away, was in
    neither count once stdin ended during the outage ("2 of 2" for three lines given)."""
    b = start_broker()
    with _running(b, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "3s",
                  lines=b"one\ntwo\npart") as pub:
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        pub.stdin.close()  # stdin ends while the broker is away
        rc, err = _ended(pub)
    assert rc == Exit.UNREACHABLE, err
    assert re.search(r"; [0-2] of 3 line\(s\) confirmed; 1 not sent$", err.splitlines()[-1]), err


def _wait_stderr(proc: subprocess.Popen[bytes], text: str, timeout: float = 15) -> str:
    """What ``proc`` wrote on stderr until a line holding ``text`` (its readiness)."""
    assert proc.stderr is not None
    fd, seen = proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"no {text!r} on stderr: {seen!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"stderr ended without {text!r}: {seen!r}"
            seen += chunk
    return seen.decode()


_PAST_PIPE = 150_000  # more bytes than a pipe holds (64 KiB on Linux)


def _down(start_broker):
    """A broker started and stopped: its port and data directory, nobody listening."""
    b = start_broker()
    assert b.stop() == 0
    return b


@pytest.mark.parametrize("qos", ["0", "1"])
def test_pub_lines_waits_for_a_broker_not_up_yet(start_broker, qos: str) -> None:
    """A producer started before the broker (boot order, a restart at that moment): `pub -l`
    dials again within --reconnect-for and every line arrives (was: exit 3 at once, the
    lines lost)."""
    b = _down(start_broker)
    lines = _numbered(1, 40)
    with _running(b, "pub", "rs/t", "-l", "-q", qos) as pub:
        pub.stdin.write(_text(lines[:20]))
        pub.stdin.flush()
        said = _wait_stderr(pub, "trying again")
        b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
        pub.stdin.write(_text(lines[20:]))
        pub.stdin.close()
        rc, err = _ended(pub, 30, said)
    assert rc == Exit.OK, err
    assert err == (f"blipmq: cannot connect to 127.0.0.1:{b.port}: Connection refused; trying "
                   f"again for up to 60s\nblipmq: connected to 127.0.0.1:{b.port}\n"), err
    assert _logged(b2) == lines


def test_pub_lines_gives_up_on_a_broker_that_never_comes(start_broker) -> None:
    b = _down(start_broker)
    began = time.monotonic()
    res = subprocess.run([BLIPMQ, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "2s"],
                         input=b"one\ntwo\n", capture_output=True, env=b.env, timeout=30)
    assert res.returncode == Exit.UNREACHABLE, res
    assert 1 < time.monotonic() - began < 15
    err = res.stderr.decode().splitlines()
    assert len(err) == 2, err  # the note that it tries again, the one-line error
    assert re.fullmatch(r"blipmq: gave up connecting after \d+\.\d s \(\d+ attempts\): cannot "
                        rf"connect to 127\.0\.0\.1:{b.port}: Connection refused; 0 of 2 "
                        r"line\(s\) confirmed; 2 not sent", err[1]), err
    # --reconnect-for 0: exit 3 at once, as before
    res = subprocess.run([BLIPMQ, "pub", "rs/t", "-l", "-q", "1", "--reconnect-for", "0"],
                         input=b"one\n", capture_output=True, env=b.env, timeout=30)
    assert res.returncode == Exit.UNREACHABLE, res
    assert res.stderr.decode() == (f"blipmq: cannot connect to 127.0.0.1:{b.port}: "
                                   "Connection refused\n"), res.stderr


def test_pub_lines_does_not_retry_a_refused_key(start_broker) -> None:
    """Not reachable yet is dialled again; a refused API key, once the broker answers, is
    final: exit 5 at once, not after --reconnect-for."""
    b = _down(start_broker)
    with _running(b, "pub", "rs/t", "-l", "-q", "1", BLIPMQ_API_KEY="wrong") as pub:
        said = _wait_stderr(pub, "trying again")
        start_broker({"server": {"port": b.port}, "auth": {"api_keys": ["s3cret"]}},
                     data_dir=b.data_dir)
        rc, err = _ended(pub, 20, said)  # well within the 60 s of --reconnect-for
    assert rc == Exit.AUTH, err
    assert err.count("\n") == 2, err  # after the note that it tries again, one line


@pytest.mark.parametrize("qos", ["0", "1"])
def test_pubfile_goes_on_across_a_broker_killed_mid_file(start_broker, qos: str) -> None:
    """A broker SIGKILLed and restarted while `pubfile --reconnect-for 30s -` reads its
    input: the message goes out on the new connection (was: no --reconnect-for, exit 3)."""
    b = start_broker()
    payload = bytes(range(256)) * 1000
    with _running(b, "pubfile", "rs/f", "-", "-q", qos, "--reconnect-for", "30s") as pub:
        # more than a pipe holds: returns once pubfile reads, which it does once connected
        pub.stdin.write(payload[:_PAST_PIPE])
        pub.stdin.flush()
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
        pub.stdin.write(payload[_PAST_PIPE:])
        pub.stdin.close()
        rc, err = _ended(pub, 30)
    assert rc == Exit.OK, err
    assert f"reconnected to 127.0.0.1:{b.port}" in err, err
    res = b2.cli("sub", "rs/f", "--from", "earliest", "-e", "-N")
    assert res.returncode == 0, res.stderr
    assert res.stdout in (payload, payload * 2), len(res.stdout)  # at least once


def test_pub_file_waits_for_a_broker_not_up_yet(start_broker, tmp_path) -> None:
    """`pub -f` (which is pubfile) with --reconnect-for: a broker not up yet is dialled
    again (was: exit 3 at once; --reconnect-for was ignored with -f)."""
    b = _down(start_broker)
    (tmp_path / "fw.bin").write_bytes(b"\x00firmware\xff")
    with _running(b, "pub", "rs/fw", "-f", str(tmp_path / "fw.bin"), "-q", "1", "-r",
                  "--reconnect-for", "30s") as pub:
        said = _wait_stderr(pub, "trying again")
        b2 = start_broker({"server": {"port": b.port}}, data_dir=b.data_dir)
        rc, err = _ended(pub, 30, said)
    assert rc == Exit.OK, err
    res = b2.cli("sub", "rs/fw", "-C", "1", "-N", "-W", "10s")
    assert res.returncode == 0 and res.stdout == b"\x00firmware\xff", res


def test_pubfile_says_whether_its_message_was_confirmed(start_broker) -> None:
    """By default (a one-shot command) a lost connection is exit 3 at once, and the error
    says whether the message was confirmed (was: the lost connection alone)."""
    b = start_broker()
    with _running(b, "pubfile", "rs/f", "-", "-q", "1") as pub:
        pub.stdin.write(bytes(_PAST_PIPE))  # returns once pubfile is connected and reads
        pub.stdin.flush()
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL
        try:
            pub.stdin.write(b" rest")
            pub.stdin.close()
        except BrokenPipeError:  # it found the lost connection while it read, and ended
            pass
        rc, err = _ended(pub, 30)
    assert rc == Exit.UNREACHABLE, err
    # found while it read stdin (the socket woke it), or by the publish after stdin's end
    assert re.fullmatch(r"blipmq: [^\n]+; 0 of 1 message\(s\) confirmed(; 1 not sent| \(it "
                        r"may be stored: send it again to be sure\))\n", err), err


@pytest.mark.slow
def test_sub_dials_again_a_broker_at_max_connections(start_broker) -> None:
    """`sub` back to a broker that refuses it for now (at max_connections): it keeps dialling
    and resumes once there is room (was: it ended on the first refusal, exit 3)."""
    from blipmq_cli import BlipError, Client

    b = start_broker()
    with _running(b, "sub", "rs/full") as sub:
        b.wait_metric("blipmq_subscriptions", 1)
        assert b.stop(signal.SIGKILL) == -signal.SIGKILL  # the sub dials, pausing longer
        for _ in range(3):  # the holders take both places before the sub's next dial
            b = start_broker({"server": {"port": b.port, "max_connections": 2}},
                             data_dir=b.data_dir)
            holders = []
            try:
                holders = [Client(b.addr), Client(b.addr)]
            except BlipError:  # the sub dialled in between: once more
                for h in holders:
                    h.close()
                assert b.stop(signal.SIGKILL) == -signal.SIGKILL
                continue
            break
        try:
            b.wait_metric_at_least("blipmq_connections_refused_total", 1, timeout=20)
            assert sub.poll() is None, _ended(sub)
        finally:
            for h in holders:
                h.close()
        b.wait_metric("blipmq_subscriptions", 1, timeout=20)
        assert b.cli("pub", "rs/full", "after").returncode == 0
        assert sub.stdout is not None
        ready, _, _ = select.select([sub.stdout], [], [], 10)
        assert ready and sub.stdout.readline() == b"after\n"

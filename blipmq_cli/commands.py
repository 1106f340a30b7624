"""What the client commands do, shared by the lean parser (``fast``) and the Typer app.

Each command returns an exit code (``exits.Exit``); ``guarded`` turns every error into one
line on stderr plus its code, never a traceback. Nothing here imports typer, rich or trio at
module level: ``blipmq pub`` must start fast.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from blipmq_cli.client import Client, connect_from_env
from blipmq_cli.exits import Exit, for_error
from blipmq_cli.output import WRITERS
from blipmq_server.errors import BlipError, BrokerError, ConnectError
from blipmq_server.protocol.codec import ErrorCode, Message, Start

_READ = 1 << 16
_MAX_CREDIT = 1 << 16


def say(text: str) -> None:
    sys.stderr.write(f"blipmq: {text}\n")
    sys.stderr.flush()


def guarded(fn: Callable[[], int]) -> int:
    """Run a command; map every failure to one stderr line and an exit code."""
    try:
        return fn()
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return Exit.OK
    except (BlipError, TimeoutError) as exc:
        say(str(exc))
        return for_error(exc)
    except OSError as exc:
        say(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
        return Exit.USAGE
    except Exception as exc:  # a bug: still one line, and a distinct code
        say(f"internal error: {type(exc).__name__}: {exc}")
        return Exit.INTERNAL


def _silence_stdout() -> None:
    # stdout's reader went away (`| head -1`): point fd 1 at /dev/null so the interpreter's
    # final flush does not raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _key(key: str | None) -> bytes | None:
    return None if key is None else os.fsencode(key)


def pub(
    topic: str,
    message: str,
    *,
    addr: str | None,
    api_key: str | None,
    ttl: int = 0,
    qos: int = 0,
    key: str | None = None,
    lines: bool = False,
    retain: bool = False,
) -> int:
    if lines:
        if message != "-":
            say("--lines reads standard input: give '-' as the message")
            return Exit.USAGE
        return _pub_lines(topic, addr, api_key, ttl, qos, _key(key), retain)
    payload = sys.stdin.buffer.read() if message == "-" else os.fsencode(message)
    with connect_from_env(addr, api_key) as client:
        client.publish(topic, payload, qos=qos, ttl_ms=ttl, key=_key(key), retain=retain)
    return Exit.OK


def _stdin_lines(stream: BinaryIO, client: Client) -> Iterator[list[bytes]]:
    """Complete lines as they arrive (a read returns what is there, so `tail -f` streams).

    While stdin is quiet the client still reads its socket: it answers the broker's PINGs
    (a broker closes connections that do not) and reports a refusal or a closed link.
    """
    fd = stream.fileno()
    rest = b""
    while True:
        while fd not in select.select([fd, client.sock], [], [])[0]:
            client.check()  # only the socket is readable: take what came, answer PINGs
        chunk = os.read(fd, _READ)
        if not chunk:
            if rest:
                yield [rest]
            return
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        if parts:
            yield parts


def _pub_lines(
    topic: str, addr: str | None, api_key: str | None, ttl: int, qos: int, key: bytes | None,
    retain: bool = False,
) -> int:
    client = connect_from_env(addr, api_key)
    try:
        with client:
            plain = ttl == 0 and qos == 0 and key is None and not retain
            for batch in _stdin_lines(sys.stdin.buffer, client):
                if plain:
                    client.publish_many([(topic, line) for line in batch])
                else:
                    client.publish_many([Message(topic, line, qos, ttl, key, retain)
                                         for line in batch])
                client.check()
    except (BrokerError, ConnectError) as exc:
        if not qos:
            raise
        # say how far we got: every confirmed message is stored
        note = f"{client.confirmed} of {client.qos1_sent} messages confirmed"
        if isinstance(exc, BrokerError):
            raise BrokerError(exc.code, f"{exc.text}; {note}") from None
        raise ConnectError(f"{exc}; {note}") from None
    return Exit.OK


def pubfile(
    topic: str,
    path: str,
    *,
    addr: str | None,
    api_key: str | None,
    ttl: int = 0,
    qos: int = 0,
    key: str | None = None,
) -> int:
    size = os.path.getsize(path)
    with connect_from_env(addr, api_key) as client:
        if size > client.max_message:
            raise BrokerError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"{path} is {size} bytes, over the broker's limit of {client.max_message}",
            )
        with open(path, "rb") as f:
            data = f.read()
        if sys.stderr.isatty() and size >= 1 << 20:
            _send_with_progress(client, topic, data, ttl, qos, _key(key), path)
        else:
            client.publish(topic, data, qos=qos, ttl_ms=ttl, key=_key(key))
    return Exit.OK


def _send_with_progress(
    client: Client, topic: str, data: bytes, ttl: int, qos: int, key: bytes | None, path: str
) -> None:
    from rich.console import Console  # only on a terminal: rich costs start-up time
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"sending {os.path.basename(path)}", total=len(data))
        client.publish(
            topic, data, qos=qos, ttl_ms=ttl, key=key,
            progress=lambda sent: progress.update(task, completed=sent),
        )
        client.flush()


def sub(
    topic: str,
    *,
    addr: str | None,
    api_key: str | None,
    count: int | None = None,
    timeout: float | None = None,
    group: str = "",
    qos: int = 0,
    start: str = "latest",
    fmt: str = "raw",
    since: str | None = None,
) -> int:
    if count is not None and count < 1:
        say("--count must be at least 1")
        return Exit.USAGE
    where = _start(start, since)
    if isinstance(where, str):
        say(where)
        return Exit.USAGE
    if timeout is not None and timeout <= 0:
        say("--timeout must be a positive number of seconds")
        return Exit.USAGE
    write_batch = WRITERS[fmt]
    out = sys.stdout.buffer
    deadline = None if timeout is None else time.monotonic() + timeout
    received = 0
    with connect_from_env(addr, api_key) as client:
        # with --count, ask for no more unacked deliveries than we will take
        credit = min(count, _MAX_CREDIT) if qos and count is not None else 0
        subscription = client.subscribe(
            topic, group=group, qos=qos, credit=credit, start=where[0], start_offset=where[1]
        )
        while count is None or received < count:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                batch = subscription.next_batch(remaining)
            except TimeoutError:
                if received == 0 or count is not None:
                    say(f"timed out after {timeout:g} s with {received} message(s) received")
                    return Exit.TIMEOUT
                return Exit.OK
            if batch is None:
                say("the broker ended the subscription (shutting down)")
                return Exit.OK if count is None else Exit.REFUSED
            if count is not None and received + len(batch) > count:
                batch = batch[: count - received]
            received += len(batch)
            out.write(write_batch(batch))
            out.flush()
            if not qos:
                continue
            # acked only once written: a crash before this means redelivery, not loss
            if received == count:
                subscription.ack_at_close(*batch)
                continue
            if count is not None and count - received < _MAX_CREDIT:
                # shrink the window before the ack frees it: no more than we will write
                subscription.set_credit(count - received)
            subscription.ack(*batch)
    return Exit.OK


def _start(text: str, since: str | None = None) -> tuple[Start, int] | str:
    """``--from`` / ``--since`` values -> (Start, offset or time in ms); else the problem."""
    from blipmq_cli import when

    if since is not None:
        if text.strip().lower() != "latest":
            return "give --since or --from, not both"
        ms = when.since(since, int(time.time() * 1000))
        if ms is None:
            return f"--since {since!r}: give a duration such as 90s, 10m, 2h or 1d"
        return Start.TIME, ms
    word = text.strip().lower()
    if word == "latest":
        return Start.LATEST, 0
    if word == "earliest":
        return Start.EARLIEST, 0
    if word.isascii() and word.isdigit() and int(word) < 1 << 64:
        return Start.OFFSET, int(word)
    ms = when.instant(text)
    if ms is not None:
        return Start.TIME, ms
    return (f"--from {text!r}: give latest, earliest, a log offset (a whole number >= 0) or "
            "a time such as 2026-11-23T10:00:00Z")


def unsub(topic: str, *, addr: str | None, api_key: str | None, group: str) -> int:
    if not group:
        say("unsub needs --group NAME (a plain subscription ends with its connection)")
        return Exit.USAGE
    with connect_from_env(addr, api_key) as client:
        client.unsubscribe(topic, group=group)
    return Exit.OK


"""What the client commands do, shared by the lean parser (``fast``) and the Typer app.

Each command returns an exit code (``exits.Exit``); ``guarded`` turns every error into one
line on stderr plus its code, never a traceback. Nothing here imports typer, rich or trio at
module level: ``blipmq pub`` must start fast.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from blipmq_cli import durations
from blipmq_cli.client import Client, connect_from_env, redial, transient
from blipmq_cli.exits import Exit, Terminated, die_of_sigterm, for_error, terminated
from blipmq_cli.literal import visible
from blipmq_cli.output import TemplateError, writer
from blipmq_server.errors import BlipError, BrokerError, ConnectError, TlsError
from blipmq_server.protocol.codec import ErrorCode, Message, Start
from blipmq_server.protocol.connection import Reconnect

_READ = 1 << 16
# pub -l and pubfile: how long they try to connect again after a lost connection, or to
# connect at all when the broker is not up yet
RECONNECT_FOR = "60s"
_BACKOFF_S = (0.1, 2.0)  # the first and the longest pause between attempts


class UsageError(Exception):
    """Arguments that cannot work: one line on stderr, exit code 2."""


class BadName(Exception):
    """An invalid topic, filter or group name, found before asking the broker: exit code 7,
    as the broker's own refusal of it."""


def _check_group(group: str) -> None:
    from blipmq_server.protocol.names import group_problem

    problem = group_problem(group) if group else None
    if problem:
        raise BadName(problem)


def _check_share(name: str, group: str) -> None:
    """MQTT's shared-subscription spelling ``$share/GROUP/FILTER``: nothing can be published
    to a ``$share/`` topic, so as a native filter it would never match. Refused, with the
    native way to say it (``--group``)."""
    if not name.startswith("$share/"):
        return
    _, _, rest = name.partition("/")
    share, _, inner = rest.partition("/")
    if group or not share or not inner:
        raise UsageError(f"{name!r} is MQTT's shared subscription spelling, not a filter: "
                         "give the filter and --group NAME")
    raise UsageError(f"{name!r} is MQTT's shared subscription spelling, not a filter: here "
                     f"it is blipmq sub --group {share} {inner!r}")


def say(text: str) -> None:
    """One line on stderr, ``blipmq: `` first. What it quotes may come from a client or a
    file name (a topic, a segment's name, the broker's error text): control characters are
    written as escapes (``literal.visible``), so the line can neither move the cursor,
    retitle or clear the terminal, nor break in two."""
    if sys.stderr is None:  # closed (2>&-): the exit code still tells
        return
    try:
        sys.stderr.write(f"blipmq: {visible(text)}\n")
        sys.stderr.flush()
    except OSError:
        pass


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal (progress and hints go there); False when it is closed
    (``2>&-``: ``sys.stderr`` is None)."""
    return sys.stderr is not None and sys.stderr.isatty()


def guarded(fn: Callable[[], int]) -> int:
    """Run a command; map every failure to one stderr line and an exit code."""
    try:
        return fn()
    except UsageError as exc:
        say(str(exc))
        return Exit.USAGE
    except BadName as exc:
        say(str(exc))
        return Exit.BAD_NAME
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


def tls_options(addr: str | None, tls: bool = False, cafile: str | None = None,
                cert: str | None = None, cert_key: str | None = None,
                insecure: bool = False) -> str | None:
    """The TLS options as what they stand for: BLIPMQ_CAFILE, BLIPMQ_CERT, BLIPMQ_CERT_KEY
    and BLIPMQ_INSECURE in this process's environment, which the client reads (so do a
    reconnecting ``sub``, ``bench``'s workers and ``--exec``'s commands), and ``--tls`` as
    ``tls://`` in front of the address. Returns the address to use."""
    for name, value in (("BLIPMQ_CAFILE", cafile), ("BLIPMQ_CERT", cert),
                        ("BLIPMQ_CERT_KEY", cert_key), ("BLIPMQ_INSECURE", "1" if insecure
                                                        else None)):
        if value:
            os.environ[name] = value
    if not tls:
        return addr
    from blipmq_cli.client import tls_address

    return tls_address(addr or os.environ.get("BLIPMQ_ADDR"), True)


def _silence_stdout() -> None:
    # stdout's reader went away (`| head -1`): point fd 1 at /dev/null so the interpreter's
    # final flush does not raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _key(key: str | None) -> bytes | None:
    return None if key is None else os.fsencode(key)


def _stdin() -> BinaryIO:
    """stdin's bytes; a closed stdin (``<&-``) is a usage error."""
    if sys.stdin is None:
        raise UsageError("stdin is closed: give the message another way, or open stdin")
    return sys.stdin.buffer


def _too_large(what: str, limit: int) -> BrokerError:
    return BrokerError(ErrorCode.MESSAGE_TOO_LARGE,
                       f"{what} holds more than {limit} bytes, the broker's limit")


def _read_bounded(fd: int, client: Client, what: str) -> bytes:
    """Everything ``fd`` holds, read up to the broker's message limit + 1 byte (memory
    stays bounded whatever the input: /dev/zero, a pipe, a /proc file); past the limit,
    refused as too large (exit 6). While the input is quiet the client answers the
    broker's PINGs, as ``_stdin_lines`` does."""
    limit = client.max_message
    data = bytearray()
    while True:
        while fd not in select.select([fd, client.sock], [], [], client.timeout)[0]:
            client.check()
        chunk = os.read(fd, min(_READ, limit + 1 - len(data)))
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise _too_large(what, limit)


def _ttl_ms(ttl: str | None) -> int:
    if ttl is None:
        return 0
    ms = durations.milliseconds(ttl)
    if ms is None or ms >= 1 << 32:
        raise UsageError(f"--ttl {ttl!r}: give a duration such as 5000 (ms), 30s or 5m")
    return ms


def _reconnect_policy(text: str) -> Reconnect | None:
    """``--reconnect-for``: attempts until the pauses (``_BACKOFF_S``, doubling, shortened
    by a jitter) add up to that many seconds; None for 0 (no reconnects)."""
    limit = durations.seconds(text)
    if limit is None:
        raise UsageError(f"--reconnect-for {text!r}: give a duration such as 60s or 5m "
                         "(0: exit when the connection is lost)")
    if limit == 0:
        return None
    initial, maximum = _BACKOFF_S
    return Reconnect(attempts=1 << 30, initial=initial, maximum=maximum, jitter=0.2,
                     within=limit)


def _connect(
    addr: str | None, api_key: str | None, reconnect: Reconnect | None, window: str = "",
    pause: Callable[[float], object] = time.sleep, idle: Callable[[], bool] | None = None,
    **callbacks: Callable[..., object],
) -> Client | None:
    """``connect_from_env`` with ``reconnect`` for the client's lost connections. With a
    policy, a broker that cannot be reached when the command starts (not up yet, restarting)
    is dialled again by the same policy (``redial``), pausing with ``pause``, saying so on
    stderr; ConnectError once the pauses add up to ``window`` (the ``--reconnect-for`` it
    stands for), saying how long it tried. A final error (not ``transient``) is raised at
    once. None when ``idle`` says, after a pause, that there is nothing left to send."""
    def dial() -> Client:
        return connect_from_env(addr, api_key, reconnect=reconnect or False, pause=pause,
                                **callbacks)  # type: ignore[arg-type]

    began = time.monotonic()
    try:
        return dial()
    except (BlipError, TimeoutError) as exc:
        if reconnect is None or not transient(exc):
            raise
        say(f"{exc}; trying again for up to {window}")
        client = redial(reconnect, dial, exc, "connecting", pause, idle, began, tried=1)
    if client is not None:
        say(f"connected to {client.addr}")
    return client


def pub(
    topic: str | None,
    message: str | None,
    *,
    addr: str | None,
    api_key: str | None,
    topic_opt: str | None = None,
    message_opt: str | None = None,
    stdin: bool = False,
    lines: bool = False,
    path: str | None = None,
    ttl: str | None = None,
    qos: int = 0,
    key: str | None = None,
    retain: bool = False,
    reconnect_for: str | None = None,
) -> int:
    """``pub TOPIC MESSAGE``, or mosquitto's spelling ``pub -t TOPIC -m MESSAGE``; the
    message may instead come from stdin (``-``, ``-s``), stdin's lines (``-l``) or a file
    (``-f``, which is ``pubfile``). With ``-l`` a lost connection, or a broker not reachable
    yet, is dialled again for up to ``reconnect_for`` (``RECONNECT_FOR`` by default; for
    ``-f``, ``pubfile``'s)."""
    given = [a for a in (topic, message) if a is not None]
    if topic_opt is None:
        if not given:
            raise UsageError("give a topic: blipmq pub TOPIC MESSAGE (or -t TOPIC)")
        topic_opt = given.pop(0)
    if message_opt is None and given:
        message_opt = given.pop(0)
    if given:
        raise UsageError(f"unexpected argument {given[0]!r} (one topic, one message)")
    sources = [n for n, on in (("a message", message_opt not in (None, "-")),
                               ("-l/--lines", lines), ("-f/--file", path is not None)) if on]
    if len(sources) > 1:
        raise UsageError(f"give one of {' and '.join(sources)}")
    if path is not None:
        return pubfile(topic_opt, path, addr=addr, api_key=api_key, ttl=ttl, qos=qos, key=key,
                       retain=retain, reconnect_for=reconnect_for)
    if reconnect_for is not None and not lines:
        raise UsageError("--reconnect-for is for -l/--lines and -f/--file (a message given "
                         "here is sent at once)")
    ttl_ms = _ttl_ms(ttl)
    if lines:
        window = RECONNECT_FOR if reconnect_for is None else reconnect_for
        policy = _reconnect_policy(window)
        return _pub_lines(topic_opt, addr, api_key, ttl_ms, qos, _key(key), retain, policy,
                          window)
    if message_opt is None and not stdin:
        raise UsageError("give a message, '-' or -s for stdin, -l for stdin's lines, or "
                         "-f FILE")
    stream = _stdin() if stdin or message_opt == "-" else None
    with connect_from_env(addr, api_key) as client:
        if stream is not None:
            payload = _read_bounded(stream.fileno(), client, "stdin")
        else:
            payload = os.fsencode(message_opt)  # type: ignore[arg-type]
        client.publish(topic_opt, payload, qos=qos, ttl_ms=ttl_ms, key=_key(key), retain=retain)
    return Exit.OK


class _Lines:
    """Stdin for ``pub -l``: what ``pause`` read while the connection was down (a broker
    restart) waits here, in order, ahead of the rest; ``read`` counts the lines handed on."""

    _HELD = 64 * _READ  # stdin is not read past this much held: memory stays bounded

    def __init__(self, stream: BinaryIO) -> None:
        self.fd = stream.fileno()
        self.held: list[bytes] = []  # chunks read during pauses, not handed on yet
        self.held_size = 0
        self.eof = False  # a pause read stdin's end
        self.read = 0  # lines handed on (``_stdin_lines``)
        self.partial = False  # ``_stdin_lines`` holds the start of a line without its newline

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` between reconnect attempts, taking in what stdin brings."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.eof or self.held_size >= self._HELD:
                time.sleep(left)
                return
            if not select.select([self.fd], [], [], left)[0]:
                return
            chunk = os.read(self.fd, _READ)
            if not chunk:
                self.eof = True
                continue
            self.held.append(chunk)
            self.held_size += len(chunk)

    def next(self, client: Client) -> bytes:
        """The next chunk: a held one, else stdin's (b"" at its end), checking the client
        while stdin is quiet."""
        if self.held:
            chunk = self.held.pop(0)
            self.held_size -= len(chunk)
            return chunk
        if self.eof:
            return b""
        while self.fd not in select.select([self.fd, client.sock], [], [], client.timeout)[0]:
            client.check()  # the socket, or stdin quiet for `timeout`: answer PINGs, keep alive
            if self.held or self.eof:  # a reconnect's pauses read stdin
                return self.next(client)
        return os.read(self.fd, _READ)

    def empty(self) -> bool:
        """Whether stdin ended before a line was handed on and nothing is held: nothing
        to send (a ``pub -l`` that never connected may stop waiting)."""
        return self.eof and not self.held and self.read == 0 and not self.partial

    @property
    def waiting(self) -> int:
        """Lines read from stdin and held, not yet handed on (so never sent); at stdin's end
        a last line without its newline is one too (held, or begun before the pause)."""
        last = (not self.held[-1].endswith(b"\n")) if self.held else self.partial
        return sum(chunk.count(b"\n") for chunk in self.held) + (1 if self.eof and last else 0)


def _stdin_lines(lines: _Lines, client: Client) -> Iterator[list[bytes]]:
    """Complete lines as they arrive (a read returns what is there, so `tail -f` streams).

    While stdin is quiet the client still reads its socket: it answers the broker's PINGs
    (a broker closes connections that do not) and reports a refusal or a closed link, and
    its keepalive finds a silent link (``Client.check``).
    """
    limit = client.max_message
    rest: list[bytes] = []  # the pieces of a line without its newline yet (linear time)
    size = 0  # their length, refused past the broker's limit: memory stays bounded
    while True:
        chunk = lines.next(client)
        if not chunk:
            lines.partial = False  # handed on now, if there is one
            if rest:
                yield [b"".join(rest)]
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            rest.append(chunk)
            lines.partial = True
            size += len(chunk)
            if size > limit:  # the lines before it are published first (``_pub_lines``)
                lines.partial = False
                yield [b"".join(rest)]
                return
            continue
        parts = chunk[:end].split(b"\n")
        if rest:
            parts[0] = b"".join(rest) + parts[0]
        tail = chunk[end + 1:]
        rest, size = ([tail], len(tail)) if tail else ([], 0)
        lines.partial = bool(tail)
        yield parts


class _Tally:
    """How far ``pub -l`` got, across reconnects (a connection's own counts start at 0)."""

    def __init__(self, lines: _Lines) -> None:
        self.client: Client | None = None
        self.lines = lines
        self.confirmed = 0  # QoS 1 lines confirmed on the connections lost so far
        self.resent = 0  # ``client.resent`` at the last reconnect
        self.down = False  # lost and not reconnected: the client's counts are in the above

    def lost(self, error: BlipError) -> None:
        client = self.client
        assert client is not None
        self.confirmed += client.confirmed
        self.down = True

    def back(self, qos: int) -> None:
        client = self.client
        assert client is not None
        again = client.resent - self.resent
        self.resent = client.resent
        self.down = False
        if qos:
            say(f"reconnected to {client.addr}; {again} unconfirmed line(s) sent again")
        else:
            say(f"reconnected to {client.addr}; QoS 0: lines sent just before the loss may "
                "be lost")

    def note(self) -> str:
        """Lines read (handed to the client, or read from stdin while the broker was away)
        and how many of them were confirmed; the ones never sent, if any."""
        client = None if self.down else self.client
        confirmed = self.confirmed + (client.confirmed if client else 0)
        waiting = self.lines.waiting
        note = f"{confirmed} of {self.lines.read + waiting} line(s) confirmed"
        return f"{note}; {waiting} not sent" if waiting else note


def _pub_lines(
    topic: str, addr: str | None, api_key: str | None, ttl: int, qos: int, key: bytes | None,
    retain: bool = False, reconnect: Reconnect | None = None, window: str = RECONNECT_FOR,
) -> int:
    """Each line of stdin as a message, as the lines come. With ``reconnect``, a lost
    connection (a broker restart) is dialled again and the lines not yet confirmed are sent
    again (``Client``'s reconnect: at least once, in order); so is a broker that cannot be
    reached yet when it starts (``_connect``: stdin is read meanwhile, as during a
    reconnect's pauses)."""
    lines = _Lines(_stdin())
    tally = _Tally(lines)

    def lost(error: BlipError) -> None:
        tally.lost(error)
        say(f"{error}; reconnecting")

    # with QoS 1, SIGTERM (a supervisor, `timeout`) says how far it got, as Ctrl-C does
    old = signal.signal(signal.SIGTERM, terminated) if qos else None
    try:
        try:
            client = _connect(addr, api_key, reconnect, window, lines.pause, lines.empty,
                              on_disconnect=lost, on_reconnect=lambda where: tally.back(qos))
        except ConnectError as exc:
            if reconnect is None or isinstance(exc, TlsError):
                raise
            # gave up connecting: whatever stdin brought meanwhile was never sent
            raise ConnectError(f"{exc}; {tally.note()}") from None
        if client is None:  # nothing can be lost: success, as a `pub -l` given no lines
            say("stdin ended with nothing to send: not waiting for the broker")
            return Exit.OK
        tally.client = client
        with client:
            plain = ttl == 0 and qos == 0 and key is None and not retain
            limit = client.max_message
            number = 0  # lines published
            for batch in _stdin_lines(lines, client):
                long = next((i for i, line in enumerate(batch) if len(line) > limit), None)
                if long is not None:
                    batch = batch[:long]
                lines.read += len(batch)
                if plain:
                    client.publish_many([(topic, line) for line in batch])
                else:
                    client.publish_many([Message(topic, line, qos, ttl, key, retain)
                                         for line in batch])
                number += len(batch)
                if long is not None:  # the lines before it are out (and confirmed): exit 6
                    client.flush()
                    gone = "" if qos else f"; the {number} line(s) before it were published"
                    raise BrokerError(ErrorCode.MESSAGE_TOO_LARGE,
                                      f"line {number + 1} of stdin holds more than {limit} "
                                      f"bytes, the broker's limit{gone}")
                client.check()
    except (BrokerError, ConnectError) as exc:
        if not qos or tally.client is None:  # not connected: said above, or refused at once
            raise
        # say how far we got: every confirmed message is stored
        if isinstance(exc, BrokerError):
            raise BrokerError(exc.code, f"{exc.text}; {tally.note()}") from None
        raise ConnectError(f"{exc}; {tally.note()}") from None
    except TimeoutError as exc:  # the broker slow to confirm: how far we got, as above
        if not qos:
            raise
        raise TimeoutError(f"{exc}; {tally.note()}") from None
    except KeyboardInterrupt:
        if qos:  # still exit 130, but say how far we got, as above
            say(f"interrupted; {tally.note()}")
        raise
    except Terminated:
        say(f"terminated; {tally.note()}")
        die_of_sigterm()
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return Exit.OK


def pubfile(
    topic: str,
    path: str,
    *,
    addr: str | None,
    api_key: str | None,
    ttl: str | None = None,
    qos: int = 0,
    key: str | None = None,
    retain: bool = False,
    reconnect_for: str | None = None,
) -> int:
    """A file's bytes (``-``: all of stdin) as one message; ``retain`` keeps it as the
    topic's retained value.

    A one-shot command: by default a broker it cannot reach, or a lost connection, is one
    error and exit 3 at once (docs/CLIENT.md: a script wants a clear failure, not a command
    that waits), the error saying whether the message was confirmed (``_Sent``). The whole
    message is read before it is sent, so with ``reconnect_for`` it behaves as ``pub -l``:
    a lost connection or a broker not reachable yet is dialled again for that long and the
    message is sent again on the new connection unless the broker confirmed it (QoS 1); at
    QoS 0, which has no confirm, it is sent again whenever a reconnect came after it was
    handed on and before a PONG proved the broker processed it. At least once: a consumer
    may see it twice."""
    ttl_ms = _ttl_ms(ttl)
    window = "0" if reconnect_for is None else reconnect_for
    policy = _reconnect_policy(window)
    sent = _Sent(qos)

    def lost(error: BlipError) -> None:
        say(f"{error}; reconnecting")

    def back(where: str) -> None:
        again = "; the message is sent again" if sent.read and not sent.confirmed else ""
        say(f"reconnected to {where}{again}")

    with contextlib.ExitStack() as files:
        # opened before connecting, so a missing file or a directory is exit 2 at once
        fd = _stdin().fileno() if path == "-" else files.enter_context(
            open(path, "rb", buffering=0)).fileno()
        try:
            client = _connect(addr, api_key, policy, window, on_disconnect=lost,
                              on_reconnect=back)
            assert client is not None  # no ``idle``: a client or an exception
        except ConnectError as exc:
            if isinstance(exc, TlsError):
                raise
            # with or without reconnects: nothing went out, so a script knows to send it
            raise ConnectError(f"{exc}; {sent.note()}") from None
        try:
            with client:
                data = _read_file(fd, client, path)
                sent.read = True
                while True:
                    before = client.reconnects
                    if stderr_is_terminal() and len(data) >= 1 << 20:
                        _send_with_progress(client, topic, data, ttl_ms, qos, _key(key), path,
                                            retain)
                    else:
                        client.publish(topic, data, qos=qos, ttl_ms=ttl_ms, key=_key(key),
                                       retain=retain)
                    client.flush()  # QoS 1: confirmed; the PONG: processed
                    sent.confirmed = True
                    if qos or client.reconnects == before:
                        break
                    sent.confirmed = False  # QoS 0 across a reconnect: perhaps lost
        except (BrokerError, ConnectError, TimeoutError) as exc:
            if isinstance(exc, BrokerError) and exc.code == ErrorCode.MESSAGE_TOO_LARGE:
                raise
            # say whether it is stored, so that a user knows whether to send it again
            if isinstance(exc, BrokerError):
                raise BrokerError(exc.code, f"{exc.text}; {sent.note()}") from None
            raise type(exc)(f"{exc}; {sent.note()}") from None
    return Exit.OK


def _read_file(fd: int, client: Client, path: str) -> bytes:
    """``pubfile``'s input, up to the broker's limit: a regular file over it is refused at
    once (exit 6); a character device, a pipe or a /proc file says size 0, so at most the
    limit + 1 bytes are read (``_read_bounded``)."""
    if path == "-":
        return _read_bounded(fd, client, "stdin")
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_size > client.max_message:
        raise BrokerError(ErrorCode.MESSAGE_TOO_LARGE,
                          f"{path} is {st.st_size} bytes, over the broker's limit of "
                          f"{client.max_message}")
    return _read_bounded(fd, client, path)


class _Sent:
    """How far ``pubfile`` got with its one message, for the line an error ends with."""

    def __init__(self, qos: int) -> None:
        self.qos = qos
        self.read = False  # the whole message is read: it is being sent
        self.confirmed = False  # confirmed durable (QoS 1), or processed (QoS 0's PONG)

    def note(self) -> str:
        if not self.read:
            return "0 of 1 message(s) confirmed; 1 not sent"
        if self.confirmed:
            return "1 of 1 message(s) confirmed" if self.qos else "the message was published"
        if self.qos:
            return "0 of 1 message(s) confirmed (it may be stored: send it again to be sure)"
        return "QoS 0: the message may or may not be stored (-q 1 confirms it)"


def _send_with_progress(
    client: Client, topic: str, data: bytes, ttl: int, qos: int, key: bytes | None, path: str,
    retain: bool = False,
) -> None:
    from rich.console import Console  # only on a terminal: rich costs start-up time
    from rich.progress import Progress

    total = len(data)
    drawn = -1

    def shown(sent: int) -> None:
        # drawn at once, not on the bar's timer: over a fast link the whole file is written
        # between two timer ticks, and the bar went from empty to gone; once per percent
        nonlocal drawn
        percent = sent * 100 // total
        if percent != drawn:
            drawn = percent
            progress.update(task, completed=sent, refresh=True)

    from rich.markup import escape

    from blipmq_cli.literal import visible

    # the description is read as markup: a file's name is not (literal.py)
    name = "stdin" if path == "-" else escape(visible(os.path.basename(path)))
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"sending {name}", total=total)
        client.publish(topic, data, qos=qos, ttl_ms=ttl, key=key, retain=retain,
                       progress=shown)
        client.flush()


def sub(
    topics: list[str],
    *,
    addr: str | None,
    api_key: str | None,
    topic_opt: list[str] | None = None,
    count: int | None = None,
    timeout: str | None = None,
    group: str = "",
    qos: int = 0,
    start: str = "latest",
    fmt: str | None = None,
    verbose: bool = False,
    raw: bool = False,
    command: str | None = None,
    jobs: int = 1,
    retry_delay: str = "1s",
    no_reconnect: bool = False,
    background: bool = False,
    since: str | None = None,
    until_end: bool = False,
) -> int:
    from blipmq_cli import subscriber

    filters = tuple(topics) + tuple(topic_opt or ())
    if not filters:
        raise UsageError("give a topic filter: blipmq sub FILTER... (or -t FILTER)")
    if count is not None and count < 1:
        raise UsageError("--count must be at least 1")
    from blipmq_server.protocol.names import filter_problem

    for name in filters:
        _check_share(name, group)
    for name in filters:  # as the broker would refuse it (exit 7), and before encoding it
        problem = filter_problem(name)
        if problem:
            raise BadName(problem)
    _check_group(group)
    where = _start(start, since)
    if isinstance(where, str):
        raise UsageError(where)
    seconds = None
    if timeout is not None:
        seconds = durations.seconds(timeout)
        if not seconds:
            raise UsageError(f"--timeout {timeout!r}: give a positive duration such as 30 "
                             "(seconds), 500ms or 5m")
    retry_ms = durations.milliseconds(retry_delay)
    if retry_ms is None or retry_ms >= 1 << 32:
        raise UsageError(f"--retry-delay {retry_delay!r}: give a duration such as 1s or 500ms")
    if not 1 <= jobs <= 1024:
        raise UsageError("--jobs must be between 1 and 1024")
    if command is not None and (fmt is not None or verbose or raw):
        raise UsageError("--exec hands each message to the command: it takes no output format")
    try:
        write = writer(fmt, verbose, raw)
    except TemplateError as exc:
        raise UsageError(str(exc)) from None
    plan = subscriber.Plan(filters, group, qos, where, count, seconds, write, command, jobs,
                           retry_ms, not no_reconnect, background, until_end)
    return subscriber.run(plan, addr, api_key)


def _start(text: str, since: str | None = None) -> tuple[Start, int] | str:
    """``--from`` / ``--since`` values -> (Start, offset or time in ms); else the problem."""
    import time

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
    _check_group(group)
    with connect_from_env(addr, api_key) as client:
        client.unsubscribe(topic, group=group)
    return Exit.OK


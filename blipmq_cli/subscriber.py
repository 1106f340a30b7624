"""``blipmq sub``: subscribe to one or more filters and hand every message on, to stdout in
a format or to a command run once per message (``--exec``).

When a QoS 1 message is acked:
- written to stdout: once the bytes are written to the pipe (``write`` returned), not once
  the reader handled them. A reader that crashes loses what it had read and not handled.
- with ``--exec CMD``: once CMD exited 0. A failure (exit status not 0, or killed by a
  signal) is NACKed with ``--retry-delay`` and redelivered, and after the broker's
  ``delivery.max_retries`` deliveries it goes to ``$dlq/<topic>`` with ``exit status N`` as
  its reason. At most ``--jobs`` commands run at once, and the subscription's window of
  unacked deliveries is ``--jobs``, so no message waits in this process while its ack
  deadline runs.

The connection comes back after a broker restart or a lost link, with a growing pause, unless
``--no-reconnect``: a group resumes where it was; a subscription of its own resumes after
the last offset it saw when the broker has a log (offsets are not 0), and otherwise says on
stderr that it may have missed what was published in between.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from blipmq_cli.client import Client, Subscription, connect_from_env, transient
from blipmq_cli.commands import say, stderr_is_terminal
from blipmq_cli.environment import for_children
from blipmq_cli.exits import Exit, Terminated, die_of_sigterm, terminated
from blipmq_cli.output import Writer
from blipmq_server.errors import BlipError, ConnectError
from blipmq_server.protocol.codec import Delivery, Start

_MAX_CREDIT = 1 << 16
_PIPE_PAYLOAD = 1 << 16  # larger payloads reach --exec commands through a temporary file
_BACKOFF_S = (0.1, 5.0)  # first and longest pause between reconnect attempts
_QUEUED = 1024  # QoS 0 messages waiting for a free --exec slot, at most
_SEEN = 4096  # offsets remembered to print a message that matches several filters once
_GRACE_S = 2.0  # an --exec command ended on the way out gets this long after SIGTERM


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``sub`` was asked to do, checked."""

    filters: tuple[str, ...]
    group: str
    qos: int
    start: tuple[Start, int]
    count: int | None
    timeout: float | None
    write: Writer
    command: str | None = None
    jobs: int = 1
    retry_delay_ms: int = 1000
    reconnect: bool = True
    background: bool = False
    until_end: bool = False


class _Run:
    """One ``sub``, across reconnects."""

    def __init__(self, plan: Plan, addr: str | None, api_key: str | None) -> None:
        self.plan = plan
        self.addr = addr
        self.api_key = api_key
        self.deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        self.received = 0  # messages written, or handed to --exec commands and finished
        self.last_offset = 0
        self.seen: deque[int] = deque(maxlen=_SEEN)
        self.seen_set: set[int] = set()
        self.jobs: dict[int, tuple[subprocess.Popen[bytes], Subscription | None, Delivery]] = {}
        self.queued: deque[tuple[Subscription, Delivery]] = deque()
        self.failures = 0
        self.out = sys.stdout.buffer

    # ------------------------------------------------------------------------- lifecycle

    def run(self) -> int:
        if self.plan.command is None:
            return self._run()
        # --exec: the commands run in their own process groups, and end with this process
        # whatever ends it (a signal, a lost reader, an error): none is left behind
        old = signal.signal(signal.SIGTERM, terminated)
        try:
            return self._run()
        except Terminated:
            self._stop()
            die_of_sigterm()  # as without --exec
            raise
        finally:
            self._stop()
            signal.signal(signal.SIGTERM, old)

    def _run(self) -> int:
        client = self._connect()  # the first connection's failure is the command's
        self._announce(client)
        pause = _BACKOFF_S[0]
        while True:
            try:
                code = self._consume(client)
            except ConnectError as exc:
                if not self.plan.reconnect:
                    raise
                client.abort()
                self._orphan()
                say(f"{exc}; reconnecting")
            else:
                if code is not None:
                    return code
                if not self.plan.reconnect:
                    say("the broker ended the subscription (shutting down)")
                    return Exit.OK if self.plan.count is None else Exit.REFUSED
                client.abort()
                self._orphan()
                say("the broker is shutting down; reconnecting")
            client = self._reconnect(pause)
            if client is None:
                return self._timed_out()
            pause = _BACKOFF_S[0]

    def _connect(self) -> Client:
        client = connect_from_env(self.addr, self.api_key)
        try:
            self.subs = self._subscribe(client)
        except BaseException:
            client.abort()
            raise
        return client

    def _subscribe(self, client: Client) -> list[Subscription]:
        plan = self.plan
        credit = 0
        if plan.qos:
            if plan.command is not None:
                credit = plan.jobs
            elif plan.count is not None:
                credit = min(plan.count, _MAX_CREDIT)  # no more unacked than we will take
        start, offset = plan.start
        if self.last_offset and not plan.group:  # after a reconnect: go on where we were
            start, offset = Start.OFFSET, self.last_offset + 1
        return [client.subscribe(f, group=plan.group, qos=plan.qos, credit=credit, start=start,
                                 start_offset=offset, until_end=plan.until_end)
                for f in plan.filters]

    def _announce(self, client: Client) -> None:
        plan = self.plan
        what = ", ".join(repr(f) for f in plan.filters)
        if plan.group:
            what += f" in group {plan.group!r}"
        if plan.background:
            sys.stdout.flush()
            pid = os.fork()
            if pid:
                say(f"subscribed to {what}, in the background (pid {pid})")
                os._exit(0)
        elif stderr_is_terminal():
            say(f"subscribed to {what}")

    def _reconnect(self, pause: float) -> Client | None:
        """Connect again with growing pauses; None when ``--timeout`` runs out first. An
        answer that dialling again cannot change (``client.transient``: a refused API key,
        a failed TLS handshake, not BlipMQ's protocol) is raised; a broker that is not ready
        (shutting down, at max_connections) is dialled again, as one not up yet."""
        lost_at = time.monotonic()
        while True:
            if self.deadline is not None and time.monotonic() + pause > self.deadline:
                return None
            time.sleep(pause)
            try:
                client = self._connect()
            except (BlipError, OSError) as exc:
                if isinstance(exc, BlipError) and not transient(exc):
                    raise
                pause = min(pause * 2, _BACKOFF_S[1])
                continue
            if self.plan.group:
                note = "the group goes on where it was"
            elif self.last_offset:
                note = f"going on after offset {self.last_offset}"
            else:
                note = (f"messages published in the last {time.monotonic() - lost_at:.1f} s "
                        "may have been missed")
            say(f"reconnected to {client.addr}; {note}")
            return client

    def _timed_out(self, note: str = "") -> int:
        plan = self.plan
        if self.received == 0 or plan.count is not None:
            say(f"timed out after {plan.timeout:g} s with {self.received} message(s) "
                f"received{note}")
            return Exit.TIMEOUT
        if note:
            say(f"timed out after {plan.timeout:g} s{note}")
        return Exit.OK

    # --------------------------------------------------------------------------- consume

    def _consume(self, client: Client) -> int | None:
        """Take deliveries until done (an exit code) or the broker ends the stream (None).
        Raises ConnectError when the link is lost."""
        plan = self.plan
        # stdout's reader going away (`| head -1`) ends the run, with --exec too: the
        # commands write to the same stdout, and would only die of SIGPIPE one by one
        client.hangup_fd = _stdout_fd() if plan.command is not None else sys.stdout.fileno()
        wake = _ChildSignal() if plan.command is not None else None
        if wake is not None:
            client.wake_fds = (wake.fd,)
        try:
            while plan.count is None or self.received < plan.count:
                if wake is not None:
                    wake.drain()
                    self._reap()
                    self._launch()
                    if plan.count is not None and self.received >= plan.count:
                        break
                    if self._at_end() and not self.queued:
                        break
                remaining = None
                if self.deadline is not None:
                    remaining = self.deadline - time.monotonic()
                    if remaining <= 0:
                        return self._finish(client, None)
                if wake is not None and len(self.queued) >= _QUEUED:
                    # QoS 0 faster than the commands: read no more until one ends (the
                    # broker's queue for us fills and its overflow policy applies)
                    wake.wait(remaining)
                    continue
                try:
                    got = client.next_of(self.subs, remaining)
                except TimeoutError:
                    return self._finish(client, None)
                if got is None:
                    return None
                sub, batch = got
                if sub is None:
                    continue
                if not batch:  # an end mark (--until-end)
                    if self._at_end() and wake is None:
                        break
                    continue
                self._take(client, sub, batch)
            return self._finish(client, Exit.OK)
        except BrokenPipeError:
            # stdout's reader went away: the running commands are ended unacked (their
            # messages come again, not nacked: not their fault); what finished is acked
            self._stop()
            client.close()
            raise
        finally:
            if wake is not None:
                wake.close()
                client.wake_fds = ()

    def _at_end(self) -> bool:
        """--until-end, and every subscription had what the log held when it began."""
        return self.plan.until_end and all(s.at_end for s in self.subs)

    def _fresh(self, batch: Sequence[Delivery]) -> list[Delivery]:
        """The deliveries not seen already through another filter (same log offset)."""
        if len(self.plan.filters) == 1:
            return list(batch)
        out = []
        for d in batch:
            if d.offset and d.offset in self.seen_set:
                continue
            if d.offset:
                if len(self.seen) == self.seen.maxlen:
                    self.seen_set.discard(self.seen[0])
                self.seen.append(d.offset)
                self.seen_set.add(d.offset)
            out.append(d)
        return out

    def _take(self, client: Client, sub: Subscription, batch: tuple[Delivery, ...]) -> None:
        plan = self.plan
        fresh = self._fresh(batch)
        if len(fresh) < len(batch) and plan.qos:
            sub.ack(*(d for d in batch if d not in fresh))  # printed through another filter
        if plan.command is not None:
            self.queued.extend((sub, d) for d in fresh)
            return
        if plan.count is not None and self.received + len(fresh) > plan.count:
            fresh = fresh[: plan.count - self.received]
        if not fresh:
            return
        self.received += len(fresh)
        self.out.write(plan.write(fresh))
        self.out.flush()
        live = [d.offset for d in fresh if d.offset and not d.retained]  # not a retained value
        if live:
            self.last_offset = max(self.last_offset, live[-1])
        if not plan.qos:
            return
        # acked only once written: a crash before this means redelivery, not loss
        if self.received == plan.count:
            sub.ack_at_close(*fresh)
            return
        if plan.count is not None and plan.count - self.received < _MAX_CREDIT:
            sub.set_credit(plan.count - self.received)  # shrink the window before the ack
        sub.ack(*fresh)

    def _finish(self, client: Client, code: int | None) -> int:
        """Let running commands end (their outcome is acked), then close. ``--timeout``
        bounds that too: when it has run out (``code`` None: it had already) the commands
        still running are ended (``_stop``) and the run has timed out."""
        self._reap()  # what ended already counts, even when time ran out
        while self.jobs and code is not None:
            self._reap()
            if self.jobs and self.deadline is not None and time.monotonic() >= self.deadline:
                code = None
            elif self.jobs:
                time.sleep(0.01)
        stopped = self._stop()
        client.close()
        if code is not None:
            return code
        note = ""
        if stopped:
            note = (f"; ended {stopped} command(s) still running (their message(s) "
                    f"{'come again' if self.plan.qos else 'are lost at QoS 0'})")
        return self._timed_out(note)

    # ------------------------------------------------------------------------ --exec

    def _launch(self) -> None:
        plan = self.plan
        while self.queued and len(self.jobs) < plan.jobs:
            if plan.count is not None and self.received + len(self.jobs) >= plan.count:
                return
            sub, d = self.queued.popleft()
            proc = _start(plan.command or "", d)
            self.jobs[proc.pid] = (proc, sub, d)

    def _orphan(self) -> None:
        """The connection is gone: queued messages come again from the broker, and what
        running commands end with can no longer be acked (they are redelivered)."""
        self.queued.clear()
        self.jobs = {pid: (proc, None, d) for pid, (proc, _, d) in self.jobs.items()}

    def _stop(self) -> int:
        """End the running commands (SIGTERM to each one's process group, SIGKILL after
        ``_GRACE_S``) without acking or nacking their messages: a QoS 1 message comes
        again from the broker once this connection is gone. Returns how many ran."""
        jobs = list(self.jobs.values())
        self.jobs = {}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc, _, _ in jobs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:  # its group is gone already
                        pass
            ends = time.monotonic() + _GRACE_S
            while any(p.poll() is None for p, _, _ in jobs) and time.monotonic() < ends:
                time.sleep(0.01)
        for proc, _, _ in jobs:
            proc.wait()  # killed: not long
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # what the shell left in its group
            except (ProcessLookupError, PermissionError):
                pass
        return len(jobs)

    def _reap(self, block: bool = False) -> None:
        for pid, (proc, sub, d) in list(self.jobs.items()):
            status = proc.wait() if block else proc.poll()
            if status is None:
                continue
            if status == -signal.SIGPIPE and _stdout_gone():
                # stdout's reader went away: not the message's fault; end the run as a
                # `sub | head` does (exit 0) and let the broker deliver it again
                raise BrokenPipeError("stdout was closed")
            del self.jobs[pid]
            if sub is None:
                continue  # from before a reconnect: the broker delivers it again
            self.received += 1
            if d.offset and not d.retained:  # a retained value's offset is from before
                self.last_offset = max(self.last_offset, d.offset)
            if status == 0:
                if self.plan.qos:
                    sub.ack(d)
                continue
            self.failures += 1
            why = f"exit status {status}" if status > 0 else f"killed by signal {-status}"
            if not self.plan.qos:
                say(f"{why} for offset {d.offset} (QoS 0: not redelivered)")
                continue
            say(f"{why} for offset {d.offset} (delivery {d.delivery_count}): given back")
            sub.nack(d, delay_ms=self.plan.retry_delay_ms, reason=why)


def _stdout_fd() -> int | None:
    try:
        return sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):  # closed (>&-): nothing to watch
        return None


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader went away."""
    fd = _stdout_fd()
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, 0)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _start(command: str, d: Delivery) -> subprocess.Popen[bytes]:
    """Run ``command`` by the shell with the payload on stdin and the message in env (the
    user's environment, not the bundle's: ``environment.for_children``)."""
    env = for_children(os.environ)
    env.update(BLIPMQ_TOPIC=d.topic, BLIPMQ_OFFSET=str(d.offset), BLIPMQ_QOS=str(d.qos),
               BLIPMQ_DELIVERY_COUNT=str(d.delivery_count))
    if d.key is not None:
        env["BLIPMQ_KEY"] = os.fsdecode(d.key)
    if len(d.payload) <= _PIPE_PAYLOAD:  # fits a pipe's buffer: never blocks us
        proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE, env=env,
                                process_group=0)
        assert proc.stdin is not None
        try:
            proc.stdin.write(d.payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the command did not read its stdin: its exit status still counts
        return proc
    with tempfile.TemporaryFile() as f:
        f.write(d.payload)
        f.seek(0)
        return subprocess.Popen(["/bin/sh", "-c", command], stdin=f, env=env, process_group=0)


class _ChildSignal:
    """A pipe that becomes readable when a child exits (SIGCHLD), to wake the wait for
    deliveries."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        self._old = signal.signal(signal.SIGCHLD, lambda *_: None)

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None) -> None:
        select.select([self.fd], [], [], timeout)

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.fd)
        os.close(self._w)


def run(plan: Plan, addr: str | None, api_key: str | None) -> int:
    return _Run(plan, addr, api_key).run()

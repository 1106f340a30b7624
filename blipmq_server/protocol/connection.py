"""The client's side of one BlipMQ connection, sans-IO (docs/PROTOCOL.md, "The client's side").

``ClientConnection`` owns what a client has to remember about its connection to a broker:

- the handshake (HELLO -> WELCOME -> AUTH -> AUTH_OK) and the limits WELCOME announces;
- request ids, and which reply (WELCOME, AUTH_OK, SUBSCRIBED, UNSUBSCRIBED, PONG,
  STATS_REPORT) or ERROR
  answers which request;
- PUBLISH batching: message records sealed into frames within ``max_frame`` and
  ``MAX_BATCH``, the frames still waiting for their PUB_ACK, the QoS 1 messages confirmed;
- a ticket for each QoS 1 message, and its outcome (confirmed, refused, still open), which
  survives a reconnect: ``resume`` carries the unconfirmed QoS 1 messages, the messages not
  yet sent and the ones published while the connection was down over to a new connection;
- DELIVER batches, queued per subscription, and the credit window asked for each;
- what both clients decide alike about reconnecting: the backoff (``Reconnect``) and where
  a subscription starts again (``restart_point``, a ``Gap`` when it may have missed some);
- refusals: ERROR frames that answer no waiting request, kept until the caller asks;
- why the connection closed (GOODBYE, end of stream, malformed bytes, silence, a write of
  ours cut off part-way);
- the PONG that answers a PING from the broker, and the keepalive decision.

Bytes come in through ``receive_data`` and go out through ``data_to_send``; time comes in as
an argument (``now``: seconds on any monotonic clock). Normal conditions are values: a reply,
a refusal (an ``Error`` frame), a ``Closed`` reason. Exceptions are for input we refuse:
``RemoteProtocolError`` when the broker's bytes break the protocol (the connection is then
closed), ``LocalProtocolError`` when the caller asks for something the connection cannot send
(its ``code`` is the ErrorCode the broker would have answered, where there is one).

No I/O, no clock, no threads. Imports only the standard library and the codec, so the socket
client (``blipmq_cli/client.py``) is a thin shell and a one-shot ``blipmq pub`` starts fast.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import NamedTuple

from blipmq_server.errors import (
    BlipError,
    BrokerError,
    ConnectError,
    LocalProtocolError,
    RemoteProtocolError,
)
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import (
    FLAG_QOS1,
    MSG_HEAD,
    Delivery,
    ErrorCode,
    FrameType,
    Message,
)
from blipmq_server.protocol.names import WIRE_TOPIC_BYTES, topic_problem

PUBLISH_OVERHEAD = 7  # a PUBLISH frame's length beyond its records: type, request id, count
_TOPIC_CACHE = 4096  # validated topics remembered (a publisher rarely uses more)
_REFUSED_KEPT = 4096  # refused tickets remembered for ``outcome``
_REPLIES = (codec.Welcome, codec.AuthOk, codec.Subscribed, codec.Unsubscribed, codec.Pong,
            codec.StatsReport)


class State(Enum):
    NEW = "new"  # nothing sent yet
    GREETING = "greeting"  # HELLO and AUTH sent, waiting for WELCOME
    AUTHENTICATING = "authenticating"  # WELCOME came, waiting for AUTH_OK
    READY = "ready"
    CLOSED = "closed"


class CloseReason(Enum):
    GOODBYE = "goodbye"  # the broker sent GOODBYE (its code and text are in Closed)
    EOF = "eof"  # the broker ended the stream without a GOODBYE
    MALFORMED = "malformed"  # the broker sent bytes that break the protocol
    SILENT = "silent"  # nothing from the broker for two keepalive intervals
    LOCAL = "local"  # we sent GOODBYE
    BROKEN = "broken"  # our side broke the stream off: a write stopped part-way (break_off)


class Closed(NamedTuple):
    """Why the connection is over."""

    reason: CloseReason
    code: int = 0  # GOODBYE: the broker's code; MALFORMED: the code to blame it on
    text: str = ""

    @property
    def ends_streams(self) -> bool:
        """The broker stopped on purpose: subscriptions end rather than fail."""
        return self.reason is CloseReason.GOODBYE and self.code in (
            ErrorCode.SHUTTING_DOWN, ErrorCode.NORMAL
        )


# Reconnect and Gap are plain slotted classes, not NamedTuples or dataclasses: this module
# is imported by every one-shot `blipmq pub`, and defining either costs ~0.2 ms.


class Reconnect:
    """How a client dials again: ``attempts`` in a row (each address tried counts as one)
    before it gives up; before attempt n (from 0) a wait of ``min(maximum, initial * 2**n)``
    seconds, less a random part of up to ``jitter`` of it (so that many clients of a
    restarted broker do not all come back at once). With ``within`` (seconds), it also gives
    up once the waits add up to that: the last wait is what is left of it, so the attempts
    cover the whole window (the CLI's ``--reconnect-for``)."""

    __slots__ = ("attempts", "initial", "jitter", "maximum", "within")

    def __init__(self, attempts: int = 60, initial: float = 0.1, maximum: float = 5.0,
                 jitter: float = 0.5, within: float | None = None) -> None:
        if attempts < 1 or initial <= 0 or maximum < initial or not 0 <= jitter <= 1:
            raise ValueError("Reconnect needs attempts >= 1, 0 < initial <= maximum and "
                             "0 <= jitter <= 1")
        if within is not None and not within > 0:
            raise ValueError("Reconnect's within is a positive number of seconds, or None")
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self.within = within

    def delay(self, attempt: int, draw: float) -> float:
        """The wait before ``attempt``; ``draw`` is uniform in [0, 1)."""
        base = min(self.maximum, self.initial * 2 ** min(attempt, 32))
        return base * (1 - self.jitter * draw)

    def waits(self, draw: Callable[[], float]) -> Iterator[float]:
        """The waits before each attempt, in turn, until the policy gives up; ``draw()`` is
        uniform in [0, 1)."""
        spent = 0.0
        for attempt in range(self.attempts):
            wait = self.delay(attempt, draw())
            if self.within is not None:
                if spent >= self.within:
                    return
                wait = min(wait, self.within - spent)
            spent += wait
            yield wait

    def __repr__(self) -> str:
        return (f"Reconnect(attempts={self.attempts}, initial={self.initial}, "
                f"maximum={self.maximum}, jitter={self.jitter}, within={self.within})")


class Gap:
    """A subscription restored after a lost connection at the log's end (no group, start
    LATEST; or a QoS 0 group, whose queue lives in the broker's memory): messages that
    matched it after ``last_offset`` (None: it had delivered nothing) and before it was
    restored may be missing. Replay them with ``start=Start.OFFSET, start_offset=
    last_offset + 1``."""

    __slots__ = ("group", "last_offset", "topic_filter")

    def __init__(self, topic_filter: str, group: str, last_offset: int | None) -> None:
        self.topic_filter = topic_filter
        self.group = group
        self.last_offset = last_offset

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Gap) and (
            (self.topic_filter, self.group, self.last_offset)
            == (other.topic_filter, other.group, other.last_offset))

    def __hash__(self) -> int:
        return hash((self.topic_filter, self.group, self.last_offset))

    def __repr__(self) -> str:
        return (f"Gap(topic_filter={self.topic_filter!r}, group={self.group!r}, "
                f"last_offset={self.last_offset!r})")


def restart_point(
    group: str, qos: int, start: int, start_offset: int, last_offset: int | None
) -> tuple[int, int, bool]:
    """Where a subscription starts again on a new connection: (start, start_offset, whether
    it may have missed messages). A durable group resumes at its cursor whatever it asks; a
    replaying subscription goes on after the last offset it delivered; a live one starts at
    the log's end, with a gap."""
    if group and qos:
        return start, start_offset, False
    if start != codec.Start.LATEST:
        if last_offset is None:
            return start, start_offset, False
        return codec.Start.OFFSET, last_offset + 1, False
    return codec.Start.LATEST, 0, True


# The two private records below are plain slotted classes: a NamedTuple costs several times as
# much to define, and this module is imported by every one-shot `blipmq pub`.


def _payload_bytes(batch: tuple[Delivery, ...]) -> int:
    """The payload bytes of a DELIVER batch (what ``queued_bytes`` counts)."""
    return sum(len(d.payload) for d in batch)


class _Request:
    """A request waiting for its reply."""

    __slots__ = ("expect", "frame", "keep")

    def __init__(self, expect: type, frame: codec.Frame | None = None, keep: bool = True) -> None:
        self.expect = expect  # the reply frame's class
        self.frame = frame  # SUBSCRIBE / UNSUBSCRIBE: what the reply refers to
        self.keep = keep  # False: nobody waits any more (keepalive PING, a request given up)


class _Sub:
    """A live subscription and its queued DELIVER batches."""

    __slots__ = ("batches", "credit", "group", "request_id", "topic_filter")

    def __init__(self, topic_filter: str, group: str, request_id: int, credit: int) -> None:
        self.topic_filter = topic_filter
        self.group = group
        self.request_id = request_id  # of its SUBSCRIBE: a GROUP_DELETED error carries it
        self.credit = credit  # the window last asked for (0: the broker's default)
        self.batches: deque[tuple[Delivery, ...]] = deque()


class _Batch:
    """The QoS 1 messages of a PUBLISH frame waiting for its PUB_ACK: their tickets and
    records (kept to be sent again on a new connection if the PUB_ACK never comes)."""

    __slots__ = ("records", "size", "tickets")

    def __init__(self, tickets: list[int], records: list[bytes], size: int) -> None:
        self.tickets = tickets
        self.records = records
        self.size = size


class ClientConnection:
    """One client connection's protocol state. See the module docstring."""

    def __init__(self, max_frame: int = codec.DEFAULT_MAX_FRAME) -> None:
        self.state = State.NEW
        self.closed: Closed | None = None
        self.welcome: codec.Welcome | None = None
        # until WELCOME says otherwise: the codec's default limit
        self.max_frame = max_frame
        self.max_message = max_frame - PUBLISH_OVERHEAD - MSG_HEAD.size
        self.qos1_sent = 0  # QoS 1 messages sealed into PUBLISH frames
        self.confirmed = 0  # QoS 1 messages the broker confirmed as durable
        self._decoder = codec.Decoder(max_frame)
        self._rid = 0
        self._pending: dict[int, _Request] = {}
        self._replies: dict[int, codec.Frame] = {}
        self._refusals: deque[codec.Error] = deque()
        self._handshake = (0, 0)  # request ids of HELLO and AUTH
        self._handshake_error: codec.Error | None = None
        self._authenticated = False  # AUTH_OK came (the connection may have closed since)
        self._subs: dict[int, _Sub] = {}
        self._awaiting: dict[int, _Batch] = {}  # PUBLISH request id -> its QoS 1 messages
        self._awaiting_size = 0  # record bytes in _awaiting
        self._awaiting_count = 0  # messages in _awaiting
        self._ticket = 0  # the last ticket given to a QoS 1 message
        self._tickets: list[int] = []  # tickets of the QoS 1 records in _records, in order
        self._open: set[int] = set()  # tickets neither confirmed nor refused yet
        self._refused: dict[int, None] = {}  # tickets refused, until ``outcome`` reports them
        self.queued = 0  # delivered messages queued here, not yet taken by ``next_batch``
        self.queued_bytes = 0  # the payload bytes of those messages
        self._out: list[bytes] = []  # encoded frames, in order
        self._out_size = 0
        self._records: list[bytes] = []  # message records not yet sealed into a PUBLISH
        self._records_size = 0
        self._records_qos1 = 0
        self._room = max_frame - PUBLISH_OVERHEAD  # record bytes one PUBLISH can carry
        self._topics: dict[str, bytes] = {}
        self._at_close: list[bytes] = []  # frames that go out just before our GOODBYE
        self._heard: float | None = None  # when bytes last came from the broker
        self._probe: float | None = None  # when the unanswered keepalive PING went out
        self._deaf = False  # broken bytes came after our GOODBYE: nothing more is read

    # ----------------------------------------------------------------------------- output

    def data_to_send(self) -> bytes:
        """Every byte queued for the broker, in order (sealing the open PUBLISH first)."""
        self.seal()
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out, self._out_size = [], 0
        return data

    @property
    def outgoing(self) -> int:
        """Bytes of sealed frames waiting in ``data_to_send``."""
        return self._out_size

    def _queue(self, data: bytes) -> None:
        self.seal()  # records gathered before this frame go out before it
        self._out.append(data)
        self._out_size += len(data)

    def _next_rid(self) -> int:
        self._rid = (self._rid + 1) & 0xFFFFFFFF or 1
        return self._rid

    # -------------------------------------------------------------------------- handshake

    def hello(self, client: str = "", api_key: str = "") -> None:
        """Queue HELLO and AUTH together (the broker allows pipelining them)."""
        if self.state is not State.NEW:
            raise LocalProtocolError(f"HELLO again (the connection is {self.state.value})")
        hello, auth = self._next_rid(), self._next_rid()
        self._pending[hello] = _Request(codec.Welcome)
        self._pending[auth] = _Request(codec.AuthOk)
        self._handshake = (hello, auth)
        self._queue(codec.encode(codec.Hello(codec.VERSION, client, hello))
                    + codec.encode(codec.Auth(api_key, auth)))
        self.state = State.GREETING

    def handshake(self) -> codec.Welcome | codec.Error | None:
        """The handshake's outcome: WELCOME once AUTH_OK came, the ERROR that refused HELLO or
        AUTH, or None while it is still under way."""
        if self._handshake_error is not None:
            return self._handshake_error
        return self.welcome if self._authenticated else None

    # --------------------------------------------------------------------------- requests

    def _request(self, frame: codec.Frame, expect: type) -> int:
        if self.state is not State.READY:
            raise LocalProtocolError(
                f"cannot send {FrameType(frame.TYPE).name}: the connection is {self.state.value}"
            )
        rid = self._next_rid()
        frame = frame._replace(request_id=rid)
        self._pending[rid] = _Request(expect, frame)
        self._queue(codec.encode(frame))
        return rid

    def subscribe(
        self,
        topic_filter: str,
        group: str = "",
        qos: int = 0,
        credit: int = 0,
        start: int = codec.Start.LATEST,
        start_offset: int = 0,
        flags: int = 0,
    ) -> int:
        """Queue a SUBSCRIBE; returns its request id (``reply`` gives SUBSCRIBED or ERROR)."""
        frame = codec.Subscribe(topic_filter, group, qos, credit, start, start_offset, 0, flags)
        return self._request(frame, codec.Subscribed)

    def unsubscribe(self, sub_id: int = 0, topic_filter: str = "", group: str = "") -> int:
        """Queue an UNSUBSCRIBE (by ``sub_id``, or by filter and group); returns its id."""
        return self._request(codec.Unsubscribe(sub_id, topic_filter, group), codec.Unsubscribed)

    def ping(self, data: bytes = b"") -> int:
        """Queue a PING; its PONG proves the broker processed every frame sent before it."""
        return self._request(codec.Ping(data), codec.Pong)

    def stats(self) -> int:
        """Queue a STATS request; its reply is a STATS_REPORT (a JSON object)."""
        return self._request(codec.Stats(), codec.StatsReport)

    def reply(self, request_id: int) -> codec.Frame | None:
        """The reply to a request (its ERROR if refused), once; None while none came."""
        return self._replies.pop(request_id, None)

    def forget(self, request_id: int) -> None:
        """Stop waiting for a request: its reply, when it comes, is dropped. A subscription
        it made (SUBSCRIBED came, or comes later) is ended: nobody would take its
        deliveries."""
        request = self._pending.get(request_id)
        if request is not None:
            request.keep = False
        reply = self._replies.pop(request_id, None)
        if isinstance(reply, codec.Subscribed) and reply.sub_id in self._subs:
            self._drop(reply.sub_id)
            self._unwanted(reply.sub_id)

    def _unwanted(self, sub_id: int) -> None:
        """End subscription ``sub_id``, which nobody waits for (its reply not awaited)."""
        if self.state is State.READY:
            rid = self._request(codec.Unsubscribe(sub_id, "", ""), codec.Unsubscribed)
            self._pending[rid].keep = False

    def refusal(self) -> codec.Error | None:
        """The oldest ERROR that answered no waiting request (a refused PUBLISH, a deleted
        group, a broker-wide complaint), once; None when there is none."""
        return self._refusals.popleft() if self._refusals else None

    @property
    def unreported(self) -> int:
        """Refusals that ``refusal`` has not handed out yet."""
        return len(self._refusals)

    # --------------------------------------------------------------------------- no reply

    def ack(self, sub_id: int, offsets: tuple[int, ...]) -> None:
        self._queue(codec.encode(codec.Ack(sub_id, offsets)))

    def nack(
        self, sub_id: int, offsets: tuple[int, ...], delay_ms: int = 0, reason: str = ""
    ) -> None:
        self._queue(codec.encode(codec.Nack(sub_id, offsets, delay_ms, 0, reason)))

    def credit(self, sub_id: int, credit: int) -> None:
        """Queue a CREDIT: the subscription's new window of unacked deliveries (QoS 1)."""
        sub = self._subs.get(sub_id)
        if sub is not None:
            sub.credit = credit
        self._queue(codec.encode(codec.Credit(sub_id, credit)))

    def credit_of(self, sub_id: int) -> int:
        """The window last asked for a subscription (0: the broker's
        ``delivery.default_credit``)."""
        sub = self._subs.get(sub_id)
        return 0 if sub is None else sub.credit

    def ack_at_close(self, sub_id: int, offsets: tuple[int, ...]) -> None:
        """Hold CREDIT 0 and this ACK until ``goodbye``: the broker then sends nothing that
        would go back to the group counted once more."""
        self._at_close.append(codec.encode(codec.Credit(sub_id, 0)))
        self._at_close.append(codec.encode(codec.Ack(sub_id, offsets)))

    def goodbye(self, code: int = ErrorCode.NORMAL, text: str = "") -> None:
        """Queue the held frames and GOODBYE; the connection is closed from here on."""
        for data in self._at_close:
            self._queue(data)
        self._at_close = []
        self._queue(codec.encode(codec.Goodbye(code, text)))
        self._close(Closed(CloseReason.LOCAL, code, text))

    # ------------------------------------------------------------------------- publishing

    def publish(self, msg: Message) -> int:
        """Add one message to the open PUBLISH batch (sealed when the next would not fit);
        returns the QoS 1 message's ticket (``outcome``), 0 for QoS 0.

        Raises LocalProtocolError with MESSAGE_TOO_LARGE, INVALID_TOPIC or FRAME_TOO_LARGE
        for a message the broker would refuse; nothing is added then. On a closed
        connection the message is held (``backlog``) for ``resume`` to take over.
        """
        payload = msg.payload
        if len(payload) > self.max_message:
            raise self._too_large(len(payload))
        topic = self._topics.get(msg.topic)
        if topic is None:
            topic = self._topic_bytes(msg.topic)
        if msg.key is None and msg.qos == 0 and msg.ttl_ms == 0 and not msg.retain:
            record = MSG_HEAD.pack(0, 0, len(topic), 0, len(payload)) + topic + payload
        else:
            record = codec.message_record(msg, topic)
        return self._add(record, msg.qos)

    def publish_record(self, record: bytes, payload_len: int) -> int:
        """``publish`` of a message already in the record layout (``protocol/message.py``),
        as a bridge forwards it from its log: its flags byte says QoS 1, key and retain and
        may set nothing else; its topic is not checked again (the upstream refuses one it
        does not take, with an ERROR). Returns the ticket (0 at QoS 0)."""
        if payload_len > self.max_message:
            raise self._too_large(payload_len)
        if record[0] & ~codec.FLAGS_PUBLISHABLE:
            raise LocalProtocolError(f"record flags {record[0]:#04x} may not be published")
        return self._add(record, record[0] & FLAG_QOS1)

    def _add(self, record: bytes, qos: int, ticket: int = 0) -> int:
        """Add an encoded record to the open batch; a QoS 1 one keeps ``ticket`` (carried
        over from another connection) or gets a new one, which is returned."""
        size = len(record)
        if size > self._room:
            raise self._too_big(size)
        if self._records and (
            self._records_size + size > self._room or len(self._records) >= codec.MAX_BATCH
        ):
            self.seal()
        self._records.append(record)
        self._records_size += size
        if qos:
            self._records_qos1 += 1
            if not ticket:
                ticket = self._ticket = self._ticket + 1
                self._open.add(ticket)
            self._tickets.append(ticket)
            return ticket
        return 0

    def publish_pairs(self, pairs: Iterable[tuple[str, bytes]]) -> int:
        """``publish`` of plain QoS 0 messages (no key, TTL or retain) given as (topic,
        payload) pairs, in one loop; returns how many were added. A refused pair raises as
        ``publish`` does, and the pairs before it stay added."""
        topics = self._topics
        pack = MSG_HEAD.pack
        limit, room, most = self.max_message, self._room, codec.MAX_BATCH
        records, gathered = self._records, self._records_size
        n = 0
        try:
            for name, payload in pairs:
                topic = topics.get(name)
                if topic is None:
                    topic = self._topic_bytes(name)
                plen = len(payload)
                if plen > limit:
                    raise self._too_large(plen)
                record = pack(0, 0, len(topic), 0, plen) + topic + payload
                size = len(record)
                if size > room:
                    raise self._too_big(size)
                if records and (gathered + size > room or len(records) >= most):
                    self._records_size = gathered
                    self.seal()
                    records, gathered = self._records, self._records_size
                records.append(record)
                gathered += size
                n += 1
        finally:
            self._records_size = gathered
        return n

    def _too_large(self, size: int) -> LocalProtocolError:
        return LocalProtocolError(
            f"message of {size} bytes exceeds the broker's limit of {self.max_message} bytes",
            ErrorCode.MESSAGE_TOO_LARGE,
        )

    def _too_big(self, size: int) -> LocalProtocolError:
        return LocalProtocolError(
            f"message of {size} bytes with its topic and key does not fit the broker's "
            f"frame limit of {self.max_frame} bytes",
            ErrorCode.FRAME_TOO_LARGE,
        )

    def _topic_bytes(self, topic: str) -> bytes:
        problem = topic_problem(topic, WIRE_TOPIC_BYTES)  # the broker's cap is its own
        if problem:
            raise LocalProtocolError(problem, ErrorCode.INVALID_TOPIC)
        if len(self._topics) >= _TOPIC_CACHE:
            self._topics.clear()
        data = self._topics[topic] = topic.encode("utf-8")
        return data

    def seal(self) -> None:
        """Close the open batch into one PUBLISH frame, queued for sending (on a closed
        connection the batch stays open, held for ``resume``)."""
        records = self._records
        if not records or self.closed is not None:
            return
        rid = self._next_rid()
        frame = codec.encode_publish(records, rid)
        self._out.append(frame)
        self._out_size += len(frame)
        qos1 = self._records_qos1
        if qos1:
            if qos1 != len(records):
                records = [r for r in records if r[0] & FLAG_QOS1]
            size = sum(map(len, records))
            self._awaiting[rid] = _Batch(self._tickets, records, size)
            self._awaiting_size += size
            self._awaiting_count += qos1
            self._tickets = []
            self.qos1_sent += qos1
            self._records_qos1 = 0
        self._records, self._records_size = [], 0

    def outcome(self, ticket: int) -> bool | None:
        """What became of a QoS 1 message (its ticket from ``publish``): True once the broker
        confirmed it durable, False if it refused it (once: the refusal itself comes from
        ``refusal``), None while neither came."""
        if ticket in self._open:
            return None
        return self._refused.pop(ticket, True) is not None

    @property
    def backlog(self) -> tuple[int, int]:
        """Messages (and their record bytes) the broker has not taken for good: the open
        batch, and QoS 1 messages not confirmed yet. On a closed connection that is what
        ``resume`` sends again."""
        return (len(self._records) + self._awaiting_count,
                self._records_size + self._awaiting_size)

    def resume(self, old: ClientConnection) -> int:
        """Take over what ``old`` (closed) had not delivered for good: its QoS 1 messages
        still unconfirmed (sent again: the broker may have stored them already, so a
        consumer can see them twice), then its open batch and what was published while it
        was down, in their order; returns how many messages. Call once this connection is
        ready. The tickets stay valid: ``outcome`` answers for them here."""
        if self.state is not State.READY or old.closed is None:
            raise LocalProtocolError("resume takes a closed connection over to a ready one")
        old.seal()  # a no-op: it is closed
        self._ticket = old._ticket
        self._open = old._open
        self._refused = old._refused
        n = 0
        for batch in old._awaiting.values():
            for record, ticket in zip(batch.records, batch.tickets, strict=True):
                self._carry(record, ticket)
            n += len(batch.records)
        old._awaiting.clear()
        old._awaiting_count = old._awaiting_size = 0
        tickets = iter(old._tickets)
        for record in old._records:
            self._carry(record, next(tickets) if record[0] & FLAG_QOS1 else 0)
        n += len(old._records)
        old._records, old._records_size, old._tickets = [], 0, []
        return n

    def _carry(self, record: bytes, ticket: int) -> None:
        """Add an encoded record (from another connection) to the open batch, with its
        ticket (0: QoS 0)."""
        size = len(record)
        if size > self._room:  # this broker's frames are smaller: refused as it would
            if ticket:
                self._open.discard(ticket)
                self._refused[ticket] = None
            self._refusals.append(codec.Error(ErrorCode.FRAME_TOO_LARGE, str(self._too_big(size))))
            return
        self._add(record, ticket, ticket)

    @property
    def unconfirmed(self) -> int:
        """PUBLISH frames with QoS 1 messages whose PUB_ACK has not come yet."""
        return len(self._awaiting)

    # ---------------------------------------------------------------------- subscriptions

    def next_batch(self, sub_id: int) -> tuple[Delivery, ...] | None:
        """The oldest DELIVER batch queued for a subscription, once; None when none is."""
        sub = self._subs.get(sub_id)
        if sub is None or not sub.batches:
            return None
        batch = sub.batches.popleft()
        self.queued -= len(batch)
        self.queued_bytes -= _payload_bytes(batch)
        return batch

    def subscribed(self, sub_id: int) -> bool:
        """Whether the subscription is live on this connection (not ended by UNSUBSCRIBE or
        by its group's deletion)."""
        return sub_id in self._subs

    # ------------------------------------------------------------------------------ input

    def receive_data(self, data: bytes, now: float) -> None:
        """Take bytes from the broker; ``b""`` means the broker ended the stream.

        Raises RemoteProtocolError (and closes the connection) on bytes that break the
        protocol, after handling the whole frames before them. Ignored once closed, but
        for the PUB_ACKs and ERRORs that come after our GOODBYE (``_after_goodbye``).
        """
        if self.closed is not None:
            if data and self.closed.reason is CloseReason.LOCAL and not self._deaf:
                self._after_goodbye(data)
            return
        if not data:
            self._close(Closed(CloseReason.EOF))
            return
        self._heard, self._probe = now, None
        decoder = self._decoder
        decoder.feed(data)
        try:
            # a second call raises the error the decoder held back behind whole frames
            for _ in range(2):
                frames = decoder.frames()
                if not frames:
                    break
                for frame in frames:
                    self._handle(frame)
                    if self.closed is not None:
                        return  # GOODBYE: nothing after it counts
        except RemoteProtocolError as exc:
            self._close(Closed(CloseReason.MALFORMED, exc.code, str(exc)))
            raise

    def _after_goodbye(self, data: bytes) -> None:
        """Bytes after our GOODBYE: the broker handles what we sent before it, so the
        PUB_ACKs (and refusals) of our last PUBLISH frames still count (``backlog`` then
        holds only what it did not take); anything else, and bytes that break the
        protocol, are dropped, the connection being over."""
        decoder = self._decoder
        decoder.feed(data)
        try:
            for _ in range(2):  # the second raises an error held back behind frames
                for frame in decoder.frames():
                    if type(frame) is codec.PubAck:
                        self._confirm(frame)
                    elif type(frame) is codec.Error:
                        self._error(frame)
        except RemoteProtocolError:
            self._deaf = True  # nothing after broken bytes can be trusted

    def _handle(self, frame: codec.Frame) -> None:
        kind = type(frame)
        if kind is codec.Deliver:
            sub = self._subs.get(frame.sub_id)
            if sub is not None:  # late deliveries of an ended one: dropped
                # an empty batch is the end mark of a SUBSCRIBE_UNTIL_END: queued in order
                sub.batches.append(frame.messages)
                self.queued += len(frame.messages)
                self.queued_bytes += _payload_bytes(frame.messages)
        elif kind is codec.PubAck:
            self._confirm(frame)
        elif kind is codec.Ping:
            # answered at once, ahead of any open batch: a PONG needs no order
            pong = codec.encode(codec.Pong(frame.data, frame.request_id))
            self._out.append(pong)
            self._out_size += len(pong)
        elif kind is codec.Error:
            self._error(frame)
        elif kind is codec.Goodbye:
            self._close(Closed(CloseReason.GOODBYE, frame.code, frame.text))
        elif kind in _REPLIES:
            self._reply(frame)
        else:
            raise RemoteProtocolError(
                f"the broker sent {FrameType(frame.TYPE).name}, a frame only clients send"
            )

    def _confirm(self, frame: codec.PubAck) -> None:
        batch = self._awaiting.pop(frame.request_id, None)
        if batch is None:
            raise RemoteProtocolError(
                f"PUB_ACK for request {frame.request_id}, which has no QoS 1 message waiting"
            )
        tickets = batch.tickets
        count = frame.count
        self._awaiting_size -= batch.size
        self._awaiting_count -= len(tickets)
        if count > len(tickets):
            raise RemoteProtocolError(
                f"PUB_ACK confirms {count} messages of a PUBLISH that had {len(tickets)}"
            )
        self.confirmed += count
        opened = self._open
        for ticket in tickets[:count]:
            opened.discard(ticket)
        # the first ``count`` are stored; an ERROR came for the rest (docs/PROTOCOL.md)
        for ticket in tickets[count:]:
            opened.discard(ticket)
            self._refused[ticket] = None
        if len(self._refused) > _REFUSED_KEPT:  # nobody asks about them: forget the oldest
            del self._refused[next(iter(self._refused))]

    def _reply(self, frame: codec.Frame) -> None:
        rid = frame.request_id
        request = self._pending.pop(rid, None)
        name = FrameType(frame.TYPE).name
        if request is None:
            raise RemoteProtocolError(f"{name} for request {rid}, which waits for no reply")
        if type(frame) is not request.expect:
            expected = FrameType(request.expect.TYPE).name
            raise RemoteProtocolError(f"{name} for request {rid}, which waits for {expected}")
        kind = type(frame)
        if kind is codec.Welcome:
            self._welcomed(frame)
        elif kind is codec.AuthOk:
            if self.state is not State.AUTHENTICATING:
                raise RemoteProtocolError("AUTH_OK before WELCOME")
            self.state = State.READY
            self._authenticated = True
        elif kind is codec.Subscribed:
            sub = request.frame
            if request.keep and isinstance(sub, codec.Subscribe):
                self._subs[frame.sub_id] = _Sub(sub.topic_filter, sub.group, rid, sub.credit)
            else:  # nobody waits for it any more (given up, cancelled): the broker made it
                # all the same; ended, or it holds deliveries (a group's credit) nobody takes
                self._unwanted(frame.sub_id)
        elif kind is codec.Unsubscribed and isinstance(request.frame, codec.Unsubscribe):
            self._ended(request.frame)
        if request.keep and kind is not codec.Welcome and kind is not codec.AuthOk:
            self._replies[rid] = frame

    def _welcomed(self, frame: codec.Welcome) -> None:
        if frame.version != codec.VERSION:
            raise RemoteProtocolError(
                f"the broker speaks protocol version {frame.version}, this client "
                f"{codec.VERSION}",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        if frame.max_frame < codec.HEADER_SIZE + PUBLISH_OVERHEAD + MSG_HEAD.size:
            raise RemoteProtocolError(f"WELCOME announces a frame limit of {frame.max_frame}")
        self.welcome = frame
        self.max_frame = frame.max_frame
        self.max_message = frame.max_message
        self._decoder.max_frame = frame.max_frame  # exactly what the broker sends at most
        self._room = frame.max_frame - PUBLISH_OVERHEAD
        self.state = State.AUTHENTICATING

    def _ended(self, request: codec.Unsubscribe) -> None:
        """Forget the subscriptions an UNSUBSCRIBED reply ended (docs/PROTOCOL.md)."""
        if request.sub_id:
            self._drop(request.sub_id)
            return
        for sub_id, sub in list(self._subs.items()):
            if sub.topic_filter == request.topic_filter and sub.group == request.group:
                self._drop(sub_id)

    def _drop(self, sub_id: int) -> None:
        sub = self._subs.pop(sub_id, None)
        if sub is not None:
            self.queued -= sum(map(len, sub.batches))
            self.queued_bytes -= sum(map(_payload_bytes, sub.batches))

    def _error(self, frame: codec.Error) -> None:
        rid = frame.request_id
        request = self._pending.pop(rid, None) if rid else None
        if request is not None:
            if rid in self._handshake:
                self._handshake_error = frame
            elif request.keep:
                self._replies[rid] = frame
            return
        if frame.code == ErrorCode.GROUP_DELETED and rid:
            for sub_id, sub in list(self._subs.items()):
                if sub.request_id == rid:
                    self._drop(sub_id)
        self._refusals.append(frame)

    def failure(self, addr: str, silence: float) -> BlipError:
        """The exception that says why this connection is over, for a person: the refusal
        that explains an end of stream or a GOODBYE, the GOODBYE, a malformed frame, silence
        (``silence``: the seconds the keepalive waited)."""
        closed = self.closed or Closed(CloseReason.EOF)
        reason = closed.reason
        if reason is CloseReason.MALFORMED:
            return ConnectError(f"the broker at {addr} sent a malformed frame: {closed.text}")
        if reason is CloseReason.SILENT:
            return ConnectError(f"no answer from the broker at {addr} for {silence:g} s")
        if reason is CloseReason.BROKEN:
            return ConnectError(f"the connection to {addr} broke off: {closed.text}")
        refusal = self.refusal()
        if refusal is not None:
            return BrokerError(refusal.code, refusal.text)
        if reason is CloseReason.GOODBYE:
            return BrokerError(closed.code, closed.text or "the broker said goodbye")
        if reason is CloseReason.LOCAL:
            return ConnectError(f"the connection to {addr} is closed")
        return ConnectError(f"the broker at {addr} closed the connection")

    def drop_deliveries(self) -> None:
        """Forget the deliveries queued and not taken (a client closing will never take
        them; a group's go back to it unacked when the connection ends)."""
        for sub in self._subs.values():
            sub.batches.clear()
        self.queued = self.queued_bytes = 0

    def break_off(self, why: str) -> None:
        """The stream is unusable from our side: a write of ``data_to_send``'s bytes stopped
        part-way (interrupted, or the broker took nothing for too long), so what follows
        would be read as the rest of a cut frame. Closes the connection (``BROKEN``); what
        the broker had not confirmed is kept for ``resume``."""
        self._close(Closed(CloseReason.BROKEN, 0, why))

    def _close(self, closed: Closed) -> None:
        if self.closed is None:
            self.closed = closed
            self.state = State.CLOSED

    # -------------------------------------------------------------------------- keepalive

    @property
    def probing(self) -> bool:
        """A keepalive PING is out with nothing heard from the broker since (``tick``)."""
        return self._probe is not None

    def heard_since(self, when: float) -> bool:
        """Whether anything came from the broker at ``when`` or later."""
        return self._heard is not None and self._heard >= when

    def probe(self, now: float) -> None:
        """Queue the keepalive PING now, unless one is out: ``tick`` then closes the
        connection as SILENT when nothing comes within its interval."""
        if self._probe is None and self.state is State.READY:
            self._probe = now
            rid = self._next_rid()
            self._pending[rid] = _Request(codec.Pong, keep=False)
            self._queue(codec.encode(codec.Ping(b"", rid)))

    def tick(self, now: float, interval: float) -> float:
        """Keepalive, for a caller waiting on the broker: after ``interval`` seconds with
        nothing from the broker, queue a PING; if nothing at all comes for another
        ``interval``, close the connection as SILENT. Any byte from the broker counts.

        Returns how many seconds may pass before the next call is due.
        """
        if self.state is not State.READY:
            return interval
        if self._heard is None:
            self._heard = now
        if self._probe is None:
            quiet = now - self._heard
            if quiet < interval:
                return interval - quiet
            self._probe = now
            rid = self._next_rid()
            self._pending[rid] = _Request(codec.Pong, keep=False)
            self._queue(codec.encode(codec.Ping(b"", rid)))
            return interval
        waited = now - self._probe
        if waited >= interval:
            self._close(Closed(CloseReason.SILENT, 0,
                               f"nothing from the broker for {now - self._heard:g} s"))
            return 0.0
        return interval - waited

"""The sans-IO client connection: no sockets, no sleeps; time is a number passed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blipmq_server.errors import LocalProtocolError, RemoteProtocolError
from blipmq_server.protocol import codec
from blipmq_server.protocol.codec import (
    MAX_BATCH,
    VERSION,
    AuthOk,
    Deliver,
    Delivery,
    Error,
    ErrorCode,
    Goodbye,
    Message,
    Ping,
    Pong,
    PubAck,
    Subscribed,
    Unsubscribed,
    Welcome,
    encode,
)
from blipmq_server.protocol.connection import (
    PUBLISH_OVERHEAD,
    ClientConnection,
    Closed,
    CloseReason,
    State,
)

# ----------------------------------------------------------------------------- helpers


def sent(conn: ClientConnection) -> list[codec.Frame]:
    """Decode everything the connection wants to send (nothing may be left over)."""
    decoder = codec.Decoder(1 << 30)
    decoder.feed(conn.data_to_send())
    frames = decoder.frames()
    assert decoder.buffered == 0
    return frames


def typed(frames: list[codec.Frame]) -> list[tuple[type, codec.Frame]]:
    """Frames are NamedTuples, equal to any tuple with the same fields: compare types too."""
    return [(type(f), f) for f in frames]


def delivery(offset: int, payload: bytes = b"p", topic: str = "t") -> Delivery:
    return Delivery(offset, 1, topic, payload, 0, 0, None)


def ready(max_frame: int = codec.DEFAULT_MAX_FRAME, max_message: int = 1000) -> ClientConnection:
    """A connection past its handshake, with nothing left to send."""
    conn = ClientConnection()
    conn.hello("test", "key")
    hello, auth = sent(conn)
    conn.receive_data(encode(Welcome(VERSION, max_frame, max_message, "b", hello.request_id))
                      + encode(AuthOk(auth.request_id)), 0.0)
    assert conn.state is State.READY
    return conn


def subscribed(conn: ClientConnection, topic_filter: str = "t", group: str = "") -> int:
    rid = conn.subscribe(topic_filter, group)
    sub_id = 100 + rid
    conn.receive_data(encode(Subscribed(sub_id, rid)), 0.0)
    assert isinstance(conn.reply(rid), Subscribed)
    sent(conn)
    return sub_id


# --------------------------------------------------------------------------- handshake


def test_handshake_pipelines_hello_and_auth_and_adopts_the_welcome_limits() -> None:
    conn = ClientConnection()
    assert conn.state is State.NEW and conn.handshake() is None
    conn.hello("cli", "s3cret")
    hello, auth = sent(conn)
    assert typed([hello, auth]) == typed([codec.Hello(codec.VERSION, "cli", hello.request_id),
                                          codec.Auth("s3cret", auth.request_id)])
    assert hello.request_id != auth.request_id and 0 not in (hello.request_id, auth.request_id)
    assert conn.state is State.GREETING
    welcome = Welcome(VERSION, 5000, 4000, "blipmq", hello.request_id)
    conn.receive_data(encode(welcome), 0.0)
    assert conn.state is State.AUTHENTICATING and conn.handshake() is None
    conn.receive_data(encode(AuthOk(auth.request_id)), 0.0)
    assert conn.state is State.READY
    assert typed([conn.handshake()]) == typed([welcome])
    assert (conn.max_frame, conn.max_message) == (5000, 4000)
    with pytest.raises(LocalProtocolError):
        conn.hello()


def test_the_decoder_limit_is_exactly_the_announced_max_frame() -> None:
    conn = ready(max_frame=4096)
    rid = conn.ping()
    largest = encode(Pong(b"x" * (4096 - 5), rid))  # length field == max_frame
    assert int.from_bytes(largest[:4], "big") == 4096
    conn.receive_data(largest, 0.0)
    assert isinstance(conn.reply(rid), Pong)
    rid = conn.ping()
    with pytest.raises(RemoteProtocolError) as info:
        conn.receive_data(encode(Pong(b"x" * (4096 - 4), rid)), 0.0)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert conn.closed is not None and conn.closed.reason is CloseReason.MALFORMED
    assert "4096" in conn.closed.text


@pytest.mark.parametrize("which", [0, 1])
def test_an_error_for_hello_or_auth_is_the_handshake_outcome(which: int) -> None:
    conn = ClientConnection()
    conn.hello()
    rids = [f.request_id for f in sent(conn)]
    refusal = Error(ErrorCode.AUTH_FAILED, "API key refused", rids[which])
    if which:
        conn.receive_data(encode(Welcome(VERSION, 1 << 20, 1000, "", rids[0])), 0.0)
    conn.receive_data(encode(refusal), 0.0)
    assert typed([conn.handshake()]) == typed([refusal])
    assert conn.refusal() is None
    conn.receive_data(b"", 0.0)
    assert conn.closed == Closed(CloseReason.EOF)


def test_an_error_without_request_id_during_the_handshake_explains_the_close() -> None:
    conn = ClientConnection()
    conn.hello()
    sent(conn)
    full = Error(ErrorCode.TOO_MANY_CONNECTIONS, "max_connections reached")
    conn.receive_data(encode(full), 0.0)
    conn.receive_data(b"", 0.0)
    assert conn.handshake() is None
    assert conn.closed is not None and conn.closed.reason is CloseReason.EOF
    assert conn.unreported == 1 and typed([conn.refusal()]) == typed([full])


def test_a_goodbye_right_after_auth_ok_keeps_the_handshake_outcome() -> None:
    conn = ClientConnection()
    conn.hello()
    hello, auth = sent(conn)
    welcome = Welcome(VERSION, 1 << 20, 1000, "", hello.request_id)
    conn.receive_data(encode(welcome) + encode(AuthOk(auth.request_id))
                      + encode(Goodbye(ErrorCode.SHUTTING_DOWN, "bye")), 0.0)
    assert typed([conn.handshake()]) == typed([welcome])
    assert conn.closed is not None and conn.closed.ends_streams


def test_welcome_of_another_version_is_refused() -> None:
    conn = ClientConnection()
    conn.hello()
    hello, _ = sent(conn)
    with pytest.raises(RemoteProtocolError, match="version 1,"):
        conn.receive_data(encode(Welcome(1, 1 << 20, 1000, "", hello.request_id)), 0.0)
    assert conn.closed is not None and conn.closed.reason is CloseReason.MALFORMED


def test_requests_need_a_finished_handshake() -> None:
    conn = ClientConnection()
    with pytest.raises(LocalProtocolError, match="SUBSCRIBE"):
        conn.subscribe("t")
    conn.hello()
    with pytest.raises(LocalProtocolError):
        conn.ping()


# -------------------------------------------------------------------------- correlation


def test_replies_are_matched_to_their_requests_by_id() -> None:
    conn = ready()
    sub = conn.subscribe("a/+", "g", qos=1, credit=5)
    unsub = conn.unsubscribe(0, "old", "")
    ping = conn.ping(b"data")
    frames = sent(conn)
    assert [f.request_id for f in frames] == [sub, unsub, ping]
    assert len({sub, unsub, ping}) == 3
    assert typed([frames[0]]) == typed([codec.Subscribe("a/+", "g", 1, 5, 0, 0, sub)])
    assert conn.reply(sub) is None
    # in any order: correlation is by request id
    conn.receive_data(encode(Pong(b"data", ping)) + encode(Unsubscribed(0, unsub))
                      + encode(Subscribed(42, sub)), 0.0)
    assert typed([conn.reply(sub), conn.reply(unsub), conn.reply(ping)]) == typed(
        [Subscribed(42, sub), Unsubscribed(0, unsub), Pong(b"data", ping)]
    )
    assert conn.reply(sub) is None  # handed out once
    assert conn.subscribed(42)


def test_an_error_with_a_request_id_answers_that_request() -> None:
    conn = ready()
    rid = conn.subscribe("a/#/b")
    refusal = Error(ErrorCode.INVALID_TOPIC, "bad filter", rid)
    conn.receive_data(encode(refusal), 0.0)
    assert typed([conn.reply(rid)]) == typed([refusal])
    assert conn.refusal() is None and conn.unreported == 0


def test_errors_that_answer_no_waiting_request_are_refusals_in_order() -> None:
    conn = ready()
    conn.publish(Message("t", b"x"))
    (publish,) = sent(conn)
    first = Error(ErrorCode.QUEUE_FULL, "stayed full", publish.request_id)
    second = Error(ErrorCode.PROTOCOL, "something unparsable", 0)
    conn.receive_data(encode(first) + encode(second), 0.0)
    assert conn.unreported == 2
    assert typed([conn.refusal(), conn.refusal()]) == typed([first, second])
    assert conn.refusal() is None
    assert conn.closed is None  # refusals keep the connection open


def test_group_deleted_ends_the_subscription_it_names() -> None:
    conn = ready()
    rid = conn.subscribe("jobs", "g")
    conn.receive_data(encode(Subscribed(9, rid)), 0.0)
    conn.reply(rid)
    conn.receive_data(encode(Error(ErrorCode.GROUP_DELETED, "group deleted", rid)), 0.0)
    assert not conn.subscribed(9)
    refusal = conn.refusal()
    assert refusal is not None and refusal.code == ErrorCode.GROUP_DELETED


def test_a_forgotten_request_drops_its_late_reply() -> None:
    conn = ready()
    rid = conn.subscribe("t")
    conn.forget(rid)
    conn.receive_data(encode(Subscribed(5, rid)) + encode(Deliver(5, (delivery(1),))), 0.0)
    assert conn.reply(rid) is None
    assert not conn.subscribed(5) and conn.next_batch(5) is None


@pytest.mark.parametrize("frame", [
    Pong(b"", 999),  # answers no request
    Subscribed(1, 0),
    codec.Hello(codec.VERSION, "x", 0),  # a frame only clients send
    codec.Publish((), 0),
])
def test_frames_a_client_cannot_take_are_refused(frame: codec.Frame) -> None:
    conn = ready()
    data = encode(frame) if not isinstance(frame, codec.Publish) else codec.encode_publish(
        [codec.message_record(Message("t", b"x"))]
    )
    with pytest.raises(RemoteProtocolError):
        conn.receive_data(data, 0.0)
    assert conn.closed is not None and conn.closed.reason is CloseReason.MALFORMED


def test_a_reply_of_the_wrong_kind_is_refused() -> None:
    conn = ready()
    rid = conn.ping()
    with pytest.raises(RemoteProtocolError, match="waits for PONG"):
        conn.receive_data(encode(Subscribed(1, rid)), 0.0)


# ------------------------------------------------------------------------ ping and bye


def test_a_ping_from_the_broker_is_answered_with_its_data_and_request_id() -> None:
    conn = ready()
    conn.publish(Message("t", b"open batch"))  # not sealed yet: the PONG does not wait for it
    conn.receive_data(encode(Ping(b"\x00probe\xff", 31337)), 0.0)
    assert conn.outgoing == len(encode(Pong(b"\x00probe\xff", 31337)))
    frames = sent(conn)
    assert typed(frames[:1]) == typed([Pong(b"\x00probe\xff", 31337)])
    assert isinstance(frames[1], codec.Publish)
    assert conn.reply(31337) is None  # a PING is no reply to anything


def test_goodbye_records_why_and_ends_streams_only_when_the_broker_stops() -> None:
    conn = ready()
    sub_id = subscribed(conn)
    conn.receive_data(
        encode(Deliver(sub_id, (delivery(1),)))
        + encode(Goodbye(ErrorCode.SHUTTING_DOWN, "broker is shutting down"))
        + encode(Deliver(sub_id, (delivery(2),))),  # after GOODBYE: ignored
        0.0,
    )
    assert conn.closed == Closed(CloseReason.GOODBYE, ErrorCode.SHUTTING_DOWN,
                                 "broker is shutting down")
    assert conn.closed.ends_streams and conn.state is State.CLOSED
    assert conn.next_batch(sub_id) == (delivery(1),)
    assert conn.next_batch(sub_id) is None
    conn.receive_data(b"", 1.0)  # the end of stream does not replace the GOODBYE
    assert conn.closed.reason is CloseReason.GOODBYE
    other = ready()
    other.receive_data(encode(Goodbye(ErrorCode.TIMEOUT, "no PONG")), 0.0)
    assert other.closed is not None and not other.closed.ends_streams


def test_our_goodbye_carries_the_held_acks_and_closes() -> None:
    conn = ready()
    conn.ack_at_close(3, (7, 8))
    conn.ack(3, (5,))
    assert typed(sent(conn)) == typed([codec.Ack(3, (5,))])
    conn.goodbye()
    assert typed(sent(conn)) == typed([codec.Credit(3, 0), codec.Ack(3, (7, 8)), Goodbye()])
    assert conn.closed == Closed(CloseReason.LOCAL, ErrorCode.NORMAL, "")
    conn.receive_data(encode(Ping(b"", 1)), 0.0)  # closed: not answered
    assert conn.data_to_send() == b""


# -------------------------------------------------------------------------- publishing


def test_pub_acks_count_confirmed_qos1_messages() -> None:
    conn = ready()
    for i in range(3):
        conn.publish(Message("t", b"%d" % i, qos=1))
    conn.publish(Message("t", b"zero"))
    conn.seal()
    conn.publish(Message("t", b"q", qos=1, key=b"k"))
    first, second = sent(conn)
    assert conn.qos1_sent == 4 and conn.unconfirmed == 2 and conn.confirmed == 0
    assert [m.qos for m in first.decoded()] == [1, 1, 1, 0]
    conn.receive_data(encode(PubAck(3, first.request_id)), 0.0)
    assert conn.confirmed == 3 and conn.unconfirmed == 1
    # a refusal first, then a PUB_ACK for what was accepted (none)
    conn.receive_data(encode(Error(ErrorCode.STORAGE, "disk", second.request_id))
                      + encode(PubAck(0, second.request_id)), 0.0)
    assert conn.confirmed == 3 and conn.unconfirmed == 0
    assert conn.refusal().code == ErrorCode.STORAGE  # type: ignore[union-attr]


def test_a_qos0_only_publish_awaits_no_pub_ack() -> None:
    conn = ready()
    conn.publish(Message("t", b"x"))
    (frame,) = sent(conn)
    assert conn.unconfirmed == 0
    with pytest.raises(RemoteProtocolError, match="no QoS 1"):
        conn.receive_data(encode(PubAck(1, frame.request_id)), 0.0)


def test_a_pub_ack_cannot_confirm_more_than_its_publish_held() -> None:
    conn = ready()
    conn.publish(Message("t", b"x", qos=1))
    (frame,) = sent(conn)
    with pytest.raises(RemoteProtocolError, match="confirms 2"):
        conn.receive_data(encode(PubAck(2, frame.request_id)), 0.0)


def test_publish_frames_stay_within_max_frame() -> None:
    max_frame = 2000
    conn = ready(max_frame=max_frame, max_message=1500)
    messages = [Message(f"t/{i % 7}", bytes([i]) * (i * 13 % 300), qos=i % 2,
                        key=b"k" if i % 3 else None) for i in range(200)]
    for m in messages:
        conn.publish(m)
    data = conn.data_to_send()
    decoder = codec.Decoder(max_frame)  # the broker's limit: refuses anything larger
    decoder.feed(data)
    frames = decoder.frames()
    assert decoder.buffered == 0 and len(frames) > 10
    assert [m for f in frames for m in f.decoded()] == messages
    assert len({f.request_id for f in frames}) == len(frames)


def test_a_record_that_fills_a_frame_alone_fits_and_one_byte_more_does_not() -> None:
    max_frame = 1000
    conn = ready(max_frame=max_frame, max_message=max_frame)
    head = codec.MSG_HEAD.size + 1  # topic "t"
    exact = Message("t", b"x" * (max_frame - PUBLISH_OVERHEAD - head))
    conn.publish(Message("t", b"before"))
    conn.publish(exact)  # seals "before" into its own frame first
    first, second = sent(conn)
    assert first.decoded() == [Message("t", b"before")] and second.decoded() == [exact]
    assert len(encode(second)) - 4 == max_frame
    with pytest.raises(LocalProtocolError) as info:
        conn.publish(Message("t", exact.payload + b"x"))
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert conn.data_to_send() == b""


def test_a_publish_frame_carries_at_most_max_batch_messages() -> None:
    conn = ready(max_frame=1 << 24)
    for _ in range(MAX_BATCH + 1):
        conn.publish(Message("t", b""))
    frames = sent(conn)
    assert [len(f.messages) for f in frames] == [MAX_BATCH, 1]


def test_publish_pairs_make_the_frames_publish_makes_and_keep_pairs_before_a_refusal() -> None:
    pairs = [(f"t/{i % 7}", bytes([i % 256]) * (i * 13 % 300)) for i in range(300)]
    one, many = ready(max_frame=2000, max_message=1990), ready(max_frame=2000, max_message=1990)
    for topic, payload in pairs:
        one.publish(Message(topic, payload))
    assert many.publish_pairs(pairs) == len(pairs)
    assert one.data_to_send() == many.data_to_send()  # several frames, byte for byte
    with pytest.raises(LocalProtocolError) as info:
        many.publish_pairs([("t", b"a"), ("t", b"x" * 1991), ("t", b"never")])
    assert info.value.code == ErrorCode.MESSAGE_TOO_LARGE
    with pytest.raises(LocalProtocolError) as info:
        many.publish_pairs([("a/+", b"x")])
    assert info.value.code == ErrorCode.INVALID_TOPIC
    # "a" stayed, and counts: a record that fits a frame alone, but not beside "a", goes
    # into a frame of its own
    alone = b"b" * (2000 - PUBLISH_OVERHEAD - codec.MSG_HEAD.size - 1)
    assert many.publish_pairs([("t", alone)]) == 1
    data = many.data_to_send()
    decoder = codec.Decoder(2000)  # the broker's limit: refuses anything larger
    decoder.feed(data)
    frames = decoder.frames()
    assert [f.decoded() for f in frames] == [[Message("t", b"a")], [Message("t", alone)]]


@pytest.mark.parametrize(("message", "code"), [
    (Message("t", b"x" * 101), ErrorCode.MESSAGE_TOO_LARGE),
    (Message("a/+", b"x"), ErrorCode.INVALID_TOPIC),
    (Message("$SYS", b"x"), ErrorCode.INVALID_TOPIC),
])
def test_messages_the_broker_would_refuse_are_refused_here(message: Message, code: int) -> None:
    conn = ready(max_message=100)
    with pytest.raises(LocalProtocolError) as info:
        conn.publish(message)
    assert info.value.code == code
    assert conn.data_to_send() == b""


def test_other_frames_go_out_after_the_records_before_them() -> None:
    conn = ready()
    conn.publish(Message("t", b"1"))
    rid = conn.ping()
    frames = sent(conn)
    assert [type(f) for f in frames] == [codec.Publish, Ping]
    assert frames[1].request_id == rid


# ----------------------------------------------------------------------- subscriptions


def test_deliveries_queue_per_subscription() -> None:
    conn = ready()
    a, b = subscribed(conn, "a"), subscribed(conn, "b")
    conn.receive_data(
        encode(Deliver(a, (delivery(1), delivery(2))))
        + encode(Deliver(b, (delivery(3),)))
        + encode(Deliver(999, (delivery(4),)))  # not ours: dropped
        + encode(Deliver(a, (delivery(5),))),
        0.0,
    )
    assert conn.next_batch(a) == (delivery(1), delivery(2))
    assert conn.next_batch(b) == (delivery(3),)
    assert conn.next_batch(a) == (delivery(5),)
    assert conn.next_batch(a) is None and conn.next_batch(999) is None


def test_unsubscribed_ends_the_subscriptions_it_names() -> None:
    conn = ready()
    a, b, g = subscribed(conn, "x"), subscribed(conn, "x"), subscribed(conn, "x", "grp")
    one = conn.unsubscribe(a)
    conn.receive_data(encode(Deliver(a, (delivery(1),))) + encode(Unsubscribed(1, one)), 0.0)
    assert not conn.subscribed(a) and conn.next_batch(a) is None
    by_filter = conn.unsubscribe(0, "x")
    conn.receive_data(encode(Unsubscribed(1, by_filter)), 0.0)
    assert not conn.subscribed(b) and conn.subscribed(g)  # only those without a group
    by_group = conn.unsubscribe(0, "x", "grp")
    conn.receive_data(encode(Unsubscribed(1, by_group)), 0.0)
    assert not conn.subscribed(g)


# ---------------------------------------------------------------------------- keepalive


def test_keepalive_pings_after_silence_and_gives_up_after_another_interval() -> None:
    conn = ready()  # last heard at 0.0
    assert conn.tick(3.0, 10.0) == 7.0
    assert conn.data_to_send() == b""
    assert conn.tick(10.0, 10.0) == 10.0  # ten seconds of silence: probe
    (probe,) = sent(conn)
    assert isinstance(probe, Ping)
    assert conn.tick(15.0, 10.0) == 5.0 and conn.data_to_send() == b""  # one probe only
    assert conn.closed is None
    assert conn.tick(20.0, 10.0) == 0.0
    assert conn.closed is not None and conn.closed.reason is CloseReason.SILENT
    assert "20 s" in conn.closed.text


def test_any_byte_from_the_broker_counts_as_an_answer() -> None:
    conn = ready()
    sub_id = subscribed(conn)
    conn.tick(10.0, 10.0)
    (probe,) = sent(conn)
    conn.receive_data(encode(Deliver(sub_id, (delivery(1),))), 19.0)  # not the PONG: enough
    assert conn.tick(20.0, 10.0) == 9.0 and conn.closed is None
    conn.receive_data(encode(Pong(b"", probe.request_id)), 21.0)  # late PONG: dropped quietly
    assert conn.reply(probe.request_id) is None and conn.closed is None
    assert conn.tick(30.0, 10.0) == 1.0


def test_a_ping_from_the_broker_also_keeps_the_link_alive() -> None:
    conn = ready()
    for t in range(5, 100, 5):  # the broker pings every 5 s; we never need to probe
        conn.receive_data(encode(Ping(b"", t)), float(t))
        assert conn.tick(t + 0.5, 10.0) == 9.5
        assert typed(sent(conn)) == typed([Pong(b"", t)])
    assert conn.closed is None


def test_keepalive_waits_for_the_handshake() -> None:
    conn = ClientConnection()
    conn.hello()
    sent(conn)
    assert conn.tick(1000.0, 1.0) == 1.0
    assert conn.data_to_send() == b"" and conn.closed is None


# ------------------------------------------------------------------------- bad bytes


def test_malformed_bytes_are_one_clear_error_after_the_good_frames() -> None:
    conn = ready()
    rid = conn.ping()
    sent(conn)
    good = encode(Pong(b"", rid))
    bad = b"\x00\x00\x00\x09\xee\x00\x00\x00\x01garbage!"  # unknown frame type
    with pytest.raises(RemoteProtocolError, match="unknown frame type") as info:
        conn.receive_data(good + bad + encode(Ping(b"", 5)), 0.0)
    assert info.value.code == ErrorCode.PROTOCOL
    assert isinstance(conn.reply(rid), Pong)  # handled before the bad frame
    assert conn.closed == Closed(CloseReason.MALFORMED, ErrorCode.PROTOCOL, str(info.value))
    conn.receive_data(encode(Ping(b"", 6)), 0.0)  # closed: ignored, no second error
    assert conn.data_to_send() == b""


def test_bytes_fed_one_at_a_time_give_the_same_result_as_whole() -> None:
    def script(conn: ClientConnection, feed: list[bytes]) -> list[object]:
        conn.hello("c", "k")
        hello, auth = sent(conn)
        stream = (encode(Welcome(VERSION, 4096, 1000, "b", hello.request_id))
                  + encode(AuthOk(auth.request_id)))
        for chunk in split(stream, feed):
            conn.receive_data(chunk, 0.0)
        rid = conn.subscribe("t")
        pub = conn.ping()
        sent(conn)
        stream = (encode(Subscribed(7, rid)) + encode(Ping(b"srv", 3))
                  + encode(Deliver(7, (delivery(1, b"a" * 300), delivery(2))))
                  + encode(Error(ErrorCode.QUEUE_FULL, "full")) + encode(Pong(b"", pub))
                  + encode(Goodbye(ErrorCode.SHUTTING_DOWN, "bye")))
        for chunk in split(stream, feed):
            conn.receive_data(chunk, 0.0)
        return [conn.state, conn.welcome, typed([conn.reply(rid), conn.reply(pub)]),
                conn.next_batch(7), conn.refusal(), conn.closed, sent(conn)]

    def split(data: bytes, how: list[bytes]) -> list[bytes]:
        return [data[i : i + 1] for i in range(len(data))] if how else [data]

    whole = script(ClientConnection(), [])
    bytewise = script(ClientConnection(), [b"one at a time"])
    assert bytewise == whole
    assert whole[5] == Closed(CloseReason.GOODBYE, ErrorCode.SHUTTING_DOWN, "bye")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_remote_protocol_error(data: bytes) -> None:
    conn = ready(max_frame=512)
    conn.subscribe("t")
    conn.ping()
    try:
        conn.receive_data(data, 0.0)
    except RemoteProtocolError:
        assert conn.closed is not None and conn.closed.reason is CloseReason.MALFORMED


# ------------------------------------------------------------- tickets, resume, credit


def test_tickets_say_confirmed_or_refused_by_the_pub_ack_count() -> None:
    conn = ready()
    assert conn.publish(Message("t", b"zero")) == 0  # QoS 0: no ticket
    tickets = [conn.publish(Message("t", b"%d" % i, qos=1)) for i in range(3)]
    assert tickets == [1, 2, 3] and conn.backlog == (4, conn.backlog[1])
    (publish,) = sent(conn)
    assert [conn.outcome(t) for t in tickets] == [None, None, None]
    assert conn.backlog[0] == 3  # the QoS 0 message left with the frame, the rest wait
    # the broker refused the third: its ERROR first, then a PUB_ACK counting two
    conn.receive_data(encode(Error(ErrorCode.LIMIT, "full", publish.request_id))
                      + encode(PubAck(2, publish.request_id)), 0.0)
    assert [conn.outcome(t) for t in tickets] == [True, True, False]
    assert conn.outcome(tickets[2]) is True  # a refusal is reported once
    assert conn.refusal() is not None and conn.backlog == (0, 0)


def test_resume_sends_unconfirmed_qos1_and_held_messages_on_the_new_connection() -> None:
    old = ready()
    first = old.publish(Message("t", b"confirmed", qos=1))
    (frame,) = sent(old)
    old.receive_data(encode(PubAck(1, frame.request_id)), 0.0)
    lost = old.publish(Message("t", b"unconfirmed", qos=1))
    old.publish(Message("t", b"qos0 sent"))
    sent(old)  # written, and then the connection broke before a PUB_ACK
    old.receive_data(b"", 0.0)
    assert old.closed is not None and old.closed.reason is CloseReason.EOF
    held = old.publish(Message("t", b"while down", qos=1))
    old.publish(Message("t", b"qos0 while down"))
    assert sent(old) == []  # a closed connection holds its batch
    assert old.backlog[0] == 3
    new = ready()
    assert new.resume(old) == 3 and old.backlog == (0, 0)
    (publish,) = sent(new)
    assert [m.record[-len(b"unconfirmed"):] for m in publish.messages[:1]] == [b"unconfirmed"]
    assert [m.qos for m in publish.messages] == [1, 1, 0]
    assert new.outcome(first) is True and new.outcome(lost) is None
    new.receive_data(encode(PubAck(2, publish.request_id)), 0.0)
    assert (new.outcome(lost), new.outcome(held)) == (True, True)
    assert new.publish(Message("t", b"next", qos=1)) == held + 1  # tickets go on
    with pytest.raises(LocalProtocolError):
        ready().resume(new)  # not closed


def test_credit_is_remembered_and_queued_deliveries_are_counted() -> None:
    conn = ready()
    rid = conn.subscribe("t", "g", qos=1, credit=7)
    conn.receive_data(encode(Subscribed(5, rid)), 0.0)
    sent(conn)
    assert conn.credit_of(5) == 7
    conn.credit(5, 2)
    assert conn.credit_of(5) == 2 and conn.credit_of(99) == 0
    assert typed(sent(conn)) == typed([codec.Credit(5, 2)])
    conn.receive_data(encode(Deliver(5, (delivery(1), delivery(2)))), 0.0)
    assert conn.queued == 2
    assert conn.next_batch(5) is not None and conn.queued == 0
    conn.receive_data(encode(Deliver(5, (delivery(3),))), 0.0)
    conn.unsubscribe(5)
    (unsub,) = sent(conn)
    conn.receive_data(encode(Unsubscribed(1, unsub.request_id)), 0.0)
    assert conn.queued == 0


def test_a_record_from_a_log_is_published_as_it_is() -> None:
    conn = ready()
    record = codec.message_record(Message("up/t", b"payload", qos=1, key=b"k", retain=True))
    ticket = conn.publish_record(record, len(b"payload"))
    plain = codec.message_record(Message("up/u", b"zero"))
    assert conn.publish_record(plain, 4) == 0
    (frame,) = sent(conn)
    first, second = frame.decoded()
    assert (first.topic, first.payload, first.qos, first.key, first.retain) == (
        "up/t", b"payload", 1, b"k", True)
    assert (second.topic, second.qos) == ("up/u", 0)
    assert conn.outcome(ticket) is None
    conn.receive_data(encode(PubAck(1, frame.request_id)), 0.0)
    assert conn.outcome(ticket) is True


def test_a_record_with_broker_made_flags_or_too_large_is_refused() -> None:
    conn = ready(max_message=10)
    dead = bytearray(codec.message_record(Message("t", b"x")))
    dead[0] |= 0x04  # a dead letter: the broker's to make
    with pytest.raises(LocalProtocolError, match="may not be published"):
        conn.publish_record(bytes(dead), 1)
    with pytest.raises(LocalProtocolError):
        conn.publish_record(codec.message_record(Message("t", b"y" * 11)), 11)
    assert conn.data_to_send() == b""


def test_pub_acks_after_our_goodbye_still_confirm() -> None:
    """The broker handles what we sent before our GOODBYE: the PUB_ACK of a PUBLISH sent
    just before it counts (``backlog`` is then empty, and close() drops nothing), and so
    does a refusal; other frames and broken bytes are ignored."""
    conn = ready()
    first, second = conn.publish(Message("t", b"a", qos=1)), conn.publish(Message("t", b"b", qos=1))
    (publish,) = sent(conn)
    conn.publish(Message("t", b"c", qos=1))
    (late,) = sent(conn)
    conn.goodbye()
    assert typed(sent(conn)) == typed([Goodbye()])
    assert conn.backlog[0] == 3
    conn.receive_data(encode(PubAck(2, publish.request_id))
                      + encode(PubAck(0, late.request_id))
                      + encode(Error(ErrorCode.MESSAGE_TOO_LARGE, "too large", 0))
                      + encode(Ping(b"", 9)), 1.0)
    assert conn.backlog == (0, 0) and conn.confirmed == 2
    assert (conn.outcome(first), conn.outcome(second)) == (True, True)
    assert conn.refusal() is not None
    assert conn.data_to_send() == b""  # the PING is not answered: the connection is over
    assert conn.closed == Closed(CloseReason.LOCAL, ErrorCode.NORMAL, "")
    conn.receive_data(b"\xff" * 8, 2.0)  # broken bytes: nothing after them counts
    conn.receive_data(encode(PubAck(1, 12345)), 3.0)
    assert conn.confirmed == 2

"""mqtt/state.py: persistent-session record bodies and MQTT names mapped to group names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blipmq_server.mqtt import state
from blipmq_server.protocol.names import group_problem


@given(st.dictionaries(st.text(min_size=1, max_size=40), st.integers(0, 2), max_size=30),
       st.integers(0, 2**63))
def test_subscriptions_round_trip(subs: dict[str, int], since: int) -> None:
    try:
        body = state.stored_subs(subs, since)
    except UnicodeEncodeError:  # lone surrogates are not UTF-8; MQTT filters never hold them
        return
    assert state.parse_subs(body) == (subs, since)


@given(st.sets(st.integers(1, 65535), max_size=100))
def test_packet_ids_round_trip(ids: set[int]) -> None:
    assert state.parse_ids(state.stored_ids(ids)) == ids


@given(st.sets(st.integers(1, 65535), max_size=300), st.text(max_size=30),
       st.sampled_from(sorted(state.BLOCKS_OF.values())))
def test_packet_id_blocks_round_trip(ids: set[int], client_id: str, prefix: bytes) -> None:
    """Each block record holds its 64 ids of the set, and nothing else; one without any
    is empty (deleted). The same for both sets: inbound ids awaiting PUBREL, outbound ones
    owed a PUBCOMP."""
    try:
        client_id.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: never an MQTT client id
        return
    back: set[int] = set()
    for block in range(65536 // state.BLOCK_IDS):
        key = state.block_key(prefix, client_id, block)
        value = state.stored_block(ids, block)
        mine = {i for i in ids if state.block_of(i) == block}
        assert bool(value) == bool(mine)
        if value:
            assert key.startswith(prefix) and len(value) == 8
            assert state.parse_block(key, value) == (client_id, mine)
            back |= mine
    assert back == ids


def test_a_block_record_is_a_few_bytes_whatever_the_set() -> None:
    ids = set(range(1, 65536))
    key = state.qos2_block_key("dev-1", state.block_of(40000))
    assert key == b"mqtt/i/625/dev-1"
    assert state.block_key(state.PUBREL_BLOCK_PREFIX, "dev-1", 625) == b"mqtt/c/625/dev-1"
    assert state.stored_block(ids, 625) == b"\xff" * 8
    assert state.parse_block(key, b"\xff" * 8)[1] == set(range(40000, 40064))
    assert state.stored_block(ids, 0) == b"\xff" * 7 + b"\xfe"  # packet id 0 is never one


@pytest.mark.parametrize(("key", "value"), [
    (b"mqtt/i/1/c", b"\x01" * 7), (b"mqtt/i/1/c", b"\x01" * 9), (b"mqtt/i/1024/c", b"\x01" * 8),
    (b"mqtt/i/x/c", b"\x01" * 8), (b"mqtt/i/1", b"\x01" * 8), (b"mqtt/i//c", b"\x01" * 8),
    (b"mqtt/c/1/c", b"\x01" * 7), (b"mqtt/c/65536/c", b"\x01" * 8)])
def test_a_damaged_block_record_is_a_value_error(key: bytes, value: bytes) -> None:
    with pytest.raises(ValueError):
        state.parse_block(key, value)


@pytest.mark.parametrize("cut", [1, 5, 11, 14])
def test_a_damaged_body_is_a_value_error(cut: int) -> None:
    body = state.stored_subs({"a/b": 1, "c/#": 2}, 5)
    with pytest.raises(ValueError):
        state.parse_subs(body[:cut])
    with pytest.raises(ValueError):
        state.parse_subs(b"\x07" + body[1:])  # unknown version


def test_shared_subscriptions_map_to_group_names() -> None:
    assert state.share_of("a/b") == ("", "a/b")
    assert state.share_of("$share/workers/jobs/#") == ("workers", "jobs/#")
    name, topic_filter = state.share_of("$share/my group!/x")  # type: ignore[misc]
    assert topic_filter == "x" and group_problem(name) is None
    assert name == state.share_of("$share/my group!/y")[0]  # type: ignore[index]
    assert name != state.share_of("$share/my group?/x")[0]  # type: ignore[index]
    for bad in ("$share/", "$share/name", "$share//x", "$share/a+/x", "$share/name/"):
        assert state.share_of(bad) is None


def test_a_share_never_takes_a_session_groups_name() -> None:
    taken = state.group_name("victim")
    name, topic_filter = state.share_of(f"$share/{taken}/s/#")  # type: ignore[misc]
    assert topic_filter == "s/#" and name != taken and name.startswith("share.")
    assert group_problem(name) is None


def test_session_group_names_are_valid_and_distinct() -> None:
    names = {state.group_name(f"client-{i}") for i in range(1000)}
    assert len(names) == 1000
    assert all(group_problem(n) is None for n in names)
    assert group_problem(state.group_name("x" * 65535)) is None

"""The bounds on what consumers hold unacked (``broker.unacked``), pure."""

from __future__ import annotations

from blipmq_server.broker.unacked import Unacked


def test_one_connection_holds_its_bound_whatever_it_holds_it_on() -> None:
    u = Unacked(per_conn=1000, limit=0)
    assert u.room(1) == 1000
    u.add(1, 600)
    u.add(1, 300)  # another of its consumers
    assert u.room(1) == 100
    assert u.room(2) == 1000  # another connection is not held back
    u.add(1, 200)
    assert u.room(1) < 0
    u.add(1, -1100)
    assert u.room(1) == 1000 and not u.by_conn and u.total == 0


def test_past_the_total_a_connection_holding_none_gets_one_at_a_time() -> None:
    u = Unacked(per_conn=1000, limit=1500)
    u.add(1, 900)
    u.add(2, 700)
    assert u.room(1) == 0 and u.room(2) == 0  # both hold some: nothing more
    assert u.room(3) == 1  # holds none: its next delivery goes, whatever its size
    assert u.starved == {1, 2}
    assert u.room(4, exempt=True) == 1000  # a bridge: its own bound only


def test_those_refused_for_the_total_go_first_once_acks_make_room() -> None:
    u = Unacked(per_conn=1000, limit=1500)
    u.add(1, 900)
    u.add(2, 700)
    assert u.room(2) == 0
    assert u.woken() == set()  # still no room
    u.add(1, -900)  # 1 acked everything
    assert u.room(1) == 1  # but 2 waits for room: 1 takes one at a time meanwhile
    assert u.woken() == {2}
    assert u.room(2) == 300  # its turn, up to its own bound
    assert u.room(2) == 300  # asked again before it took (has_work, then take)
    u.add(2, 300)
    assert u.room(1) == 500  # 2 had its turn
    assert u.woken() == set()


def test_a_connection_that_lets_go_of_all_is_not_woken_for_nothing() -> None:
    u = Unacked(per_conn=1000, limit=1000)
    u.add(1, 1000)
    assert u.room(1) == 0 and u.starved == {1}
    u.add(1, -1000)  # it left, or acked all
    assert u.starved == set() and u.woken() == set()

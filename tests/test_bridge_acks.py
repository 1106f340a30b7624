"""How a bridge link's PUBACKs reach the core: off the window at each read, out of the
group in one core ack per rule by the writer (or when the link ends, before what is still
in flight goes back). The link and the bridge around it are stand-ins, no broker, no I/O."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from blipmq_server.server.bridge import Bridge, _Link


class FakeBroker:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def ack(self, conn: int, sub_id: int, offsets: tuple[int, ...], wall: int) -> bool:
        self.calls.append(("ack", sub_id, offsets))
        return True

    def requeue(self, conn: int, sub_id: int) -> None:
        self.calls.append(("requeue", sub_id))

    def set_credit(self, conn: int, sub_id: int, credit: int) -> None:
        self.calls.append(("credit", sub_id, credit))


def link_of(window: int, inflight: dict[int, tuple[int, int, float]]) -> tuple[_Link, Any]:
    kicks: list[int] = []
    bridge = SimpleNamespace(
        broker=FakeBroker(), conn_id=7, spec=SimpleNamespace(inflight=window, max_retries=3),
        counters={"forwarded": 0}, qos2_subs=set(), _strikes={}, rules_by_sub={1: None},
        _kick=SimpleNamespace(set=lambda: kicks.append(1)), unexpected=lambda *a: None)
    link = _Link.__new__(_Link)
    link.bridge = bridge  # type: ignore[assignment]
    link.inflight = dict(inflight)
    link.released = set()
    link.acked = 0
    link.peer_closed = False
    link.done = {}
    bridge.kicks = kicks
    return link, bridge


def test_reads_of_pubacks_make_one_core_ack_at_the_writers_turn() -> None:
    link, bridge = link_of(4, {pid: (1, 100 + pid, 0.0) for pid in range(1, 5)})
    link._handle_all([1])
    link._handle_all([2, 9])  # 9: nothing waits for it
    assert list(link.inflight) == [3, 4]  # off the window at once
    assert link.acked == 2 and bridge.counters["forwarded"] == 2
    assert bridge.broker.calls == []  # the core is told by the writer, not per read
    assert bridge.kicks  # the window has room for the writer's next batch
    link._ack_core()
    assert bridge.broker.calls == [("ack", 1, (101, 102))]
    link._ack_core()  # nothing new
    assert len(bridge.broker.calls) == 1


def test_a_link_that_ends_acks_what_the_upstream_acknowledged_before_giving_back() -> None:
    link, bridge = link_of(1000, {1: (1, 101, 0.0), 2: (1, 102, 0.0)})
    link._handle_all([1])
    rule = SimpleNamespace(qos=1)
    bridge.rules_by_sub = {1: rule}
    bridge.owed, bridge.resend, bridge.reserved = {}, {}, set()
    bridge._back = lambda offsets: None
    Bridge._give_back(bridge, link)  # type: ignore[arg-type]
    assert bridge.broker.calls[0] == ("ack", 1, (101,))  # acked: not sent again
    assert ("requeue", 1) in bridge.broker.calls[1:]

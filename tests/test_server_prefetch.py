"""The prefetcher's order of work: a consumer's read goes before backlog counting."""

from __future__ import annotations

import trio

from blipmq_server.broker.results import Count, Fetch
from blipmq_server.broker.storage import MemoryRecord
from blipmq_server.kinds import Kind
from blipmq_server.protocol.codec import Message, message_record
from blipmq_server.server.prefetch import Prefetcher

_BODY = message_record(Message("a/x", b"p", 1))


class FakeLog:
    """A log of ``size`` MESSAGE records on ``a/x``, all written; notes every read."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.first_offset = 0
        self.written_offset = size - 1
        self.reads: list[str] = []

    def read_files(self, offset: int, max_records: int, max_bytes: int) -> list[MemoryRecord]:
        self.reads.append("read")
        end = min(self.size, offset + max_records)
        return [MemoryRecord(Kind.MESSAGE, o, 0, _BODY) for o in range(offset, end)]


class FakeBroker:
    def __init__(self, log: FakeLog) -> None:
        self.log = log
        self.counts: dict[int, int] = {}

    def fill(self, key: int, records: list) -> frozenset[int]:
        self.log.reads.append(f"fill {key}")
        return frozenset()

    def counted(self, key: int, n: int, epoch: int = 0) -> None:
        self.log.reads.append(f"counted {key}")
        self.counts[key] = n


async def test_a_consumers_read_goes_before_the_counting_and_one_pass_counts_all() -> None:
    log = FakeLog(50 * 1024)
    broker = FakeBroker(log)
    prefetcher = Prefetcher(log, broker, lambda conns: None)  # type: ignore[arg-type]
    # 300 groups to count over the whole log, then a consumer's read
    prefetcher.request([Count(k, k, log.size - 1, ("a", "+")) for k in range(300)])
    prefetcher.request([Fetch(999, 0)])
    asked_at = -1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefetcher.run)
        while len(broker.counts) < 300:
            await trio.sleep(0.001)
            if asked_at < 0 and log.reads.count("read") > 10:  # in the middle of the pass
                asked_at = len(log.reads)
                prefetcher.request([Fetch(998, 0)])
        nursery.cancel_scope.cancel()
    assert log.reads[:2] == ["read", "fill 999"]  # before any counting
    # the one asked for mid-pass waited for the count's read under way, if any, not the pass
    assert 0 < asked_at <= log.reads.index("fill 998") - 1 <= asked_at + 1
    # one pass: a read of the log per 1,024 records, not one per group
    assert log.reads.count("read") == 2 + 50
    assert broker.counts == {k: log.size - k for k in range(300)}

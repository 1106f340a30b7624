"""The metrics listener's pieces without a socket: the request head's reading
(server/http.py ``head_of``) and the /metrics page as scrapes share it (``Page``), over a
real core with many durable groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from blipmq_server import metrics
from blipmq_server.broker.core import Broker, Limits
from blipmq_server.counters import ConnectionCounters
from blipmq_server.server.http import FRESH_S, Page, head_of, reuse_for
from blipmq_server.wal.log import Log


@pytest.fixture
def broker(tmp_path: Path) -> Broker:
    log = Log(str(tmp_path))
    b = Broker(Limits(), log=log)
    log.open(on_record=b.recover)
    return b


def groups(broker: Broker, n: int, prefix: str = "g") -> None:
    for i in range(n):
        assert broker.subscribe(1, f"{prefix}/{i}/#", group=f"{prefix}{i}", qos=1).refusal is None


def test_a_head_ends_at_its_empty_line() -> None:
    assert head_of(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nbody", ended=False) == (
        b"GET /metrics HTTP/1.1\r\nHost: x")
    assert head_of(b"GET /health HTTP/1.0\nHost: x\n\n", ended=False) == (
        b"GET /health HTTP/1.0\nHost: x")
    assert head_of(b"GET /metrics HTTP/1.1\r\nHost: x\r\n", ended=False) is None
    assert head_of(b"GET /metrics HTTP/1.1\r\n", ended=True) == b"GET /metrics HTTP/1.1\r\n"


def test_one_empty_line_before_the_request_line_is_skipped() -> None:
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request
    line (it was the request line: 400). A second one is still a bad request."""
    assert head_of(b"\r\nGET /health HTTP/1.1\r\n\r\n", ended=False) == b"GET /health HTTP/1.1"
    assert head_of(b"\nGET /health HTTP/1.1\n\n", ended=False) == b"GET /health HTTP/1.1"
    assert head_of(b"\r\n", ended=False) is None
    assert head_of(b"\r\n\r\n", ended=False) == "400 Bad Request"


def test_a_head_over_8_kib_is_refused_with_431() -> None:
    """It was answered from its first 8 KiB (or more), as if that were all of it."""
    line = b"GET /metrics HTTP/1.1\r\nCookie: " + b"a" * 9000
    assert head_of(line, ended=False) == "431 Request Header Fields Too Large"
    assert head_of(line + b"\r\n\r\n", ended=False) == "431 Request Header Fields Too Large"
    assert head_of(line[:8000], ended=False) is None
    assert head_of(line[:8000] + b"\r\n\r\n", ended=False) == line[:8000]


async def test_a_page_is_written_in_parts_and_other_tasks_run_between(
        broker: Broker) -> None:
    """/metrics with many groups was written in one go on the event loop (20,000 groups:
    120-190 ms during which no client was served); now a part at a time, with a checkpoint
    after each, so other tasks run while it is written."""
    groups(broker, 3000)
    page = Page(metrics.Sources(broker, ConnectionCounters()))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await trio.lowlevel.checkpoint()
        start = ticks
        body = await page.get()
        parts = body.count(b"\n") // metrics.PART_LINES
        assert parts >= 9 and ticks - start >= parts
        nursery.cancel_scope.cancel()
    assert body == metrics.render(page.sources)
    assert body.count(b"blipmq_group_in_flight{") == 3000


async def test_scrapes_that_come_meanwhile_get_the_page_being_written(
    broker: Broker, autojump_clock: trio.testing.MockClock
) -> None:
    """At most one page is written at a time: 16 scrapes at once get one page (the same
    object). A small one is not handed out again: the next scrape sees what came since."""
    groups(broker, 2000)
    page = Page(metrics.Sources(broker, ConnectionCounters()))
    got: list[bytes] = []

    async def scrape() -> None:
        got.append(await page.get())

    async with trio.open_nursery() as nursery:
        for _ in range(16):
            nursery.start_soon(scrape)
    assert len(got) == 16 and all(p is got[0] for p in got)
    groups(broker, 1, "later")  # no time passed (the mock clock): written all the same
    fresh = await page.get()
    assert fresh is not got[0] and b'group="later0"' in fresh


def test_a_large_page_is_handed_out_again_for_a_while(broker: Broker) -> None:
    """A page that took 10 ms or more to write is handed out again for ten times as long,
    up to FRESH_S: scrapes one after the other without pause spend at most a tenth of the
    loop's time writing pages. (A clock 100 times as fast as the real one makes this
    small page a large one.)"""
    assert reuse_for(0.005) == 0 and reuse_for(0.01) == 0.1 and reuse_for(0.5) == FRESH_S
    groups(broker, 2000)
    page = Page(metrics.Sources(broker, ConnectionCounters()))

    async def main() -> None:
        first = await page.get()
        assert await page.get() is first
        groups(broker, 1, "later")
        await trio.sleep(FRESH_S)
        fresh = await page.get()
        assert fresh is not first and b'group="later0"' in fresh

    trio.run(main, clock=trio.testing.MockClock(rate=100))


async def test_a_scrape_whose_writer_gave_up_writes_the_page_itself(broker: Broker) -> None:
    """The scrape writing the page can be cancelled (its client's time ran out): those
    waiting for it do not wait for nothing, one of them writes it."""
    groups(broker, 5000)
    page = Page(metrics.Sources(broker, ConnectionCounters()))
    writer = trio.CancelScope()
    got: list[bytes] = []

    async def first() -> None:
        with writer:
            await page.get()

    async def scrape() -> None:
        got.append(await page.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        nursery.start_soon(scrape)
        nursery.start_soon(scrape)
        for _ in range(1000):  # bounded: the page takes 15 parts
            writing = page._writing
            if writing is not None and writing.done.statistics().tasks_waiting == 2:
                break
            await trio.lowlevel.checkpoint()
        assert writing is not None and writing.done.statistics().tasks_waiting == 2
        writer.cancel()
    assert writer.cancelled_caught
    assert len(got) == 2 and got[0] is got[1]
    assert got[0].count(b"blipmq_group_backlog{") == 5000


def test_groups_may_come_and_go_while_a_page_is_written(broker: Broker) -> None:
    """The groups are taken once (a tuple); their figures are read as their lines are
    written. Groups deleted or made between two parts break nothing."""
    groups(broker, 3000)
    parts = metrics.pages(metrics.Sources(broker, ConnectionCounters()), lines=100)
    written = [next(parts)]
    while b"blipmq_group_backlog{" not in written[-1]:  # into the groups' lines
        written.append(next(parts))
    for i in range(3000):
        assert broker.unsubscribe(1, topic_filter=f"g/{i}/#", group=f"g{i}").refusal is None
    assert broker.durable_groups == ()
    groups(broker, 10, "new")
    written += list(parts)
    page = b"".join(written).decode()
    for family in ("backlog", "in_flight", "skipped_total"):
        assert page.count(f"blipmq_group_{family}{{") == 3000
    assert "new0" not in page


async def test_refusals_are_logged_once_a_minute_per_address_with_how_many_came(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused metrics token goes the way of a refused key (server/keys.py): the first
    from an address is logged at once, the next line about it a minute later at the
    soonest and says how many were counted in between."""
    from blipmq_server.config import AuthOptions
    from blipmq_server.server import hush, keys

    now = [1000.0]
    monkeypatch.setattr(hush.time, "monotonic", lambda: now[0])
    ring = keys.Keyring(AuthOptions(failure_delay_ms=0))
    with caplog.at_level("WARNING", logger="blipmq.auth"):
        for _ in range(5):
            await ring.refused("10.0.0.5:4711", "metrics", "a metrics token")
        await ring.refused("10.0.0.6:80", "native")
        now[0] += 59
        await ring.refused("10.0.0.5:4712", "metrics", "a metrics token")
        now[0] += 1
        await ring.refused("10.0.0.5:4713", "metrics", "a metrics token")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("refused a metrics token from 10.0.0.5 (metrics); further")
    assert lines[1].startswith("refused a key from 10.0.0.6 (native); further")
    assert lines[2].startswith("refused a metrics token from 10.0.0.5 (metrics), and 5 more "
                               "since the last line; further")
    assert ring.failures == {"metrics": 7, "native": 1}


def test_the_log_lines_stay_bounded_whatever_the_number_of_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """h32: once 4,096 sources were remembered the table was cleared: a flood from more
    addresses (an IPv6 /64) got a line each (8,200 lines for 8,200 failures), and the count
    of what a source had not been told was lost. Now a source not remembered joins the
    others' one line a minute, and the counts of sources forgotten for room go there."""
    from blipmq_server.server import hush

    now = [1000.0]
    monkeypatch.setattr(hush.time, "monotonic", lambda: now[0])
    h = hush.Hush(kept=4)
    assert h.due("10.0.0.1:1", "tls") == ("10.0.0.1", 0)
    for _ in range(19):
        assert h.due("10.0.0.1:2", "tls") is None
    said = [h.due(f"10.1.0.{i}:9", "tls") for i in range(100)]  # many addresses at once
    lines = [x for x in said if x is not None]
    assert lines == [("10.1.0.0", 0), ("10.1.0.1", 0), ("10.1.0.2", 0), (hush.OTHERS, 0)]
    assert h.due("10.0.0.1:3", "tls") is None  # still remembered: its 19 stay counted
    now[0] += 61
    assert h.due("10.0.0.1:4", "tls") == ("10.0.0.1", 20)  # the count kept
    assert h.due("10.2.0.1:1", "tls") == ("10.2.0.1", 0)  # room: an old line forgotten
    # the others' line says how many of them were not said, and those forgotten for room
    assert h.due("10.3.0.1:1", "tls") == ("10.3.0.1", 0)
    said = [h.due(f"10.4.0.{i}:9", "tls") for i in range(10)]
    assert [x for x in said if x is not None] == [("10.4.0.0", 0), (hush.OTHERS, 96)]

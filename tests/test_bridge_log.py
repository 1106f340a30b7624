"""The bridge's log lines about messages from the upstream, without a broker: each kind at
most once an interval per bridge, saying how many came since (``Hush``)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from blipmq_server.server.bridge import Bridge
from blipmq_server.server.hush import Hush


def test_unkept_retained_values_are_logged_once_an_interval_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    """A retained value from the upstream the local retained store has no room for: one
    line an interval (a minute) per bridge, the next saying how many came since (was: the
    first logged, then never again for as long as the broker ran)."""
    bridge = Bridge.__new__(Bridge)  # only what not_kept uses
    bridge.spec = SimpleNamespace(name="cloud")  # type: ignore[assignment]
    bridge._hush = Hush(every_s=0.3)
    bridge._unkept_said = False  # type: ignore[attr-defined]  # the old once-flag
    with caplog.at_level(logging.WARNING, logger="blipmq.bridge"):
        for n in range(3):
            bridge.not_kept(b"lamp%d" % n, "retained.max_topics (1) reached")
        time.sleep(0.35)
        bridge.not_kept(b"lamp3", "retained.max_topics (1) reached")
    said = [r.getMessage() for r in caplog.records if "not kept" in r.getMessage()]
    assert len(said) == 2, said
    assert "'lamp0'" in said[0] and "more since" not in said[0], said
    assert "'lamp3'" in said[1] and "and 2 more since the last line" in said[1], said

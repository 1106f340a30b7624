"""server/admission.py: which unproven connection gives way at max_connections."""

from __future__ import annotations

from blipmq_server.server.admission import PATIENCE_S, Unproven, host_of


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _held(clock: _Clock) -> tuple[Unproven, list[str], dict[str, bool]]:
    closed: list[str] = []
    proven: dict[str, bool] = {}
    unproven = Unproven(clock)

    def add(name: str, source: str) -> None:
        proven[name] = False
        unproven.add(name, source, lambda: closed.append(name), lambda: proven[name])

    unproven.add_named = add  # type: ignore[attr-defined]
    return unproven, closed, proven


def test_young_handshakes_never_give_way() -> None:
    """h35 #1: a legitimate source's two handshakes under way were closed for a newcomer
    (the old rule: any source holding two). A connection younger than PATIENCE_S is never
    closed for a newcomer, whatever its source holds."""
    clock = _Clock()
    unproven, closed, _ = _held(clock)
    unproven.add_named("a1", "10.0.0.1")  # type: ignore[attr-defined]
    unproven.add_named("a2", "10.0.0.1")  # type: ignore[attr-defined]
    clock.now += PATIENCE_S / 2
    assert unproven.evict() is None and closed == []
    clock.now += PATIENCE_S
    assert unproven.evict() == "10.0.0.1" and closed == ["a1"]


def test_silent_sockets_from_many_sources_give_way_the_busiest_source_first() -> None:
    """h35 #1: one silent socket from each of many addresses kept every newcomer out (the
    old rule wanted a source holding two). Now any connection unproven for PATIENCE_S may
    give way: the oldest of the source holding the most such; the proven are skipped."""
    clock = _Clock()
    unproven, closed, proven = _held(clock)
    for i in range(2, 10):
        unproven.add_named(f"spread{i}", f"127.0.0.{i}")  # type: ignore[attr-defined]
    clock.now += 0.1
    unproven.add_named("b1", "127.0.0.50")  # type: ignore[attr-defined]
    unproven.add_named("b2", "127.0.0.50")  # type: ignore[attr-defined]
    unproven.add_named("device", "192.168.1.7")  # type: ignore[attr-defined]
    proven["spread2"] = True  # authenticated meanwhile: no longer a candidate
    clock.now += PATIENCE_S
    assert unproven.evict() == "127.0.0.50" and closed == ["b1"]
    assert unproven.evict() == "127.0.0.3" and closed[-1] == "spread3"  # ties: the oldest
    assert "spread2" not in closed and len(unproven) == 8  # 11, less one proven, two gone


def test_host_of() -> None:
    assert host_of("127.0.0.1:5000") == "127.0.0.1"
    assert host_of("::1:5000") == "::1"
    assert host_of("?") == "?"

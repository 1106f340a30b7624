"""Names the CLI did not write itself, on a terminal: literal text, control characters
visible (blipmq_cli/literal.py). Pure: no broker, no terminal."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blipmq_cli.literal import cell, json_visible, visible

CONTROLS = ("\x00", "\x07", "\x1b", "\x7f", "\x85", "\x9b", "\u061c", "\u200e", "\u2028",
            "\u202e", "\u2066", "\u2069", "\ud800")


@pytest.mark.parametrize("ch", CONTROLS)
def test_control_characters_are_written_as_escapes(ch: str) -> None:
    code = ord(ch)
    assert visible(f"a{ch}b") == (f"a\\x{code:02x}b" if code < 0x100 else f"a\\u{code:04x}b")


def test_other_text_is_left_as_it_is() -> None:
    text = "température/€/日本/🙂/a\\b/[bold]x[/] [link=https://x]y[/link]"
    assert visible(text) == text
    assert cell(text).plain == text and not cell(text).spans  # no markup read, no style


@given(st.text())
def test_hypothesis_json_visible_keeps_every_string_and_hides_every_control(text: str
                                                                             ) -> None:
    line = json_visible(json.dumps({"topic": text, "n": [text]}, ensure_ascii=False))
    assert json.loads(line) == {"topic": text, "n": [text]}
    assert not any(ch in line for ch in CONTROLS)
    assert not any(ch in visible(text) for ch in CONTROLS)
    line.encode("utf-8")  # writable: no lone surrogate left


def test_export_summary_shows_names_as_literal_text(capsys) -> None:
    # h29: device names, topics, filters and dead-letter reasons (any publisher's) were
    # drawn as rich markup ('[/]' failed the export's summary) with escapes passed through
    from types import SimpleNamespace

    from spark_tools import summary

    agg = {"devices": [{"device": "d[/]", "messages": 1, "bytes": 1, "topics": 1,
                        "first_seen": "x", "last_seen": "y"}],
           "traffic": [{"topic": "a/\x1b[2J[/]", "messages": 1, "bytes": 3}],
           "groups": [{"device": "d", "group_name": "g", "filter": "f/[/]/#", "published": 1,
                       "acked": 1, "lag": 0}],
           "dead_letters": [{"device": "d", "topic": "t", "reason": "[bold]no\x07",
                             "messages": 1}],
           "damage": []}
    summary.show(SimpleNamespace(aggregates=agg, rows=1, devices=1, damaged_parts=0,
                                 damaged_bytes=0), "/tmp/out[/]")
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    for shown in ("d[/]", "a/\\x1b[2J[/]", "f/[/]/#", "[bold]no\\x07", "/tmp/out[/]"):
        assert shown in out, (shown, out)

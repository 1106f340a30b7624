"""Strings the CLI did not write itself (topics, filters, group and client names, bridge
errors, dead-letter reasons, file names), shown on a terminal as they are.

Any client may name a topic, so a name must neither be read as rich markup (``[/]`` made
``blipmq stats`` fail, ``[link=...]`` drew a hyperlink) nor reach the terminal as a control
sequence (``ESC [2J`` cleared the admin's screen, an OSC set its title): ``cell`` is a rich
``Text`` (never parsed for markup), and ``visible`` writes control characters as escapes
(``\\x1b``, ``\\u202e``). ``json_visible`` does the same to a JSON text without changing
any value it holds.

Standard library only at import: rich is imported by ``cell``, which only table drawers call.
"""

from __future__ import annotations

import re
from typing import Any

# C0, DEL and C1 controls; the bidirectional marks, embeddings, overrides and isolates
# (they reorder what follows them on the line); the line and paragraph separators; lone
# surrogates (a terminal cannot show them, and writing them raises)
_HIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
# the same, except C0: JSON writes those as escapes already, and only inside strings
_HIDDEN_JSON = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\x1b``), the rest as is."""
    return _HIDDEN.sub(_escape, text)


def json_visible(text: str) -> str:
    """A JSON text (``json.dumps(..., ensure_ascii=False)``) whose strings hold no raw
    control character: DEL, C1, bidi controls and lone surrogates become ``\\uXXXX``
    escapes, which JSON decodes back to the same characters (only strings can hold them)."""
    return _HIDDEN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def cell(value: Any) -> Any:
    """``value`` as literal text for a rich table or ``Console.print``: a ``Text``, which
    rich never parses for markup, with control characters made visible."""
    from rich.text import Text

    return Text(visible(str(value)))

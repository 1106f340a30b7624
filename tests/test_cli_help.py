"""`blipmq ... --help` shows each help text whole.

Typer renders help texts as rich markup, where bracketed text such as ``[required]``,
``[default: the hostname]`` or ``[env BLIPMQ_CERT]`` is taken for a style tag and dropped
unless written ``\\[`` (h30 #14: nothing said ``export --output`` was required)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
import typer.rich_utils
from typer.testing import CliRunner

from blipmq_cli.app import app

_BRACKETED = re.compile(r"\[[^\[\]]*\]")


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    """Every command of the app (click's, as Typer builds them), with its words."""
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, [*path, name])


COMMANDS = list(_commands(typer.main.get_command(app), []))


@pytest.mark.parametrize(("path", "command"), COMMANDS,
                         ids=[" ".join(p) or "blipmq" for p, _ in COMMANDS])
def test_help_shows_the_bracketed_text_of_every_help_string(path, command, monkeypatch) -> None:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 2000)  # no wrapping inside a phrase
    res = CliRunner().invoke(app, [*path, "--help"])
    assert res.exit_code == 0, res.output
    shown = " ".join(res.output.replace("│", " ").split())
    texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
    for text in texts:
        meant = " ".join(text.replace("\\[", "[").split())  # what the reader should see
        for part in _BRACKETED.findall(meant):
            assert part in shown, (path, part)

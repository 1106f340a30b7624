"""The lean parser (blipmq_cli.fast) and the Typer app must declare the same commands."""

import pytest
import typer.main

from blipmq_cli import fast
from blipmq_cli.app import app


def typer_params(command: str) -> tuple[set[str], list[str]]:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    options = {o for p in cmd.params if p.param_type_name == "option" for o in p.opts}
    positionals = [p.name for p in cmd.params if p.param_type_name == "argument"]
    return options, positionals


def argparse_params(command: str) -> tuple[set[str], list[str]]:
    actions = fast.parser(command)._actions
    options = {o for a in actions for o in a.option_strings}
    positionals = [a.dest for a in actions if not a.option_strings]
    return options, positionals


@pytest.mark.parametrize("command", fast.COMMANDS)
def test_same_options_and_arguments(command: str) -> None:
    assert argparse_params(command) == typer_params(command)


@pytest.mark.parametrize("command", fast.COMMANDS)
def test_same_defaults(command: str) -> None:
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    typer_defaults = {p.name: p.default for p in cmd.params if p.param_type_name == "option"}
    parsed = vars(fast.parser(command).parse_args(
        [f"x{i}" for i in range(len(argparse_params(command)[1]))]
    ))
    for name, default in typer_defaults.items():
        assert parsed[name] == default, name

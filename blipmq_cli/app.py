"""The Typer app: every ``blipmq`` command with its help text.

``pub``, ``pubfile``, ``sub``, ``unsub`` and ``start`` normally run through the lean parser
in ``fast`` (startup time); they are declared here too, with the same options, so that
``blipmq --help`` and ``blipmq pub --help`` document them. Both paths call the same
functions in ``commands`` / ``blipmq_server.daemon``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from blipmq_cli import commands, export, walcmd
from blipmq_cli.exits import Exit

app = typer.Typer(
    name="blipmq",
    help="BlipMQ: a lightweight, durable pub/sub broker for edge devices, and its shell tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Broker configuration files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(walcmd.app, name="wal")
app.command("export")(export.command)

Addr = Annotated[
    str | None,
    typer.Option("--addr", envvar="BLIPMQ_ADDR", help="Broker HOST:PORT [default: 127.0.0.1:7878]"),
]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", envvar="BLIPMQ_API_KEY", help="API key for the broker")
]
Ttl = Annotated[int, typer.Option("--ttl", help="Time to live in ms (0: the broker's default)")]
Qos = Annotated[int, typer.Option("--qos", min=0, max=1, help="0 at most once, 1 at least once")]
Key = Annotated[str | None, typer.Option("--key", help="Message key")]
Topic = Annotated[str, typer.Argument(help="Topic name")]


def _exit(code: int) -> None:
    raise typer.Exit(code)


@app.command()
def pub(
    topic: Topic,
    message: Annotated[str, typer.Argument(help="The message, or '-' to read standard input")],
    lines: Annotated[
        bool, typer.Option("--lines", help="Publish each stdin line as its own message")
    ] = False,
    ttl: Ttl = 0,
    qos: Qos = 0,
    key: Key = None,
    addr: Addr = None,
    api_key: ApiKey = None,
) -> None:
    """Publish one message (or, with --lines, every line of stdin as it arrives)."""
    _exit(commands.guarded(lambda: commands.pub(
        topic, message, addr=addr, api_key=api_key, ttl=ttl, qos=qos, key=key, lines=lines
    )))


@app.command()
def pubfile(
    topic: Topic,
    path: Annotated[str, typer.Argument(help="File to send as one binary message")],
    ttl: Ttl = 0,
    qos: Qos = 0,
    key: Key = None,
    addr: Addr = None,
    api_key: ApiKey = None,
) -> None:
    """Publish a file's bytes as one message (binary-safe)."""
    _exit(commands.guarded(lambda: commands.pubfile(
        topic, path, addr=addr, api_key=api_key, ttl=ttl, qos=qos, key=key
    )))


@app.command()
def sub(
    topic: Annotated[str, typer.Argument(help="Topic filter ('+' one level, '#' the rest)")],
    count: Annotated[int | None, typer.Option("--count", help="Exit after N messages")] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Give up after SECONDS (exit code 4)")
    ] = None,
    group: Annotated[str, typer.Option("--group", help="Consumer group to share work in")] = "",
    qos: Qos = 0,
    start: Annotated[
        str,
        typer.Option(
            "--from",
            help="Where a new group or plain subscriber starts: latest | earliest | OFFSET "
            "(replays the log; an existing group resumes where it was)",
        ),
    ] = "latest",
    fmt: Annotated[
        str, typer.Option("--format", help="raw | lines | hex | base64 | json")
    ] = "raw",
    addr: Addr = None,
    api_key: ApiKey = None,
) -> None:
    """Subscribe and write messages to stdout (raw bytes by default)."""
    _exit(commands.guarded(lambda: commands.sub(
        topic, addr=addr, api_key=api_key, count=count, timeout=timeout, group=group, qos=qos,
        start=start, fmt=fmt,
    )))


@app.command()
def unsub(
    topic: Annotated[str, typer.Argument(help="Topic filter the group subscribed to")],
    group: Annotated[str, typer.Option("--group", help="Consumer group to delete")] = "",
    addr: Addr = None,
    api_key: ApiKey = None,
) -> None:
    """Delete a consumer group (and the messages queued for it)."""
    _exit(commands.guarded(lambda: commands.unsub(topic, addr=addr, api_key=api_key, group=group)))


@app.command()
def start(
    config: Annotated[str | None, typer.Option("--config", help="TOML config file")] = None,
    data_dir: Annotated[str | None, typer.Option("--data-dir", help="Data directory")] = None,
    bind: Annotated[str | None, typer.Option("--bind", help="Listen on HOST:PORT")] = None,
    metrics_bind: Annotated[
        str | None, typer.Option("--metrics-bind", help="Serve /metrics on HOST:PORT")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option("--log-level", help="debug | info | warning | error")
    ] = None,
    log_format: Annotated[
        str | None, typer.Option("--log-format", help="auto | plain | rich | json")
    ] = None,
) -> None:
    """Run the broker in the foreground (Ctrl-C or SIGTERM drains and stops it)."""
    from blipmq_server import daemon

    _exit(daemon.start(config, data_dir=data_dir, bind=bind, metrics_bind=metrics_bind,
                       log_level=log_level, log_format=log_format))


@config_app.command("init")
def config_init(
    path: Annotated[str, typer.Argument(help="Where to write it")] = "blipmq.toml",
) -> None:
    """Write a commented default configuration file."""
    from blipmq_server import config
    from blipmq_server.errors import ConfigError

    try:
        config.write_default(path)
    except (ConfigError, OSError) as exc:
        commands.say(str(exc))
        _exit(Exit.USAGE)
    commands.say(f"wrote {path}")


def run_app(argv: list[str]) -> int:
    try:
        app(args=argv, prog_name="blipmq", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0

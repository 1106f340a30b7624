"""The Typer app: every ``blipmq`` command with its help text.

``pub``, ``pubfile``, ``sub``, ``unsub`` and ``start`` normally run through the lean parser
in ``fast`` (startup time); they are declared here too, with the same options, so that
``blipmq --help`` and ``blipmq pub --help`` document them. Both paths call the same
functions in ``commands`` / ``blipmq_server.daemon``.
"""

from __future__ import annotations

import os
import stat
import sys
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
    context_settings={"help_option_names": ["-h", "--help"]},
)
config_app = typer.Typer(help="Broker configuration files.", no_args_is_help=True)
app.add_typer(config_app, name="config")
keys_app = typer.Typer(help="Named keys with permissions.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(walcmd.app, name="wal")
app.command("export")(export.command)

# Help texts are rich markup: a literal "[" before a word is written "\\[", or rich takes
# "[default: ...]" for a style and drops it (tests/test_cli_help.py).
Addr = Annotated[
    str | None,
    typer.Option("--addr", envvar="BLIPMQ_ADDR",
                 help="Broker HOST:PORT, tls://HOST:PORT for TLS \\[default: 127.0.0.1:7878]"),
]
# bench reads BLIPMQ_ADDR itself: an address from the environment is not an --addr given
# (with --start it is not used at all)
BenchAddr = Annotated[
    str | None,
    typer.Option("--addr", help="Broker HOST:PORT, tls://HOST:PORT for TLS, instead of "
                 "--start \\[env BLIPMQ_ADDR; default: 127.0.0.1:7878]", show_default=False),
]
ApiKey = Annotated[
    str | None, typer.Option("--api-key", envvar="BLIPMQ_API_KEY", help="API key for the broker")
]
# TLS (docs/SECURITY.md): each option stands for its environment variable, which the
# client reads (commands.tls_options); a CA file, a certificate or --insecure means TLS too
Tls = Annotated[bool, typer.Option(
    "--tls", help="Connect over TLS, as a tls://HOST:PORT address does (the default address "
    "becomes 127.0.0.1:7879)")]
CaFile = Annotated[str | None, typer.Option(
    "--cafile", help="CA certificates (PEM) that vouch for the broker's certificate "
    "\\[env BLIPMQ_CAFILE; default: the system's]", show_default=False)]
Cert = Annotated[str | None, typer.Option(
    "--cert", help="Client certificate (PEM), for a broker that asks for one "
    "\\[env BLIPMQ_CERT]", show_default=False)]
CertKey = Annotated[str | None, typer.Option(
    "--cert-key", help="The client certificate's private key (PEM), unless --cert holds it "
    "\\[env BLIPMQ_CERT_KEY]", show_default=False)]
Insecure = Annotated[bool, typer.Option(
    "--insecure", help="Do not verify the broker's certificate: still encrypted, but not "
    "protected from a man in the middle \\[env BLIPMQ_INSECURE=1]")]
Ttl = Annotated[str | None, typer.Option(
    "--ttl", help="Time to live: 5000 (ms), 30s, 5m, 2h \\[default: the broker's]")]
Qos = Annotated[int, typer.Option("-q", "--qos", min=0, max=1,
                                  help="0 at most once, 1 at least once")]
Key = Annotated[str | None, typer.Option("--key", help="Message key")]
Topic = Annotated[str, typer.Argument(help="Topic name")]


def _exit(code: int) -> None:
    raise typer.Exit(code)


@app.command()
def pub(
    topic: Annotated[str | None, typer.Argument(help="Topic name (or -t)")] = None,
    message: Annotated[
        str | None, typer.Argument(help="The message (or -m); '-' reads all of stdin")
    ] = None,
    topic_opt: Annotated[str | None, typer.Option("-t", "--topic", help="Topic name")] = None,
    message_opt: Annotated[str | None, typer.Option("-m", "--message", help="The message")
                           ] = None,
    stdin: Annotated[bool, typer.Option("-s", "--stdin", help="Send all of stdin as one message")
                     ] = False,
    lines: Annotated[
        bool, typer.Option("-l", "--lines", help="Publish each stdin line as its own message")
    ] = False,
    path: Annotated[str | None, typer.Option("-f", "--file",
                                             help="Send a file as one message ('-': stdin)")
                    ] = None,
    retain: Annotated[bool, typer.Option(
        "-r", "--retain", help="Keep as the topic's last value for new subscribers "
        "(an empty message clears it)")] = False,
    reconnect_for: Annotated[str | None, typer.Option(
        "--reconnect-for", help="With -l (or -f): when the broker cannot be reached at the "
        "start or the connection is lost (a broker restart), try to connect again for this "
        "long and send what was not confirmed again; then exit 3. 0 exits at once "
        "\\[default: 60s with -l, 0 with -f]", show_default=False)] = None,
    ttl: Ttl = None,
    qos: Qos = 0,
    key: Key = None,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Publish one message (or, with -l, every line of stdin as it arrives)."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    _exit(commands.guarded(lambda: commands.pub(
        topic, message, addr=addr, api_key=api_key, topic_opt=topic_opt,
        message_opt=message_opt, stdin=stdin, lines=lines, path=path, ttl=ttl, qos=qos, key=key,
        retain=retain, reconnect_for=reconnect_for,
    )))


@app.command()
def pubfile(
    topic: Topic,
    path: Annotated[str, typer.Argument(help="File to send as one binary message ('-': stdin)")],
    retain: Annotated[bool, typer.Option(
        "-r", "--retain", help="Keep as the topic's last value for new subscribers")] = False,
    reconnect_for: Annotated[str | None, typer.Option(
        "--reconnect-for", help="When the broker cannot be reached at the start or the "
        "connection is lost (a broker restart), try to connect again for this long and send "
        "the message again unless it was confirmed; then exit 3. 0 exits at once "
        "\\[default: 0]", show_default=False)] = None,
    ttl: Ttl = None,
    qos: Qos = 0,
    key: Key = None,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Publish a file's bytes as one message (binary-safe)."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    _exit(commands.guarded(lambda: commands.pubfile(
        topic, path, addr=addr, api_key=api_key, ttl=ttl, qos=qos, key=key, retain=retain,
        reconnect_for=reconnect_for,
    )))


@app.command()
def sub(
    topics: Annotated[list[str] | None, typer.Argument(
        help="Topic filters ('+' one level, '#' the rest)", show_default=False)] = None,
    topic_opt: Annotated[list[str] | None, typer.Option(
        "-t", "--topic", help="A topic filter (repeatable)", show_default=False)] = None,
    count: Annotated[int | None, typer.Option("-C", "--count", help="Exit after N messages")
                     ] = None,
    timeout: Annotated[str | None, typer.Option(
        "-W", "--timeout", help="Give up after this long: 30 (s), 500ms, 5m (exit code 4 if "
        "nothing came)")] = None,
    group: Annotated[str, typer.Option("--group", help="Consumer group to share work in")] = "",
    qos: Qos = 0,
    start: Annotated[
        str,
        typer.Option(
            "--from",
            help="Where a new group or plain subscriber starts: latest | earliest | OFFSET | "
            "TIME (ISO 8601 with Z or an offset; replays the log; an existing group resumes "
            "where it was)",
        ),
    ] = "latest",
    since: Annotated[
        str | None,
        typer.Option("--since", help="Start at the first message of the last DURATION "
                     "(90s, 10m, 2h, 1d)"),
    ] = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", "-F", help="lines (default) | raw | hex | base64 | json, or a template: "
        "'{topic} {offset} {payload}', '%t %p'")] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Print 'topic payload' lines")
                       ] = False,
    raw: Annotated[bool, typer.Option("-N", "--raw", help="Exact payload bytes, no newline")
                   ] = False,
    command: Annotated[str | None, typer.Option(
        "--exec", help="Run this shell command once per message, the payload on its stdin; "
        "ack on exit 0, nack otherwise")] = None,
    jobs: Annotated[int, typer.Option("--jobs", help="--exec commands running at once")] = 1,
    retry_delay: Annotated[str, typer.Option(
        "--retry-delay", help="Redelivery delay after a failed --exec command")] = "1s",
    no_reconnect: Annotated[bool, typer.Option(
        "--no-reconnect", help="Exit when the connection is lost instead of reconnecting")
    ] = False,
    background: Annotated[bool, typer.Option(
        "-b", "--background", help="Return once subscribed; go on in the background")
    ] = False,
    until_end: Annotated[bool, typer.Option(
        "-e", "--until-end", help="Exit 0 once all the log held when subscribing was "
        "delivered (and acked with -q 1), as kcat -e; without --from/--since/--group: "
        "once the retained values are written")] = False,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Subscribe and write messages to stdout, one per line (or run --exec for each)."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    _exit(commands.guarded(lambda: commands.sub(
        topics or [], addr=addr, api_key=api_key, topic_opt=topic_opt, count=count,
        timeout=timeout, group=group, qos=qos, start=start, fmt=fmt, verbose=verbose, raw=raw,
        command=command, jobs=jobs, retry_delay=retry_delay, no_reconnect=no_reconnect,
        background=background, since=since, until_end=until_end,
    )))


@app.command()
def unsub(
    topic: Annotated[str, typer.Argument(help="Topic filter the group subscribed to")],
    group: Annotated[str, typer.Option("--group", help="Consumer group to delete")] = "",
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Delete a consumer group (and the messages queued for it)."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
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
    mqtt_bind: Annotated[
        str | None, typer.Option("--mqtt-bind", help="Serve MQTT on HOST:PORT ('off': don't)")
    ] = None,
) -> None:
    """Run the broker in the foreground (Ctrl-C or SIGTERM drains and stops it)."""
    from blipmq_server import daemon

    _exit(daemon.start(config, data_dir=data_dir, bind=bind, metrics_bind=metrics_bind,
                       log_level=log_level, log_format=log_format, mqtt_bind=mqtt_bind))


Json = Annotated[bool, typer.Option("--json", help="One JSON line instead of a table")]


@app.command()
def stats(
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C")] = False,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between refreshes with --watch")
    ] = 1.0,
    as_json: Json = False,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """The broker's statistics: topics, groups with backlog, subscriptions, drops, log."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import introspect

    _exit(commands.guarded(lambda: introspect.stats(
        addr=addr, api_key=api_key, watch=watch, interval=interval, as_json=as_json)))


@app.command()
def groups(
    as_json: Json = False,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Consumer groups: backlog (messages of their own topics), in flight, consumers."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import introspect

    _exit(commands.guarded(lambda: introspect.groups(addr=addr, api_key=api_key,
                                                     as_json=as_json)))


@app.command()
def bridges(
    as_json: Json = False,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Bridges to upstream brokers: link state, backlog, forwarded, reconnects."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import introspect

    _exit(commands.guarded(lambda: introspect.bridges(addr=addr, api_key=api_key,
                                                      as_json=as_json)))


@app.command()
def ping(
    count: Annotated[int, typer.Option("--count", "-c", help="Pings to send, 1 s apart")] = 1,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Round-trip time to the broker (PING/PONG)."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import introspect

    _exit(commands.guarded(lambda: introspect.ping(addr=addr, api_key=api_key, count=count)))


@app.command()
def version(
    as_json: Json = False,
    addr: Addr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """The client's version and the broker's."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import introspect

    _exit(commands.guarded(lambda: introspect.versions(addr=addr, api_key=api_key,
                                                       as_json=as_json)))


@app.command()
def bench(
    start: Annotated[bool, typer.Option(
        "--start", help="Run against a temporary broker on a free 127.0.0.1 port (stopped "
        "at the end); needed for --log, --fsync and the broker's CPU and RSS")] = False,
    publishers: Annotated[int, typer.Option("-p", "--publishers", min=1,
                                            help="Publisher processes")] = 1,
    subscribers: Annotated[int, typer.Option("-s", "--subscribers", min=0,
                                             help="Subscriber processes (each gets all)")] = 1,
    topics: Annotated[int, typer.Option("--topics", min=1, help="Topics to spread over")] = 1,
    messages: Annotated[int, typer.Option("-n", "--messages", min=1,
                                          help="Messages in all (split over publishers)")
                        ] = 100_000,
    size: Annotated[int, typer.Option("--size", help="Payload bytes (at least 16)")] = 100,
    qos: Qos = 0,
    batch: Annotated[int, typer.Option("--batch", min=1,
                                       help="Messages per publish call")] = 1000,
    rate: Annotated[int, typer.Option(
        "--rate", min=0, help="Open loop: messages/s over all publishers, one at a time "
        "(0: as fast as they go)")] = 0,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds the run may take before it stops and counts what came")
    ] = 120.0,
    log: Annotated[bool | None, typer.Option(
        "--log/--no-log", help="With --start: the write-ahead log on or off \\[default: on]",
        show_default=False)] = None,
    fsync: Annotated[str | None, typer.Option(
        "--fsync", help="With --start: always | none | every_n:N | interval_ms:M "
        "\\[default: always]")] = None,
    as_json: Json = False,
    addr: BenchAddr = None,
    api_key: ApiKey = None,
    tls: Tls = False,
    cafile: CaFile = None,
    cert: Cert = None,
    cert_key: CertKey = None,
    insecure: Insecure = False,
) -> None:
    """Load a broker with publisher and subscriber processes; report msg/s, MB/s, latency
    percentiles and loss."""
    addr = commands.tls_options(addr, tls, cafile, cert, cert_key, insecure)
    from blipmq_cli import bench as bench_module

    _exit(bench_module.command(
        addr, api_key, start=start, publishers=publishers, subscribers=subscribers,
        topics=topics, messages=messages, size=size, qos=qos, batch=batch, rate=rate,
        timeout=timeout, log=log, fsync=fsync, as_json=as_json,
    ))


@config_app.command("init")
def config_init(
    path: Annotated[str, typer.Argument(help="Where to write it ('-': stdout)")] = "blipmq.toml",
) -> None:
    """Write a commented default configuration file."""
    from blipmq_server import config
    from blipmq_server.errors import ConfigError

    if path == "-":
        sys.stdout.write(config.default_text())
        return
    try:
        config.write_default(path)
    except (ConfigError, OSError) as exc:
        commands.say(str(exc))
        _exit(Exit.USAGE)
    commands.say(f"wrote {path}")


@keys_app.command("new")
def keys_new(
    name: Annotated[str, typer.Argument(
        help="The key's name: its identity in logs and stats, and the owner of its groups "
             "and MQTT sessions (an MQTT client's username is only a label)")],
    publish: Annotated[list[str] | None, typer.Option(
        "--publish", help="A topic filter it may publish to (repeat for more)")] = None,
    subscribe: Annotated[list[str] | None, typer.Option(
        "--subscribe", help="A topic filter it may subscribe to (repeat for more)")] = None,
    admin: Annotated[bool, typer.Option(
        "--admin", help="It may read stats and groups, and use others' groups")] = False,
) -> None:
    """Mint a random key: the key once on stdout's first line, then the [\\[auth.keys]]
    stanza (with the key's hash, never the key) to paste into the config."""
    from blipmq_cli import keys

    problem = keys.problem(name, publish or [], subscribe or [])
    if problem:
        commands.say(problem)
        _exit(Exit.USAGE)
    sys.stdout.write(keys.mint(name, publish or [], subscribe or [], admin))


def run_app(argv: list[str]) -> int:
    """Run the Typer app; a usage error is one line on stderr and exit code 2 (the help
    framework would draw a box around it)."""
    try:  # typer 0.29 carries its own copy of click; the frozen build's 0.28 uses click
        from typer._click.exceptions import UsageError
    except ImportError:
        from click.exceptions import UsageError  # type: ignore[no-redef]

    try:
        result = app(args=argv, prog_name="blipmq", standalone_mode=False)
    except UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "blipmq"
        text = exc.format_message().strip()
        if text:  # empty: no arguments, and the help was printed instead
            commands.say(f"{text} (see '{where} --help')")
        return Exit.USAGE
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        return Exit.INTERRUPTED
    except SystemExit as exc:
        if exc.code == 1 and _reader_gone():
            return Exit.OK  # ``| head``: exit 0, as for every other command
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return result if isinstance(result, int) else 0


def _reader_gone() -> bool:
    """Whether the help framework ended with exit 1 because stdout's reader went away:
    click then wraps stdout (``PacifyFlushWrapper``), and rich points fd 1 at /dev/null
    (neither exits 1 otherwise, and stdout that was /dev/null from the start cannot
    break)."""
    if type(sys.stdout).__name__ == "PacifyFlushWrapper":
        return True
    try:
        return os.fstat(1).st_rdev == os.stat(os.devnull).st_rdev and stat.S_ISCHR(
            os.fstat(1).st_mode)
    except OSError:
        return False

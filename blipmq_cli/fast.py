"""A lean argument parser for the commands that must start fast.

Importing Typer costs about 150 ms here (it pulls in pydantic), more than a whole one-shot
``blipmq pub``. So ``pub``, ``pubfile``, ``sub``, ``unsub`` and ``start`` are parsed with
argparse; the Typer app (``blipmq_cli.app``) declares the same commands for ``--help`` and
everything else, and tests/test_cli_parity.py keeps the two in step.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from blipmq_cli.exits import Exit

COMMANDS = ("pub", "pubfile", "sub", "unsub", "start")
_TLS_OPTIONS = ("tls", "cafile", "cert", "cert_key", "insecure")  # commands.tls_options


class _Formatter(argparse.HelpFormatter):
    """These parsers print no help or usage (``--help`` goes to the Typer app, an error is
    one line), yet argparse makes a formatter for each argument it adds: with a width given,
    it does not ask for the terminal's, which imports shutil (and with it bz2 and lzma)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=80)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see '{self.prog} --help')\n")
        raise SystemExit(Exit.USAGE)


def _client_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=None)
    p.add_argument("--api-key", dest="api_key", default=None)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--cafile", default=None)
    p.add_argument("--cert", default=None)
    p.add_argument("--cert-key", dest="cert_key", default=None)
    p.add_argument("--insecure", action="store_true")


def _pub_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttl", default=None)
    p.add_argument("-q", "--qos", type=int, choices=(0, 1), default=0)
    p.add_argument("--key", default=None)
    _client_opts(p)


def parser(command: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"blipmq {command}", add_help=False, formatter_class=_Formatter)
    if command == "pub":
        p.add_argument("topic", nargs="?", default=None)
        p.add_argument("message", nargs="?", default=None)
        p.add_argument("-t", "--topic", dest="topic_opt", default=None)
        p.add_argument("-m", "--message", dest="message_opt", default=None)
        p.add_argument("-s", "--stdin", action="store_true")
        p.add_argument("-l", "--lines", action="store_true")
        p.add_argument("-f", "--file", dest="path", default=None)
        p.add_argument("-r", "--retain", action="store_true")
        p.add_argument("--reconnect-for", dest="reconnect_for", default=None)
        _pub_opts(p)
    elif command == "pubfile":
        p.add_argument("topic")
        p.add_argument("path")
        p.add_argument("-r", "--retain", action="store_true")
        _pub_opts(p)
    elif command == "sub":
        p.add_argument("topics", nargs="*")
        p.add_argument("-t", "--topic", dest="topic_opt", action="append", default=None)
        p.add_argument("-C", "--count", type=int, default=None)
        p.add_argument("-W", "--timeout", default=None)
        p.add_argument("--group", default="")
        p.add_argument("-q", "--qos", type=int, choices=(0, 1), default=0)
        p.add_argument("--from", dest="start", default="latest")
        p.add_argument("--since", default=None)
        p.add_argument("--format", "-F", dest="fmt", default=None)
        p.add_argument("-v", "--verbose", action="store_true")
        p.add_argument("-N", "--raw", action="store_true")
        p.add_argument("--exec", dest="command", default=None)
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--retry-delay", dest="retry_delay", default="1s")
        p.add_argument("--no-reconnect", dest="no_reconnect", action="store_true")
        p.add_argument("-b", "--background", action="store_true")
        p.add_argument("-e", "--until-end", dest="until_end", action="store_true")
        _client_opts(p)
    elif command == "unsub":
        p.add_argument("topic")
        p.add_argument("--group", default="")
        _client_opts(p)
    elif command == "start":
        p.add_argument("--config", default=None)
        p.add_argument("--data-dir", dest="data_dir", default=None)
        p.add_argument("--bind", default=None)
        p.add_argument("--metrics-bind", dest="metrics_bind", default=None)
        p.add_argument("--mqtt-bind", dest="mqtt_bind", default=None)
        p.add_argument("--log-level", dest="log_level", default=None)
        p.add_argument("--log-format", dest="log_format", default=None)
    return p


def run(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    args = vars(parser(command).parse_intermixed_args(rest))
    if command == "start":
        from blipmq_server import daemon

        return daemon.start(**args)
    from blipmq_cli import commands  # the client: not imported by the broker process

    fn = getattr(commands, command)
    secure = {name: args.pop(name) for name in _TLS_OPTIONS}
    args["addr"] = commands.tls_options(args["addr"], **secure)
    return commands.guarded(lambda: fn(**args))

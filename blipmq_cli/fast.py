"""A lean argument parser for the commands that must start fast.

Importing Typer costs about 150 ms here (it pulls in pydantic), more than a whole one-shot
``blipmq pub``. So ``pub``, ``pubfile``, ``sub``, ``unsub`` and ``start`` are parsed with
argparse; the Typer app (``blipmq_cli.app``) declares the same commands for ``--help`` and
everything else, and tests/test_cli_parity.py keeps the two in step.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection
from typing import NoReturn

from blipmq_cli.exits import Exit

COMMANDS = ("pub", "pubfile", "sub", "unsub", "start")
_TLS_OPTIONS = ("tls", "cafile", "cert", "cert_key", "insecure")  # commands.tls_options


_ADDR = "--addr HOST:PORT here (or BLIPMQ_ADDR)"
_KEY = "--api-key KEY here (or BLIPMQ_API_KEY)"
_NO_ID = "not needed here: leave it out (a subscription that keeps its place while away is " \
    "sub --group NAME -q 1)"
# mosquitto_pub/mosquitto_sub options that blipmq does not take, and what to type instead;
# the ones it shares (-t -m -s -l -f -r -q, sub's -C -W -F -v -N) mean the same here
_MOSQUITTO = {
    "-h": f"mosquitto's -h HOST is {_ADDR}; -t/-m work as in mosquitto, or give the topic "
          "and message as arguments; -h alone is help",
    "--host": f"mosquitto's --host HOST is {_ADDR}",
    "-p": f"mosquitto's -p PORT is {_ADDR}",
    "--port": f"mosquitto's --port PORT is {_ADDR}",
    "-L": f"mosquitto's -L URL is {_ADDR}, with the topic as an argument",
    "--url": f"mosquitto's --url URL is {_ADDR}, with the topic as an argument",
    "-u": f"mosquitto's -u USER/-P PASSWORD are {_KEY}",
    "--username": f"mosquitto's --username/--pw are {_KEY}",
    "-P": f"mosquitto's -u USER/-P PASSWORD are {_KEY}",
    "--pw": f"mosquitto's --username/--pw are {_KEY}",
    "-i": f"mosquitto's -i CLIENT_ID is {_NO_ID}",
    "--id": f"mosquitto's --id CLIENT_ID is {_NO_ID}",
    "-I": f"mosquitto's -I ID_PREFIX is {_NO_ID}",
    "--id-prefix": f"mosquitto's --id-prefix is {_NO_ID}",
    "-c": "mosquitto's -c (a persistent session) is sub --group NAME -q 1 here",
    "--disable-clean-session": "mosquitto's --disable-clean-session is sub --group NAME -q 1 "
                               "here",
    "-n": "mosquitto's -n (an empty message) is an empty argument here: blipmq pub TOPIC ''",
    "--null-message": "mosquitto's --null-message is an empty argument here: blipmq pub "
                      "TOPIC ''",
    "-k": "mosquitto's -k KEEPALIVE is BLIPMQ_TIMEOUT (seconds) here",
    "--keepalive": "mosquitto's --keepalive is BLIPMQ_TIMEOUT (seconds) here",
}
_VALUED = ("-h", "-p", "-L", "-u", "-P", "-i", "-I", "-k")  # also written -p1883


def mosquitto_hint(args: list[str], valued: Collection[str] = ()) -> str | None:
    """What to type instead of the first mosquitto-only option in ``args`` (before ``--``),
    or None. ``valued``: the command's own options that take a value (``valued(parser)``): the
    argument after one is its value (``-m -info`` is the message '-info'), never an option.
    ``-h`` is help only as the last argument (``blipmq pub -h``): mosquitto's ``-h HOST``
    must not print the help and exit 0 without publishing."""
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "--":
            return None
        if arg in valued:  # its value follows (``--key=V`` and ``-mV`` hold theirs)
            skip = True
            continue
        if _ends_valued(arg, valued):  # short flags run together, ``-rm``: ``-m``'s follows
            skip = True
            continue
        if arg == "-h" and i == len(args) - 1:
            return None
        name = arg.split("=", 1)[0] if arg.startswith("--") else arg
        if name not in _MOSQUITTO and arg[:2] in _VALUED:
            name = arg[:2]
        if name in _MOSQUITTO:
            return _MOSQUITTO[name]
    return None


def _ends_valued(arg: str, valued: Collection[str]) -> bool:
    """Whether ``arg`` is short flags run together (``-rm``) whose last one takes a value
    from the next argument (one before it holding the rest as its value does not)."""
    if len(arg) < 3 or arg[0] != "-" or arg[1] == "-":
        return False
    for i, c in enumerate(arg[1:], start=2):
        if f"-{c}" in valued:
            return i == len(arg)
    return False


def valued(p: argparse.ArgumentParser) -> frozenset[str]:
    """The option strings of ``p``'s options that take a value."""
    return frozenset(o for a in p._actions if a.nargs != 0 for o in a.option_strings)


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
        p.add_argument("--reconnect-for", dest="reconnect_for", default=None)
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
    p = parser(command)
    hint = mosquitto_hint(rest, valued(p)) if command != "start" else None
    if hint is not None:
        sys.stderr.write(f"blipmq {command}: {hint}\n")
        return Exit.USAGE
    args = vars(p.parse_intermixed_args(rest))
    if command == "start":
        from blipmq_server import daemon

        return daemon.start(**args)
    from blipmq_cli import commands  # the client: not imported by the broker process

    fn = getattr(commands, command)
    secure = {name: args.pop(name) for name in _TLS_OPTIONS}
    args["addr"] = commands.tls_options(args["addr"], **secure)
    return commands.guarded(lambda: fn(**args))

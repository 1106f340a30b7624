"""Broker logging to stderr: rich on a terminal, plain lines otherwise, or JSON lines.

rich is imported only when it will be used, so a broker under systemd or in a pipe does
not pay for it. Must not import trio.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
            }
        )


def setup(level: str = "info", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "rich" if sys.stderr.isatty() else "plain"
    handler: logging.Handler
    if fmt == "rich":
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        if fmt == "json":
            handler.setFormatter(_JsonFormatter())
        else:
            formatter = logging.Formatter(
                "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s",
                "%Y-%m-%dT%H:%M:%S",
            )
            formatter.converter = time.gmtime
            handler.setFormatter(formatter)
    root = logging.getLogger("blipmq")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False

"""Entry point of the ``blipmq`` executable.

Client commands and ``start`` go through the lean parser in ``fast`` (no Typer import);
``--version`` is answered by ``version``; everything else, and ``--help`` for any command,
goes to the Typer app.

Ctrl-C: in the onefile executable a terminal's SIGINT reaches this process twice, directly and
forwarded by the bootloader parent (packaging/blipmq.spec). ``main`` takes a SIGINT within
half a second of the last one as the same press, so one Ctrl-C raises one KeyboardInterrupt
and the command's clean-up is not cut short by a second. (``blipmq start`` does the same
in the broker's own handling instead: blipmq_server/server/app.py; trio wants the default
handler in place when it starts.)
"""

from __future__ import annotations

import gc
import signal
import sys
import time
from types import FrameType

SAME_SIGNAL_S = 0.5  # the same Ctrl-C, delivered twice


def _one_interrupt_per_press() -> None:
    last = [float("-inf")]

    def interrupt(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if now - last[0] < SAME_SIGNAL_S:
            return
        last[0] = now
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupt)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # only the frozen executable has a forwarding parent; the broker handles its own signals
    if args[:1] == ["start"]:
        # Imports make hundreds of thousands of objects and hardly any garbage: with the
        # collector on they pay for dozens of collections. The broker turns it back on
        # (Server.serve) before it recovers its log.
        gc.disable()
        return _run(args)
    if not getattr(sys, "frozen", False):
        return _run(args)
    _one_interrupt_per_press()
    try:
        return _run(args)
    finally:
        # The copy the bootloader forwards can come after the command has ended: Python's
        # shutdown puts the default handler back, which would turn exit 130 into death by
        # SIGINT. (An uncaught KeyboardInterrupt still ends the process by SIGINT.)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(args: list[str]) -> int:
    if args == ["--version"]:
        from blipmq_cli.version import describe

        print(describe())
        return 0
    from blipmq_cli import fast

    if args and args[0] in fast.COMMANDS and not {"-h", "--help"} & set(args[1:]):
        return fast.run(args)
    from blipmq_cli.app import run_app

    return run_app(args)


if __name__ == "__main__":
    sys.exit(main())

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

import errno
import gc
import io
import os
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


class _ClosedStdout(io.RawIOBase):
    """Stands for stdout when fd 1 is closed (``>&-``): every write fails as a write to a
    closed descriptor does, so the command reports it like any other output error."""

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        raise OSError(errno.EBADF, "stdout is closed")

    def fileno(self) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


def _output_error(exc: OSError) -> int:
    """stdout cannot be written (a full disk, a closed descriptor): one line, exit 2, as
    ``commands.guarded`` reports it; a reader that went away (``| head``) is exit 0.
    fd 1 then points at /dev/null, so the interpreter's last flush does not fail again."""
    from blipmq_cli.commands import say
    from blipmq_cli.exits import Exit

    devnull = os.open(os.devnull, os.O_WRONLY)  # fd 1 itself when it was closed
    if devnull != 1:
        os.dup2(devnull, 1)
        os.close(devnull)
    sys.stdout = open(1, "w", closefd=False)
    if isinstance(exc, BrokenPipeError):
        return Exit.OK
    say(exc.strerror or str(exc))
    return Exit.USAGE


def _fill_standard_fds() -> None:
    """Put /dev/null on whichever of fds 0, 1 and 2 is closed (``>&- 2>&-``, a careless
    daemonizer), so that nothing opened later lands there: the broker's lock file or its
    data directory as fd 2 would take every log line and traceback, and an ``--exec``
    command would inherit a socket as its stdout. Python still sees the stream as closed
    (``sys.stdout`` is None: the command reports a closed stdout as before); a closed stderr
    becomes /dev/null for Python too, so that writing an error line never raises and the
    exit code still tells (``start`` exits 2 for a configuration error, not 1)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["start"]:
        # first thing: until the broker handles signals, SIGHUP (a reload) and SIGTERM
        # would kill it with no line logged (blipmq_server/startup.py)
        from blipmq_server import startup

        startup.hold()
    _fill_standard_fds()
    if sys.stdout is None:  # fd 1 closed
        sys.stdout = io.TextIOWrapper(_ClosedStdout(), write_through=True)
    # only the frozen executable has a forwarding parent; the broker handles its own signals
    if args[:1] == ["start"]:
        # Imports make hundreds of thousands of objects and hardly any garbage: with the
        # collector on they pay for dozens of collections. The broker turns it back on
        # (Server.serve) before it recovers its log.
        gc.disable()
        try:
            return _run(args)
        finally:
            startup.ignore()  # a forwarded copy after the end must not change the exit
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
    try:
        code = _command(args)
        sys.stdout.flush()
    except OSError as exc:  # writing stdout failed outside a command's own handling (--help)
        return _output_error(exc)
    return code


def _command(args: list[str]) -> int:
    if args == ["--version"]:
        from blipmq_cli.version import describe

        print(describe())
        return 0
    from blipmq_cli import fast

    rest = args[1:]
    if args and args[0] in fast.COMMANDS and "--help" not in rest and rest[-1:] != ["-h"]:
        return fast.run(args)  # -h elsewhere: mosquitto's -h HOST, refused there
    from blipmq_cli.app import run_app

    return run_app(args)


if __name__ == "__main__":
    sys.exit(main())

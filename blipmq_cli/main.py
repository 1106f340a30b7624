"""Entry point of the ``blipmq`` executable.

Client commands and ``start`` go through the lean parser in ``fast`` (no Typer import);
``--version`` is answered by ``version``; everything else, and ``--help`` for any command,
goes to the Typer app.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
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

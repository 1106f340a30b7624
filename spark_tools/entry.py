"""The driver script of ``spark-submit`` (``blipmq export --print-submit``): ``blipmq export``
with the submitter's master."""

from __future__ import annotations

import sys

from blipmq_cli.main import main

if __name__ == "__main__":
    sys.exit(main(["export", *sys.argv[1:]]))

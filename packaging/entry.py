"""The frozen executable's script: PyInstaller runs this as ``__main__``."""

import sys

from blipmq_cli.main import main

sys.exit(main())

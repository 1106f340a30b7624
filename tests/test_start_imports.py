"""The broker process loads only what it runs: no CLI front end, no client, no test tools.

Idle memory is a product figure on a Pi (docs/PERFORMANCE.md, "Idle memory"): every module
the start path imports stays in the broker's memory for its whole life. This runs the start
path's imports in a fresh interpreter and names what must not be among them.
"""

import json
import subprocess
import sys

# what `blipmq start` imports up to serving (metrics on: the HTTP module too)
_START_PATH = """
import json, sys
from blipmq_cli import main, fast
fast.parser("start")
from blipmq_server import daemon, config, logs, deferred
deferred.defer()
from blipmq_server.server import app, http
print(json.dumps(sorted(sys.modules)))
"""

_NOT_IN_THE_BROKER = [
    "typer", "rich", "click", "pydantic",  # the Typer front end
    "blipmq_cli.commands", "blipmq_cli.client", "blipmq_cli.output",  # the client
    "pytest", "_pytest", "trio.testing", "hypothesis",  # test tools (trio.testing -> pytest)
    "importlib.metadata", "zipfile", "csv",  # what crc32c's __init__ brings
    "_ssl", "_hashlib", "hashlib",  # OpenSSL, which trio's TLS and DTLS import (deferred)
    "prometheus_client", "tomlkit",  # /metrics and the config file need neither
]


def test_the_start_path_does_not_import_the_heavy_modules() -> None:
    out = subprocess.run([sys.executable, "-c", _START_PATH], capture_output=True, text=True,
                         check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    assert "trio" in loaded and "blipmq_server.wal.record" in loaded  # it did import the path
    assert sorted(m for m in _NOT_IN_THE_BROKER if m in loaded) == []


def test_the_checksum_is_crc32c_however_it_was_loaded() -> None:
    from blipmq_server.wal.record import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    import crc32c as package  # the package, imported later, shares the compiled module

    assert package.crc32c(b"123456789") == 0xE3069283


_STAND_IN = """
import sys
from blipmq_server import deferred
assert deferred.defer() == ["ssl", "hmac"]
import trio
assert "_ssl" not in sys.modules and "_hashlib" not in sys.modules
stand_in = sys.modules["ssl"]
assert not hasattr(stand_in, "__file__")  # reading a dunder does not load it
assert "_ssl" not in sys.modules
from ssl import SSLContext  # the first real attribute loads it
assert "_ssl" in sys.modules and sys.modules["ssl"] is not stand_in
assert stand_in.SSLContext is SSLContext is sys.modules["ssl"].SSLContext
assert trio._ssl._stdlib_ssl.SSLContext is SSLContext  # references taken before work
import hmac
assert hmac.new(b"k", b"m", "sha256").hexdigest().startswith("b60090e3")
assert deferred.defer() == []  # nothing left to defer
print("ok")
"""


def test_a_deferred_module_loads_on_first_use_and_works() -> None:
    out = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

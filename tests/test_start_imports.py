"""The broker process loads only what it runs: no CLI front end, no client, no test tools.

Idle memory is a product figure on a Pi (docs/PERFORMANCE.md, "Idle memory"): every module
the start path imports stays in the broker's memory for its whole life. This runs the start
path's imports in a fresh interpreter and names what must not be among them, then runs
``blipmq start`` itself without MQTT (the MQTT front end stays unloaded) and with it.
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# what `blipmq start` imports up to serving (metrics on: the HTTP module too)
_START_PATH = """
import sys
from blipmq_cli import main, fast
fast.parser("start")
from blipmq_server import daemon, deferred
deferred.defer()
from blipmq_server import config, logs
from blipmq_server.server import app, http
standing = [n for n in deferred.DEFERRED + ("platform", "urllib.parse")
            if "__file__" not in vars(sys.modules[n])]
import json  # deferred itself: loaded by the first use, here
print(json.dumps({"loaded": sorted(sys.modules), "standing": standing}))
"""

# the MQTT front end: loaded by a broker that serves MQTT, and only by one
_MQTT_FRONT_END = {"blipmq_server.server.mqtt", "blipmq_server.mqtt.codec",
                   "blipmq_server.mqtt.packets"}
_NOT_IN_THE_BROKER = [
    "typer", "rich", "click", "pydantic",  # the Typer front end
    "blipmq_cli.commands", "blipmq_cli.client", "blipmq_cli.output",  # the client
    "pytest", "_pytest", "trio.testing", "hypothesis",  # test tools (trio.testing -> pytest)
    "importlib.metadata", "zipfile", "csv",  # what crc32c's __init__ brings
    "_ssl", "_hashlib", "hashlib",  # OpenSSL, which trio's TLS and DTLS import (deferred)
    "idna.core",  # trio.socket's, for host names that are not ASCII (deferred)
    "prometheus_client", "tomlkit",  # /metrics and the config file need neither
    "tomllib",  # only to read a config file (the defaults, flags and environment: none)
    "pydoc", "pdb", "unittest", "asyncio", "email", "http.client", "xml",  # nothing here
    "blipmq_server.server.tls",  # only with a TLS listener
    "blipmq_server.protocol.connection", "blipmq_server.wal.reader",  # client, `wal cat`
    *_MQTT_FRONT_END,  # only with an MQTT listener (server/app.py, _listen)
]
# of the CLI, the broker process runs only the entry point and the lean parser
_CLI_IN_THE_BROKER = {"blipmq_cli", "blipmq_cli.main", "blipmq_cli.fast", "blipmq_cli.exits"}


def test_the_start_path_does_not_import_the_heavy_modules() -> None:
    out = subprocess.run([sys.executable, "-c", _START_PATH], capture_output=True, text=True,
                         check=True, timeout=60)
    result = json.loads(out.stdout)
    loaded = set(result["loaded"])
    assert "trio" in loaded and "blipmq_server.wal.record" in loaded  # it did import the path
    assert sorted(m for m in _NOT_IN_THE_BROKER if m in loaded) == []
    assert {m for m in loaded if m.split(".")[0] == "blipmq_cli"} == _CLI_IN_THE_BROKER
    # every deferred module is still a stand-in once the server's modules are in: none of
    # them was needed on the way (one that is should leave UNUSED_BY_THE_BROKER)
    assert result["standing"] == ["ssl", "hmac", "idna", "tempfile", "shutil", "ipaddress",
                                  "ntpath", "array", "subprocess", "json", "traceback",
                                  "tokenize", "platform", "urllib.parse"]


def test_the_checksum_is_crc32c_however_it_was_loaded() -> None:
    from blipmq_server.wal.record import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    import crc32c as package  # the package, imported later, shares the compiled module

    assert package.crc32c(b"123456789") == 0xE3069283


_STAND_IN = """
import sys
from blipmq_server import deferred
assert deferred.defer() == ["ssl", "hmac", "idna", "tempfile", "shutil", "ipaddress", "ntpath",
                           "array", "subprocess", "json", "traceback", "tokenize"]
import trio
assert "_ssl" not in sys.modules and "_hashlib" not in sys.modules
# trio's question to ctypes.util was answered without running ldconfig (the real module is
# not loaded), and its worker threads are named all the same
assert not hasattr(sys.modules["ctypes.util"], "__file__")
assert trio._core._thread_cache.set_os_thread_name is not None
# attrs' question to platform (PyPy?) was answered without loading it; another loads it
import platform
assert not hasattr(platform, "__file__")
assert platform.python_implementation() == "CPython" and not hasattr(platform, "__file__")
assert platform.machine() and hasattr(sys.modules["platform"], "__file__")
assert platform.python_implementation() == "CPython"
# pathlib's one function from urllib.parse is the stand-in's until called
import pathlib
assert not hasattr(sys.modules["urllib.parse"], "__file__")
assert pathlib.Path("/a b").as_uri() == "file:///a%20b"
assert hasattr(sys.modules["urllib.parse"], "__file__")
assert pathlib.Path("/c d").as_uri() == "file:///c%20d"
import urllib.parse
assert urllib.parse.urlsplit("http://h:1/p").port == 1
import ctypes.util
assert ctypes.util.find_library("c")  # another question: the real module answers
assert hasattr(sys.modules["ctypes.util"], "__file__")
stand_in = sys.modules["ssl"]
assert not hasattr(stand_in, "__file__")  # reading a dunder does not load it
assert "_ssl" not in sys.modules
from ssl import SSLContext  # the first real attribute loads it
assert "_ssl" in sys.modules and sys.modules["ssl"] is not stand_in
assert stand_in.SSLContext is SSLContext is sys.modules["ssl"].SSLContext
assert trio._ssl._stdlib_ssl.SSLContext is SSLContext  # references taken before work
import hmac
assert hmac.new(b"k", b"m", "sha256").hexdigest().startswith("b60090e3")
# logging prints an exception with the real traceback module, loaded then
import io, logging
out = io.StringIO()
logger = logging.getLogger("t")
logger.addHandler(logging.StreamHandler(out))
try:
    1 / 0
except ZeroDivisionError:
    logger.exception("boom")
assert "Traceback" in out.getvalue() and "ZeroDivisionError" in out.getvalue()
assert hasattr(sys.modules["traceback"], "__file__")
import subprocess
assert subprocess.run(["true"]).returncode == 0
assert deferred.defer() == []  # nothing left to defer
print("ok")
"""


def test_a_deferred_module_loads_on_first_use_and_works() -> None:
    out = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# `blipmq start` itself, in a fresh interpreter, on ports it picks: once its listening line
# is out, a thread speaks MQTT when it is on (CONNECT -> CONNACK), names what is loaded,
# then stops the broker
_RUNNING = """
import json, os, re, signal, socket, sys, threading
from blipmq_cli.main import main
data_dir, mqtt = sys.argv[1], sys.argv[2] == "mqtt"
CONNECT = bytes.fromhex("100d00044d5154540402003c000174")  # MQTT 3.1.1, clean, client id "t"
listening = []
ready = threading.Event()

class Log:  # stderr, watched for the listening line
    def write(self, text):
        if "listening on" in text:
            listening.append(text)
            ready.set()
        return sys.__stderr__.write(text)

    def flush(self):
        sys.__stderr__.flush()

def watch():
    if not ready.wait(30):
        os._exit(3)
    connack = None
    if mqtt:
        port = int(re.search(r"mqtt on [\\d.]+:(\\d+)", listening[0]).group(1))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(CONNECT)
            connack = s.recv(4).hex()
    print(json.dumps({"loaded": list(sys.modules), "connack": connack}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

sys.stderr = Log()
threading.Thread(target=watch, daemon=True).start()
sys.exit(main(["start", "--data-dir", data_dir, "--bind", "127.0.0.1:0",
               "--metrics-bind", "127.0.0.1:0", "--log-format", "plain",
               "--mqtt-bind", "127.0.0.1:0" if mqtt else "off"]))
"""


def _start(tmp_path: Path, mqtt: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _RUNNING, str(tmp_path), "mqtt" if mqtt else "-"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_broker_without_mqtt_does_not_load_the_mqtt_front_end(tmp_path: Path) -> None:
    loaded = set(_start(tmp_path, mqtt=False)["loaded"])
    assert "blipmq_server.server.sessions" in loaded  # persistent sessions: still kept
    assert sorted(_MQTT_FRONT_END & loaded) == []
    # the listeners' addresses reach getaddrinfo as bytes: no idna codec (listeners.py)
    assert "encodings.idna" not in loaded


def test_a_broker_with_mqtt_loads_it_and_serves_it(tmp_path: Path) -> None:
    result = _start(tmp_path, mqtt=True)
    assert result["connack"] == "20020000"  # CONNACK: accepted
    assert _MQTT_FRONT_END <= set(result["loaded"])

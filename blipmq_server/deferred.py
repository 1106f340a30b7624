"""Modules trio imports for features the broker does not use, and modules the broker uses
only on request, loaded on first use instead.

``import trio`` imports ``ssl`` (for ``trio.SSLStream``: OpenSSL's libssl and libcrypto)
and ``hmac`` (for DTLS cookies: ``hashlib``, and libcrypto again). Unless a listener serves
TLS (docs/SECURITY.md; then ``server/tls.py`` loads ssl on purpose), the broker speaks plain
TCP and HTTP, so these 5 MB of an idle broker's memory (docs/PERFORMANCE.md, "Idle
memory") would sit unused for its whole life. ``defer`` puts a stand-in module into
``sys.modules`` for each name before the broker's modules and trio are imported
(``daemon.start``): ``import ssl`` gets the stand-in, and the first attribute anybody reads
from it (``ssl.SSLContext``, ``from ssl import X``) imports the real module and copies its
contents into the stand-in, so references taken earlier see the real thing from then on.

What differs from a plain import until then: the stand-in has no ``__file__``,
``__path__`` or ``__spec__`` (reading a double-underscore name does not load it, so tools
that walk ``sys.modules``, such as ``inspect.getmodule``, do not load every stand-in). So a
module somebody star-imports (``from X import *`` reads ``__all__``) must not be deferred:
the star import would copy nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

# trio imports them; the broker never calls into them without TLS (tests/test_start_imports.py).
# Likewise idna (trio.socket: only for a host name that is not ASCII), and tempfile and
# shutil (the real ctypes.util's, which ``_Libraries`` keeps unloaded; shutil brings bz2,
# lzma and zlib): 0.2 MB and ~3.5 ms. And ipaddress (urllib.parse, for trio's pathlib:
# only for a URL with a bracketed host; the config's check of an MQTT address without
# authentication): ~0.7 ms. ntpath (pathlib's Windows paths) and array (socket.py, for
# passing file descriptors): ~0.5 ms. subprocess (trio's, for run_process): ~0.9 ms.
UNUSED_BY_THE_BROKER = ("ssl", "hmac", "idna", "tempfile", "shutil", "ipaddress", "ntpath",
                        "array", "subprocess")
# Imported at the top of the broker's modules, used only on request: json (the JSON log
# format, logs.py; introspection answers, server/session.py). ~1 ms, paid by the first use.
# traceback (logging's, to print an exception) and tokenize (linecache's and inspect's, to
# read a source file's lines for one): ~1.2 ms, paid by the first traceback printed. (Not
# token: tokenize star-imports it.)
USED_ON_REQUEST = ("json", "traceback", "tokenize")
DEFERRED = UNUSED_BY_THE_BROKER + USED_ON_REQUEST


class _Deferred(types.ModuleType):
    """Stands for a module until its first attribute is read."""

    def __getattr__(self, name: str) -> object:  # only for names not yet in the module
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(load(self), name)


def load(stand_in: types.ModuleType) -> types.ModuleType:
    """Import the real module ``stand_in`` stands for and fill the stand-in from it."""
    module_name = stand_in.__name__
    if sys.modules.get(module_name) is stand_in:
        del sys.modules[module_name]
    try:
        real = importlib.import_module(module_name)
    except BaseException:
        sys.modules.setdefault(module_name, stand_in)
        raise
    stand_in.__dict__.update(real.__dict__)
    return real


class _Libraries(_Deferred):
    """``ctypes.util`` for trio's one question. Importing, trio asks
    ``find_library("pthread")`` (to name its worker threads with pthread_setname_np), which
    runs ``ldconfig -p`` in a child process: a fork and an exec on every start, about 4 ms
    here and more on a Pi. With glibc 2.34 and later that function is in the C library
    itself, whose name is known; any other question loads the real module."""

    def find_library(self, name: str) -> str | None:
        if name == "pthread" and _glibc() >= (2, 34):
            return "libc.so.6"
        return load(self).find_library(name)  # type: ignore[no-any-return]


class _Platform(_Deferred):
    """``platform`` for attrs' one question (trio's classes are attrs classes): importing,
    attrs asks ``python_implementation()`` (is this PyPy?). The module, which compiles a
    dozen regular expressions to answer, costs 1.2 ms of every start; the interpreter
    knows the answer (``sys.implementation``). Any other question loads the real module."""

    def python_implementation(self) -> str:
        known = {"cpython": "CPython", "pypy": "PyPy"}.get(sys.implementation.name)
        return known if known is not None else load(self).python_implementation()  # type: ignore[no-any-return]


class _UrlParse(_Deferred):
    """``urllib.parse`` for pathlib, which trio imports: pathlib takes one function from it
    when imported (``quote_from_bytes``, for ``Path.as_uri``), and the module costs 0.8 ms
    of every start. The stand-in's function loads the real one when first called (the
    broker never calls it); any other name loads the module at once."""

    def quote_from_bytes(self, bs: bytes, safe: str = "/") -> str:
        real = self.__dict__.get("quote_from_bytes") or load(self).quote_from_bytes
        return real(bs, safe)  # type: ignore[no-any-return]


def _glibc() -> tuple[int, ...]:
    """The C library's version if it is glibc, else ()."""
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return ()
    name, _, version = found.partition(" ")
    try:
        return tuple(int(part) for part in version.split(".")[:2]) if name == "glibc" else ()
    except ValueError:
        return ()


def defer(names: tuple[str, ...] = DEFERRED) -> list[str]:
    """Stand-ins for those of ``names`` not imported yet, and for ``ctypes.util``,
    ``platform`` and ``urllib.parse`` (see ``_Libraries``, ``_Platform``, ``_UrlParse``);
    returns the names deferred (those three not among them)."""
    deferred = [name for name in names if name not in sys.modules]
    for name in deferred:
        sys.modules[name] = _Deferred(name)
    if "platform" not in sys.modules:
        sys.modules["platform"] = _Platform("platform")
    if "urllib.parse" not in sys.modules:
        import urllib  # the package: an empty __init__

        sys.modules["urllib.parse"] = urllib.parse = _UrlParse("urllib.parse")  # type: ignore[attr-defined]
    if "ctypes.util" not in sys.modules:
        import ctypes  # trio's import needs it anyway

        sys.modules["ctypes.util"] = ctypes.util = _Libraries("ctypes.util")  # type: ignore[attr-defined]
    return deferred

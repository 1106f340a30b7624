"""A nats-server new enough for `jetstream { sync_interval: always }` (2.10 or later), for
bench/compare.py's durable case.

Debian 12 ships nats-server 2.9.10, which refuses `sync_interval`. Debian trixie's package
is a static Go binary that runs on Debian 12. This module downloads that package with the
machine's own apt (its configured archive, the suite swapped to trixie; apt state kept in
the cache, nothing installed system-wide) and unpacks it with `dpkg -x` into
~/.cache/blipmq-bench/ (or $BLIPMQ_BENCH_CACHE). A later run finds it there.

    python bench/newer_nats.py          # fetch if missing, print the binary's path
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SUITE = "trixie"
PACKAGE = "nats-server"
MINIMUM = (2, 10)


def cache_dir() -> Path:
    base = os.environ.get("BLIPMQ_BENCH_CACHE") or Path.home() / ".cache" / "blipmq-bench"
    return Path(base) / f"{PACKAGE}-{SUITE}"


def binary(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "root" / "usr" / "sbin" / "nats-server"


def server_version(exe: Path | str) -> tuple[int, ...] | None:
    """(2, 10, 27) from `nats-server --version`, None when it does not run."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    found = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    return tuple(int(x) for x in found.groups()) if found else None


def archive_uri(sources: Path = Path("/etc/apt/sources.list.d/debian.sources"),
                listing: Path = Path("/etc/apt/sources.list")) -> str | None:
    """The Debian archive this machine's apt uses (not its security archive)."""
    if sources.exists():
        for stanza in re.split(r"\n\s*\n", sources.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.MULTILINE))
            suites = fields.get("Suites", "").split()
            if "deb" in fields.get("Types", "").split() and any("-" not in s for s in suites):
                return fields["URIs"].split()[0]
    if listing.exists():
        for line in listing.read_text().splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line).split()
            if len(parts) >= 3 and parts[0] == "deb" and "-" not in parts[2]:
                return parts[1]
    return None


def _apt(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """apt-get with its sources, lists and package cache all inside ``cache``."""
    options = [f"Dir::Etc::sourcelist={cache / 'apt' / 'sources.list'}",
               "Dir::Etc::sourceparts=/nonexistent",
               f"Dir::State::Lists={cache / 'apt' / 'lists'}",
               f"Dir::Cache={cache / 'apt' / 'cache'}",
               "Debug::NoLocking=1"]
    argv = ["apt-get", "-q"] + [x for o in options for x in ("-o", o)] + list(args)
    return subprocess.run(argv, cwd=cache / "apt", capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _failed(step: str, done: subprocess.CompletedProcess[str]) -> str:
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return f"{step} failed (exit {done.returncode}): {tail[0][:160]}"


def fetch(cache: Path) -> str | None:
    """Download and unpack the package into ``cache``; None, or why it failed."""
    uri = archive_uri()
    if uri is None:
        return "no Debian archive in /etc/apt sources"
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        return "apt-get or dpkg not found"
    (cache / "apt" / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (cache / "apt" / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (cache / "apt" / "sources.list").write_text(f"deb {uri} {SUITE} main\n")
    done = _apt(cache, "update")
    if done.returncode:
        return _failed(f"apt-get update ({SUITE})", done)
    for old in (cache / "apt").glob(f"{PACKAGE}_*.deb"):
        old.unlink()
    done = _apt(cache, "download", PACKAGE)
    debs = sorted((cache / "apt").glob(f"{PACKAGE}_*.deb"))
    if done.returncode or not debs:
        return _failed(f"apt-get download {PACKAGE}", done)
    shutil.rmtree(cache / "root", ignore_errors=True)
    done = subprocess.run(["dpkg", "-x", str(debs[-1]), str(cache / "root")],
                          capture_output=True, text=True, timeout=120)
    return _failed("dpkg -x", done) if done.returncode else None


def obtain(may_fetch: bool, cache: Path | None = None) -> tuple[Path | None, str]:
    """The cached nats-server >= 2.10 (fetching it when allowed), or None and the reason."""
    cache = cache or cache_dir()
    exe = binary(cache)
    if not exe.exists():
        if not may_fetch:
            return None, f"no nats-server >= 2.10 in {cache} (--no-install)"
        print(f"fetching {PACKAGE} from Debian {SUITE} into {cache}", file=sys.stderr)
        cache.mkdir(parents=True, exist_ok=True)
        why = fetch(cache)
        if why:
            return None, f"could not fetch {PACKAGE} from Debian {SUITE}: {why}"
    found = server_version(exe)
    if found is None or found[:2] < MINIMUM:
        return None, f"{exe} is version {found}, not >= 2.10"
    return exe, "v" + ".".join(map(str, found))


if __name__ == "__main__":
    path, note = obtain(True)
    print(path or note)
    sys.exit(0 if path else 1)

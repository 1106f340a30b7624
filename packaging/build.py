#!/usr/bin/env python3
"""Build the blipmq executable for this machine's architecture: ``python3 packaging/build.py``.

1. A build venv in ``build/<arch>/venv`` from ``packaging/requirements.txt`` only (runtime
   dependencies plus PyInstaller: no dev tools), made with Debian's ``/usr/bin/python3`` when
   there is one, so that the bundled interpreter and its glibc needs are bookworm's on every
   architecture. It is rebuilt when the requirements or the interpreter change.
2. PyInstaller with ``packaging/blipmq.spec``.
3. Into ``dist/``: ``blipmq-<version>-linux-<arch>`` (onefile), ``...-onedir.tar.gz`` and
   ``...contents.txt`` (every module, library and data file in the bundle).

It does nothing when dist/ already holds a build of the same inputs (sources, spec,
requirements, interpreter); ``--force`` builds anyway. Two runs at once in one tree (the
test suite's workers each ask for the executable) take turns on ``build/<arch>/build.lock``:
the second finds the first one's build up to date. Prints the artefacts' paths on stdout.
Exit codes: 0 built or up to date, 1 the build failed (its log is named), 2 bad usage.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent
PACKAGING = TOP / "packaging"
SOURCES = ("blipmq_cli", "blipmq_server")
RECIPE = ("blipmq.spec", "buildinfo.py", "entry.py", "requirements.txt", "build.py")


def machine() -> str:
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m.lower(), m)


def version() -> str:
    with open(TOP / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def artefact_name() -> str:
    return f"blipmq-{version()}-linux-{machine()}"


def default_python() -> str:
    debian = Path("/usr/bin/python3")
    return str(debian) if debian.exists() else sys.executable


def interpreter_id(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys, platform; print(sys.version, platform.libc_ver())"],
        check=True, capture_output=True, text=True,
    )
    return f"{python} {out.stdout.strip()}"


def digest(python: str) -> str:
    """One hash over everything a build depends on."""
    h = hashlib.sha256(interpreter_id(python).encode())
    files = [TOP / "pyproject.toml"] + [PACKAGING / name for name in RECIPE]
    files += sorted((PACKAGING / "hooks").glob("*.py"))
    for package in SOURCES:
        files += sorted((TOP / package).rglob("*.py"))
    for path in files:
        h.update(str(path.relative_to(TOP)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def clean_env() -> dict[str, str]:
    """The environment without whatever venv or PYTHONPATH the caller runs in."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SOURCE_DATE_EPOCH")
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith("PIP_")}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        parts = env.get("PATH", "").split(os.pathsep)
        env["PATH"] = os.pathsep.join(p for p in parts if not p.startswith(venv))
    return env


def build_venv(work: Path, python: str, log: Path) -> Path:
    venv = work / "venv"
    stamp = venv / "blipmq-requirements.sha256"
    want = hashlib.sha256(
        interpreter_id(python).encode() + (PACKAGING / "requirements.txt").read_bytes()
    ).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == want:
        return venv
    print(f"build: making the build venv {venv} with {python}", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)
    env = clean_env()
    with log.open("a") as out:
        subprocess.run([python, "-m", "venv", str(venv)], check=True, env=env,
                       stdout=out, stderr=subprocess.STDOUT)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input", "-q",
             "-r", str(PACKAGING / "requirements.txt")],
            check=True, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    stamp.write_text(want + "\n")
    return venv


def run_pyinstaller(venv: Path, work: Path, log: Path) -> Path:
    out_dir = work / "pyi-dist"
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [
        str(venv / "bin" / "python"), "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
        "--distpath", str(out_dir), "--workpath", str(work / "pyi-work"),
        str(PACKAGING / "blipmq.spec"),
    ]
    print("build: " + " ".join(cmd[2:]), file=sys.stderr)
    with log.open("a") as out:
        subprocess.run(cmd, check=True, env=clean_env(), cwd=TOP, stdout=out,
                       stderr=subprocess.STDOUT)
    return out_dir


def publish(out_dir: Path, work: Path, dist: Path) -> list[Path]:
    name = artefact_name()
    dist.mkdir(parents=True, exist_ok=True)
    onefile = dist / name
    shutil.copy2(out_dir / name, onefile)
    contents = dist / f"{name}.contents.txt"
    shutil.copy2(work / "pyi-work" / "blipmq" / "contents.txt", contents)
    tarball = dist / f"{name}-onedir.tar.gz"
    tmp = tarball.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out_dir / f"{name}-onedir", arcname=name)
    tmp.replace(tarball)
    return [onefile, tarball, contents]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="packaging/build.py", description=__doc__.split("\n")[0])
    p.add_argument("--python", default=default_python(),
                   help="interpreter for the build venv [default: /usr/bin/python3]")
    p.add_argument("--dist", default=str(TOP / "dist"), help="output directory [dist/]")
    p.add_argument("--force", action="store_true", help="build even if dist/ is up to date")
    args = p.parse_args(argv)
    if sys.platform != "linux":
        p.error("builds Linux executables only, on Linux")
    if shutil.which("objdump") is None:
        print("build: objdump not found: apt-get install binutils", file=sys.stderr)
        return 1

    work = TOP / "build" / machine()
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        return build(args.python, Path(args.dist), args.force, work)


def build(python: str, dist: Path, force: bool, work: Path) -> int:
    """Build into ``dist`` unless it is up to date; the caller holds the build lock."""
    name = artefact_name()
    wanted = digest(python)
    record = work / "inputs.sha256"
    outputs = [dist / name, dist / f"{name}-onedir.tar.gz", dist / f"{name}.contents.txt"]
    if (not force and all(o.exists() for o in outputs) and record.exists()
            and record.read_text().strip() == wanted):
        print(f"build: {dist / name} is up to date", file=sys.stderr)
        print("\n".join(str(o) for o in outputs))
        return 0

    log = work / "build.log"
    log.write_text("")
    record.unlink(missing_ok=True)
    try:
        venv = build_venv(work, python, log)
        out_dir = run_pyinstaller(venv, work, log)
        outputs = publish(out_dir, work, dist)
    except subprocess.CalledProcessError as exc:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        print(f"{tail}build: {exc.cmd[0]} failed (exit {exc.returncode}); log: {log}",
              file=sys.stderr)
        return 1
    record.write_text(wanted + "\n")
    size = outputs[0].stat().st_size / 1e6
    print(f"build: {outputs[0]} ({size:.1f} MB)", file=sys.stderr)
    print("\n".join(str(o) for o in outputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

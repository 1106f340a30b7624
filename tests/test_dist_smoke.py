"""The frozen executable, used as a device operator would, with no Python on the path.

Builds it once per session (tests/frozen.py; ``BLIPMQ_DIST_BINARY`` tests another, e.g. the
aarch64 one under qemu): ``--version``, ``config init``, ``start`` on free loopback ports,
text and a binary file from ``pub``/``pubfile`` to ``sub``, a QoS 1 confirm, ``/metrics``
over HTTP, one-line errors, and SIGTERM to the process group ending everything with exit 0;
a QoS 1 publish over TLS.
MQTT through the same executable: ``mosquitto_pub``/``mosquitto_sub`` (mosquitto-clients,
scripts/test-deps) at QoS 1 to each other and to and from ``blipmq pub``/``sub``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tomllib
from pathlib import Path

import pytest
from frozen import (
    MOSQUITTO_PUB,
    MOSQUITTO_SUB,
    SLOW,
    TOP,
    Executable,
    Runner,
    executable,
    group_alive,
    runner,
    start_broker,
)
from pki import make_pki

from blipmq_cli.exits import Exit

# one worker builds the executable (packaging/build.py) and runs these (make test's xdist)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dist")]
__all__ = ["executable", "runner"]  # fixtures, used by name

SIZE_BUDGET = 12_000_000  # bytes, per executable: what an edge box downloads and stores


def project_version() -> str:
    with open(TOP / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_names_version_architecture_and_glibc_floor(
    executable: Executable, runner: Runner
) -> None:
    done = runner.run("--version")
    assert done.returncode == 0, done.stderr
    line = done.stdout.decode().strip()
    arch = executable.path.name.rsplit("-", 1)[1]
    m = re.fullmatch(
        rf"blipmq {re.escape(project_version())} linux-{arch} \(onefile executable\); "
        r"needs glibc >= (\d+)\.(\d+) \(built on glibc (\d+)\.(\d+)\)", line)
    assert m, line
    floor, built_on = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
    assert (2, 17) <= floor <= built_on
    if arch == platform.machine():  # the host's own glibc must be enough for its own build
        here = tuple(int(p) for p in platform.libc_ver()[1].split(".")[:2])
        assert floor <= here


def test_version_and_stats_say_the_builds_version(runner: Runner, tmp_path: Path) -> None:
    # a bundle carries no package metadata (a build from a clean checkout has no
    # blipmq.egg-info to pick up): the version comes from its blipmq_build.json, as --version's
    config = tmp_path / "blipmq.toml"
    assert runner.run("config", "init", str(config)).returncode == 0
    broker = start_broker(runner, config, tmp_path / "data")
    env = {"BLIPMQ_ADDR": broker.addr}
    ours = project_version()
    done = runner.run("version", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert lines[0].startswith(f"client {ours} (protocol "), lines
    assert lines[1].startswith(f"broker {ours} (protocol "), lines
    done = runner.run("stats", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.decode().splitlines()[0])["version"] == ours
    os.killpg(broker.proc.pid, signal.SIGTERM)
    assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)


def test_size_within_budget(executable: Executable) -> None:
    size = executable.path.stat().st_size
    assert size <= SIZE_BUDGET, f"{executable.path.name} is {size / 1e6:.1f} MB"


def test_bundle_holds_every_blipmq_module_and_nothing_of_spark_or_dev_tools(
    executable: Executable,
) -> None:
    if executable.contents is None:
        pytest.skip("no contents list next to the given executable")
    modules = {
        line.split()[1] for line in executable.contents.read_text().splitlines()
        if line.startswith("PYMODULE ")
    }
    for package in ("blipmq_cli", "blipmq_server"):
        for path in (TOP / package).rglob("*.py"):
            parts = path.relative_to(TOP).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            assert name in modules, f"{name} is not in the bundle"
    banned = ("pyspark", "py4j", "pyarrow", "pandas", "numpy", "spark_tools", "pydantic",
              "pydantic_core", "pytest", "_pytest", "hypothesis")
    leaked = sorted(m for m in modules if m.split(".")[0] in banned)
    assert not leaked, f"in the bundle: {leaked[:10]}"


def test_operator_session(executable: Executable, runner: Runner, tmp_path: Path) -> None:
    # the Typer side of the CLI (no pydantic in the bundle): help, and a default config
    assert b"pubfile" in runner.run("--help").stdout
    config = tmp_path / "blipmq.toml"
    done = runner.run("config", "init", str(config))
    assert done.returncode == 0 and config.exists(), done.stderr

    broker = start_broker(runner, config, tmp_path / "data")
    env = {"BLIPMQ_ADDR": broker.addr}

    # text, one message per line
    sub = runner.spawn("sub", "sensors/+/temp", "--count", "3", "--format", "lines", env=env)
    broker.wait_metric("blipmq_subscriptions", 1)
    for reading in ("21.5", "21.7"):
        assert runner.run("pub", "sensors/hall/temp", reading, env=env).returncode == 0
    assert runner.run("pub", "sensors/attic/temp", "-", "--lines",
                      input=b"30.1\n", env=env).returncode == 0
    out, err = sub.communicate(timeout=SLOW)
    assert sub.returncode == 0, err
    assert out == b"21.5\n21.7\n30.1\n"

    # a binary file, byte for byte
    firmware = tmp_path / "fw.bin"
    firmware.write_bytes(os.urandom(200_000) + bytes(range(256)))
    sub = runner.spawn("sub", "firmware", "-N", "--count", "1", env=env)
    broker.wait_metric("blipmq_subscriptions", 1)
    assert runner.run("pubfile", "firmware", str(firmware), env=env).returncode == 0
    out, err = sub.communicate(timeout=SLOW)
    assert sub.returncode == 0, err
    assert out == firmware.read_bytes()

    # QoS 1: exit 0 only once the broker confirmed the record durable; the log has it
    done = runner.run("pub", "--qos", "1", "orders", "#1234", env=env)
    assert done.returncode == 0, done.stderr
    done = runner.run("sub", "orders", "--from", "earliest", "--count", "1", env=env)
    assert (done.returncode, done.stdout) == (0, b"#1234\n")
    assert broker.metric("blipmq_wal_syncs_total") >= 1

    # /metrics over HTTP counts what was published
    assert broker.metric("blipmq_messages_published_total") == 5
    # trio's ssl and hmac stay deferred in the bundle too: the broker maps no OpenSSL
    (child,) = Path(f"/proc/{broker.proc.pid}/task/{broker.proc.pid}/children").read_text().split()
    maps = Path(f"/proc/{child}/maps").read_text()
    assert "libssl" not in maps and "libcrypto" not in maps

    # bad input: one line on stderr, its documented exit code, no traceback
    for args, code in ((("pub", "bad/#/topic", "x"), 7), (("sub", "t", "--count", "x"), 2)):
        done = runner.run(*args, env=env)
        assert done.returncode == code, (args, done.stderr)
        assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr

    # SIGTERM to the process group: drains, exits 0, leaves nothing running or unpacked
    os.killpg(broker.proc.pid, signal.SIGTERM)
    assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)
    assert broker.log_ended.wait(SLOW)
    assert not group_alive(broker.proc.pid)
    assert "received SIGTERM" in "\n".join(broker.log)
    assert list(runner.tmpdir.iterdir()) == []  # every _MEI directory removed


def test_mqtt_clients_and_native_ones_share_the_broker(runner: Runner, tmp_path: Path) -> None:
    for tool in (MOSQUITTO_PUB, MOSQUITTO_SUB):
        assert tool.exists(), f"{tool} is missing: apt-get install mosquitto-clients"
    config = tmp_path / "blipmq.toml"
    assert runner.run("config", "init", str(config)).returncode == 0
    assert "[mqtt]" in config.read_text()  # on in config init's file; here on a free port
    broker = start_broker(runner, config, tmp_path / "data")
    assert broker.mqtt_port, "no mqtt port in the ready line:\n" + "\n".join(broker.log)
    env = {"BLIPMQ_ADDR": broker.addr}
    mqtt = ("-h", "127.0.0.1", "-p", str(broker.mqtt_port), "-V", "mqttv311")

    def mosquitto_sub(topic: str) -> subprocess.Popen[bytes]:
        return runner.spawn_program(str(MOSQUITTO_SUB), *mqtt, "-t", topic, "-q", "1", "-C", "1")

    # mosquitto_pub at QoS 1 (PUBACK once logged) to mosquitto_sub and to a native sub
    sub = mosquitto_sub("smoke/mqtt")
    native = runner.spawn("sub", "smoke/mqtt", "--count", "1", "--format", "lines", env=env)
    broker.wait_metric("blipmq_subscriptions", 2)
    done = runner.run_program(str(MOSQUITTO_PUB), *mqtt, "-t", "smoke/mqtt", "-m", "hello",
                              "-q", "1")
    assert done.returncode == 0, done.stderr
    for proc in (sub, native):
        out, err = proc.communicate(timeout=SLOW)
        assert (proc.returncode, out) == (0, b"hello\n"), err

    # a native QoS 1 publish to mosquitto_sub
    sub = mosquitto_sub("smoke/native")
    broker.wait_metric("blipmq_subscriptions", 1)
    done = runner.run("pub", "--qos", "1", "smoke/native", "hi", env=env)
    assert done.returncode == 0, done.stderr
    out, err = sub.communicate(timeout=SLOW)
    assert (sub.returncode, out) == (0, b"hi\n"), err
    assert broker.metric("blipmq_messages_published_total") == 2

    # SIGTERM drains the MQTT listener with the rest: exit 0, nothing left unpacked
    os.killpg(broker.proc.pid, signal.SIGTERM)
    assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)
    assert broker.log_ended.wait(SLOW)
    assert not group_alive(broker.proc.pid)
    assert list(runner.tmpdir.iterdir()) == []


def test_a_publish_over_tls(runner: Runner, tmp_path: Path) -> None:
    # the executable carries ssl already (trio imports it): TLS costs it no new module
    pki = make_pki(tmp_path / "pki")
    config = tmp_path / "blipmq.toml"
    assert runner.run("config", "init", str(config)).returncode == 0
    broker = start_broker(runner, config, tmp_path / "data", env={
        "BLIPMQ_SERVER_TLS": "true", "BLIPMQ_SERVER_TLS_PORT": "0",
        "BLIPMQ_TLS_CERT_FILE": str(pki.cert), "BLIPMQ_TLS_KEY_FILE": str(pki.key)})
    assert broker.tls_port, "no tls port in the ready line:\n" + "\n".join(broker.log)
    sub = runner.spawn("sub", "smoke/tls", "--count", "1", env={"BLIPMQ_ADDR": broker.addr})
    broker.wait_metric("blipmq_subscriptions", 1)
    done = runner.run("pub", "-q", "1", "smoke/tls", "sealed", "--cafile", str(pki.ca),
                      env={"BLIPMQ_ADDR": f"tls://127.0.0.1:{broker.tls_port}"})
    assert done.returncode == 0, done.stderr
    out, err = sub.communicate(timeout=SLOW)
    assert (sub.returncode, out) == (0, b"sealed\n"), err
    # a CA that does not vouch for the broker: one line, exit code 12
    done = runner.run("pub", "smoke/tls", "x", "--cafile", str(pki.other_ca),
                      env={"BLIPMQ_ADDR": f"tls://127.0.0.1:{broker.tls_port}"})
    assert done.returncode == Exit.TLS, done.stderr
    assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr
    os.killpg(broker.proc.pid, signal.SIGTERM)
    assert broker.proc.wait(SLOW) == 0, "\n".join(broker.log)


def test_bench_starts_its_own_broker_and_forks_its_workers(runner: Runner) -> None:
    # the frozen executable starts itself as the broker and forks the workers from itself
    done = runner.run("bench", "--start", "--json", "-n", "2000", "-s", "2", "--qos", "1")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["broker"] == "started"
    assert result["confirmed"] == 2000 and result["delivered"] == 4000
    assert result["lost"] == 0 and result["duplicates"] == 0
    assert list(runner.tmpdir.iterdir()) == []  # the broker's and workers' unpacking is gone


def test_commands_that_need_spark_fail_in_one_line(runner: Runner, tmp_path: Path) -> None:
    help_text = runner.run("--help").stdout.decode()
    if not re.search(r"^\W*export\b", help_text, re.M):
        pytest.skip("this build has no export command")
    done = runner.run("export", "--help")
    assert done.returncode == 0  # documented like any command
    # the missing extra is the answer whatever else is wrong or missing (here --output)
    for args in ((str(TOP), "--output", str(tmp_path / "out")), (str(TOP),)):
        done = runner.run("export", *args)
        assert done.returncode == Exit.MISSING, done.stderr
        assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr
        assert b"the spark extra is not installed" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_onefile_copied_into_its_own_tmpdir_says_onefile(runner: Runner) -> None:
    """h31 #12: copied to /tmp (the install guide's scp target) and run there with the
    default TMPDIR, it unpacked below its own directory and called itself "onedir"."""
    copy = runner.tmpdir / "blipmq"
    shutil.copy2(runner.binary, copy)
    done = runner.run_program(str(copy), "--version")
    assert done.returncode == 0, done.stderr
    assert b"(onefile executable)" in done.stdout, done.stdout


def test_exec_jobs_get_the_users_environment(runner: Runner, tmp_path: Path) -> None:
    """h31 #5: a `sub --exec` job inherited LD_LIBRARY_PATH=<the unpacked bundle> (every
    program it ran loaded the bundle's libraries), _PYI_* and the wrapper's TMPDIR."""
    config = tmp_path / "blipmq.toml"
    config.write_text("")
    broker = start_broker(runner, config, tmp_path / "data")
    done = runner.run("pub", "jobs", "one", "-q", "1", "--addr", broker.addr)
    assert done.returncode == 0, done.stderr
    for given, expected in (({}, None), ({"LD_LIBRARY_PATH": "/opt/mine"}, "/opt/mine")):
        done = runner.run("sub", "jobs", "--from", "earliest", "--count", "1", "--exec", "env",
                          "--addr", broker.addr, env={**given, "BLIPMQ_TMPDIR_ORIG": "/home/x"})
        assert done.returncode == 0, done.stderr
        env = dict(line.split("=", 1) for line in done.stdout.decode().splitlines()
                   if "=" in line)
        assert env.get("LD_LIBRARY_PATH") == expected, env.get("LD_LIBRARY_PATH")
        assert not [k for k in env if k.startswith(("_PYI_", "_MEIPASS", "LD_LIBRARY_PATH_"))]
        assert env["TMPDIR"] == "/home/x" and "BLIPMQ_TMPDIR_ORIG" not in env
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.proc.wait(SLOW) == 0

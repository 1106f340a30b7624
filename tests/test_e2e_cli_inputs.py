"""The CLI's inputs whatever they are: files that say size 0 (devices, pipes, /proc), endless
stdin, lines without a newline, closed stdin, bytes that are not UTF-8 in arguments. Each is
one line on stderr and its documented exit code, with the client's memory bounded. Real
broker, real CLI, real pipes; memory is the CLI process's own peak RSS (``os.wait4``)."""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import BLIPMQ, _default_signals

from blipmq_cli.exits import Exit

LIMIT = 1 << 20  # the broker's max_message_bytes in these tests
BIG = 48 << 20  # input far past it


def measured(b, *args: str, stdin: int | None = subprocess.DEVNULL, timeout: float = 30,
             address_space: int | None = None) -> tuple[int, bytes, int, float]:
    """Run ``blipmq ARGS`` against broker ``b``: (exit code, stderr, peak RSS in kB, seconds).
    ``address_space`` caps the child's virtual memory, so that an unbounded read fails fast
    instead of filling the machine."""
    def setup() -> None:
        _default_signals()
        if address_space is not None:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    began = time.monotonic()
    proc = subprocess.Popen([BLIPMQ, *args], stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=b.env, preexec_fn=setup)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        assert proc.stderr is not None
        err = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
        proc.stderr.close()  # type: ignore[union-attr]
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, usage.ru_maxrss, time.monotonic() - began


def feeder(source: list[str]) -> subprocess.Popen[bytes]:
    """A process writing ``source``'s output into a pipe (its stdout)."""
    return subprocess.Popen(source, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def one_line(err: bytes) -> None:
    assert err.count(b"\n") == 1 and b"Traceback" not in err, err
    assert b"internal error" not in err, err


def baseline_rss(b) -> int:
    code, err, rss, _ = measured(b, "pub", "t", "small")
    assert code == 0, err
    return rss


def test_pubfile_of_files_that_say_size_0_reads_at_most_the_limit(start_broker) -> None:
    """D01: /dev/zero, /dev/stdin on a pipe and friends report size 0; they were read whole
    (24 GB of /dev/zero). Now at most the limit + 1 byte, then exit 6."""
    b = start_broker({"server": {"max_message_bytes": LIMIT}})
    base = baseline_rss(b)
    for args in (("pubfile", "t", "/dev/zero"), ("pub", "t", "-f", "/dev/zero")):
        code, err, rss, _ = measured(b, *args, address_space=1 << 30, timeout=60)
        assert code == Exit.TOO_LARGE, (args, err)
        one_line(err)
        assert b"/dev/zero" in err and str(LIMIT).encode() in err, err
        assert rss < base + 16 * 1024, (args, rss, base)
    for args in (("pubfile", "t", "/dev/stdin"), ("pub", "t", "-f", "/dev/stdin")):
        source = feeder(["head", "-c", str(BIG), "/dev/zero"])
        code, err, rss, _ = measured(b, *args, stdin=source.stdout.fileno())  # type: ignore[union-attr]
        source.stdout.close()  # type: ignore[union-attr]
        source.wait()
        assert code == Exit.TOO_LARGE, (args, err)
        one_line(err)
        assert rss < base + 16 * 1024, (args, rss, base)
    # a file that says size 0 and holds little is still published, whole
    sub = b.spawn("sub", "p", "-N", "-C", "1")
    b.wait_subscribers(1)
    res = b.shell("printf 'from a pipe' | blipmq pubfile p /dev/stdin")
    assert res.returncode == 0, res.stderr
    assert sub.communicate(timeout=10)[0] == b"from a pipe"


def test_stdin_payloads_and_lines_are_bounded_by_the_limit(start_broker, tmp_path: Path) -> None:
    """D02: `pub -`, `-s` and `pubfile -` read all of stdin before the size check, and
    `pub -l` kept a line without a newline whole, in quadratic time (100 MB: 63-100 s).
    Now each stops at the limit + 1 byte with exit 6, quickly."""
    b = start_broker({"server": {"max_message_bytes": LIMIT}})
    base = baseline_rss(b)
    for args in (("pub", "t", "-"), ("pub", "t", "-s"), ("pubfile", "t", "-"),
                 ("pub", "t", "-l"), ("pub", "t", "-l", "-q", "1")):
        source = feeder(["head", "-c", str(BIG), "/dev/zero"])
        code, err, rss, took = measured(b, *args, stdin=source.stdout.fileno(),  # type: ignore[union-attr]
                                        timeout=60)
        source.stdout.close()  # type: ignore[union-attr]
        source.wait()
        assert code == Exit.TOO_LARGE, (args, err)
        one_line(err)
        assert str(LIMIT).encode() in err, err
        assert rss < base + 16 * 1024, (args, rss, base)
        assert took < 10, (args, took)
    # lines longer than a read, split across reads, arrive whole and in order
    lines = [bytes([65 + i]) * (150_000 + i) for i in range(5)] + [b"", b"short"]
    sub = b.spawn("sub", "l", "-C", str(len(lines)))
    b.wait_subscribers(1)
    (tmp_path / "lines").write_bytes(b"\n".join(lines))  # the last without a newline
    res = b.shell(f"blipmq pub l -l < {tmp_path / 'lines'}")
    assert res.returncode == 0, res.stderr
    out, err = sub.communicate(timeout=10)
    assert out == b"".join(line + b"\n" for line in lines), err


@pytest.mark.parametrize("qos", [0, 1])
@pytest.mark.parametrize("newline", [True, False], ids=["whole", "unended"])
def test_the_lines_before_an_over_long_line_are_published_and_the_error_names_it(
        start_broker, qos: int, newline: bool) -> None:
    """`pub -l`: a line over the limit that came whole in one read with the lines before it
    ended the command with the encoder's message ("message of N bytes exceeds ...") and
    without those lines (never sent, at QoS 1 "0 of 0 line(s) confirmed"); one that came
    without its newline said "a line of stdin" and lost the lines of earlier reads not yet
    sent. Now the lines before it are published (and confirmed), and exit 6 names the line."""
    b = start_broker({"server": {"max_message_bytes": 1000}})
    sub = b.spawn("sub", "long", "-C", "2")
    b.wait_subscribers(1)
    data = b"one\ntwo\n" + b"x" * 5000 + (b"\nthree\n" if newline else b"")
    res = b.cli("pub", "long", "-l", "-q", str(qos), input=data)
    assert res.returncode == Exit.TOO_LARGE, res.stderr
    one_line(res.stderr)
    err = res.stderr.decode()
    assert "line 3 of stdin holds more than 1000 bytes" in err, err
    assert ("2 of 2 line(s) confirmed" if qos else "the 2 line(s) before it") in err, err
    assert sub.communicate(timeout=10)[0] == b"one\ntwo\n"


def test_odd_arguments_and_a_closed_stdin_are_one_line_and_their_code(start_broker) -> None:
    """D09 and the CLI parts of D08: bytes that are not UTF-8 in a filter, a template or an
    API key, a closed stdin (`<&-`), a --interval of nan/inf/1e300, a host name the resolver
    cannot take (a label over 63 characters, not UTF-8) ended in 'internal error', exit 1."""
    b = start_broker()
    long_host = "a" * 70 + ".example"
    cases = [
        ("blipmq sub $'bad\\xff' -W 1s", Exit.BAD_NAME),
        ("blipmq pub t x --api-key $'\\xff'", Exit.USAGE),
        ("BLIPMQ_API_KEY=$'\\xff' blipmq pub t x", Exit.USAGE),
        ("blipmq pub t - <&-", Exit.USAGE),
        ("blipmq pub t -s <&-", Exit.USAGE),
        ("blipmq pub t -l <&-", Exit.USAGE),
        ("blipmq pubfile t - <&-", Exit.USAGE),
        ("blipmq stats --watch --interval nan", Exit.USAGE),
        ("blipmq stats --watch --interval inf", Exit.USAGE),
        ("blipmq stats --watch --interval 1e300", Exit.USAGE),
        (f"blipmq pub t x --addr {long_host}:{b.port}", Exit.USAGE),
        (f"blipmq sub t -W 1s --addr $'\\xff:{b.port}'", Exit.USAGE),
    ]
    for script, code in cases:
        res = b.shell(script, timeout=15)
        assert res.returncode == code, (script, res.stderr)
        one_line(res.stderr)
    # a template's own bytes are written as given, not UTF-8 ones included
    assert b.cli("pub", "u", "x").returncode == 0
    res = b.shell("blipmq sub u --from earliest -e -F $'%p\\xff'")
    assert (res.returncode, res.stdout) == (0, b"x\xff\n"), res.stderr
    # with stderr closed the exit code still tells
    assert b.shell("blipmq pub '' x 2>&-").returncode == Exit.BAD_NAME


def test_commands_with_stderr_closed_still_do_their_work(start_broker, tmp_path: Path) -> None:
    """h26 D1: `2>&-` (cron jobs, daemon wrappers) made `sub`, `pubfile` and `pub -f` exit 1
    ("internal error") before doing anything: they asked a closed stderr whether it is a
    terminal. Now they work, and only what they would say goes unsaid."""
    b = start_broker()
    (tmp_path / "m").write_bytes(b"from a file")
    res = b.shell(f"blipmq pubfile t {tmp_path / 'm'} -r 2>&- && blipmq sub t -C 1 2>&-")
    assert res.returncode == 0, res
    assert res.stdout == b"from a file\n"
    res = b.shell(f"blipmq pub t2 -r -f {tmp_path / 'm'} 2>&- && blipmq sub t2 -C 1 2>&-")
    assert (res.returncode, res.stdout) == (0, b"from a file\n"), res


def test_help_and_wal_output_into_a_reader_that_goes_away_exit_0(
        start_broker, tmp_path: Path) -> None:
    """h26 D3: `blipmq --help | head -1` and `wal inspect DIR | head -1` exited 1 (the help
    framework's answer to EPIPE), which the README documents as a bug: a reader that
    went away is exit 0, as for `sub | head`."""
    b = start_broker()
    assert b.cli("pub", "t", "x", "--qos", "1").returncode == 0
    for command in ("blipmq --help", "blipmq sub --help", "blipmq pub -h",
                    f"blipmq wal inspect {b.data_dir}"):
        res = b.shell(f"{command} | head -c 1 >/dev/null")  # pipefail: the command's code
        assert res.returncode == 0, (command, res.stderr)
    assert b.shell("blipmq sub --help > /dev/full").returncode == Exit.USAGE


def test_a_nul_in_a_setting_and_a_broken_ipv6_bind_are_config_errors(tmp_path: Path) -> None:
    """h26 D4: a NUL in storage.data_dir gave a traceback and exit 1; `--bind '[::1'` was
    taken as host "[:" port 1 (the log recovered in ./data, then exit 1). Both are config
    errors now: one line, exit 2, before anything is made."""
    config = tmp_path / "nul.toml"
    config.write_text('[storage]\ndata_dir = "/tmp/x\\u0000y"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLIPMQ_")}
    res = subprocess.run([BLIPMQ, "start", "--config", str(config)], capture_output=True,
                         timeout=30, env=env, cwd=tmp_path)
    assert res.returncode == 2 and b"storage.data_dir" in res.stderr and b"NUL" in res.stderr
    one_line(res.stderr)
    for bind in ("[::1", "[::1]]:7", "[]:7"):
        res = subprocess.run([BLIPMQ, "start", "--bind", bind, "--data-dir",
                              str(tmp_path / "d")], capture_output=True, timeout=30, env=env,
                             cwd=tmp_path)
        assert res.returncode == 2 and b"--bind" in res.stderr, (bind, res.stderr)
        one_line(res.stderr)
    assert not (tmp_path / "d").exists() and not (tmp_path / "data").exists()

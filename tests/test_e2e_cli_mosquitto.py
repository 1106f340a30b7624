"""mosquitto_pub/mosquitto_sub habits typed at `blipmq`: an option blipmq does not take
(`-h HOST`, `-p PORT`, `-u`/`-P`, `-i`, `-n`, ...) is one line saying what to type instead
and exit 2, never the help page with exit 0 and nothing published; `-h` alone is the help."""

from __future__ import annotations

import pytest

from blipmq_cli.exits import Exit

CASES = [
    (("pub", "-h", "127.0.0.1", "-t", "hp/a", "-m", "hello"), "-h HOST is --addr HOST:PORT"),
    (("sub", "-t", "hp/#", "-h", "127.0.0.1", "-C", "1"), "-h HOST is --addr HOST:PORT"),
    (("pub", "-p", "1883", "-t", "hp/a", "-m", "x"), "-p PORT is --addr HOST:PORT"),
    (("pub", "-p1883", "hp/a", "x"), "-p PORT is --addr HOST:PORT"),
    (("pub", "hp/a", "x", "-u", "bob", "-P", "secret"), "are --api-key KEY"),
    (("pub", "-i", "me", "-t", "hp/a", "-m", "x"), "-i CLIENT_ID is not needed here"),
    (("sub", "-c", "-i", "me", "-t", "hp/#"), "-c (a persistent session) is sub --group"),
    (("pub", "-t", "hp/a", "-n"), "an empty argument here: blipmq pub TOPIC ''"),
    (("pub", "--host=gw", "hp/a", "x"), "--host HOST is --addr HOST:PORT"),
    (("unsub", "t", "--group", "g", "-h", "gw"), "-h HOST is --addr HOST:PORT"),
]


@pytest.mark.parametrize(("args", "hint"), CASES)
def test_mosquitto_options_say_what_to_type_instead(start_broker, args, hint) -> None:
    b = start_broker()
    res = b.cli(*args)
    err = res.stderr.decode()
    assert res.returncode == Exit.USAGE, (res.returncode, err, res.stdout[:200])
    assert err.startswith(f"blipmq {args[0]}: mosquitto's ") and hint in err, err
    assert err.count("\n") == 1 and res.stdout == b""
    assert b.metric("blipmq_messages_published_total") == 0


def test_h_alone_is_still_the_help_and_mosquittos_shared_options_still_work(
        start_broker) -> None:
    b = start_broker()
    for args in (("pub", "-h"), ("sub", "-h"), ("pub", "--help")):
        res = b.cli(*args)
        assert res.returncode == 0 and b"Usage: blipmq" in res.stdout, res
    res = b.cli("pub", "-t", "hp/a", "-m", "hello", "-q", "1", "-r")
    assert res.returncode == 0, res.stderr
    res = b.cli("sub", "-t", "hp/#", "-C", "1", "-W", "5", "-v")
    assert res.returncode == 0 and res.stdout == b"hp/a hello\n", res


def test_share_spelling_is_refused_with_the_group_way(start_broker) -> None:
    """`sub '$share/g/t'` was a native filter that can never match (nothing is published
    to `$share/` topics): it waited for ever. Now exit 2 at once, naming `--group g`."""
    b = start_broker()
    for args, said in ((("sub", "$share/g/shx"), "here it is blipmq sub --group g 'shx'"),
                       (("sub", "-t", "$share/g/a/#", "-C", "1"), "--group g 'a/#'"),
                       (("sub", "$share/g"), "give the filter and --group NAME")):
        res = b.cli(*args, timeout=10)
        err = res.stderr.decode()
        assert res.returncode == Exit.USAGE and err.count("\n") == 1, (res.returncode, err)
        assert err.startswith("blipmq: '$share/g") and said in err, err
    sub = b.spawn("sub", "--group", "g", "shx", "-C", "1")
    b.wait_subscribers(1)
    assert b.cli("pub", "shx", "one").returncode == 0
    out, _ = sub.communicate(timeout=10)
    assert out == b"one\n"


def test_an_options_value_or_what_follows_dashdash_is_not_a_mosquitto_option(
        start_broker) -> None:
    """``-m -info`` is the message '-info' and ``--key -k1`` the key '-k1' (``-rm -info``
    too, h36 F7: short flags run together, the last one taking a value): no hint about
    mosquitto's -i / -k (argparse's own one line, as before the hints); after ``--`` a
    payload or topic starting with '-' is published as before."""
    b = start_broker()
    for args in (("pub", "-t", "hp/x", "-m", "-info"), ("pub", "hp/x", "--key", "-k1", "v"),
                 ("pub", "-t", "hp/x", "-m", "-hot"), ("sub", "hp/x", "--group", "-p1"),
                 ("pub", "-t", "hp/x", "-rm", "-info"), ("pub", "-t", "hp/x", "-rm", "-kx")):
        res = b.cli(*args)
        err = res.stderr.decode()
        assert res.returncode == Exit.USAGE and "mosquitto" not in err, err
        assert err.count("\n") == 1, err
    for args in (("pub", "-t", "hp/x", "-m=-info", "-r"), ("pub", "hp/y", "-r", "--", "-p")):
        res = b.cli(*args)
        assert res.returncode == 0, res.stderr
    for topic, want in (("hp/x", b"-info"), ("hp/y", b"-p")):
        res = b.cli("sub", topic, "-C", "1", "-W", "5")
        assert res.returncode == 0 and res.stdout == want + b"\n", res

"""Configuration: defaults < file < environment < overrides, and one clear error per problem."""

import hashlib
from pathlib import Path

import pytest

from blipmq_server import config
from blipmq_server.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def load_text(tmp_path: Path, text: str, **kw) -> config.Config:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return config.load(path, env=kw.pop("env", {}), **kw)


def error_of(fn) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn()
    return info.value


def test_defaults() -> None:
    cfg = config.load(None, env={})
    assert cfg.server.port == 7878 and cfg.server.host == "127.0.0.1"
    assert cfg.queues.overflow == "block" and cfg.queues.capacity == 8192
    assert cfg.auth.api_keys == ()


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    text = "[server]\nport = 7001\nmax_connections = 5\n[queues]\noverflow = \"drop_new\"\n"
    cfg = load_text(tmp_path, text)
    assert (cfg.server.port, cfg.server.max_connections) == (7001, 5)
    cfg = load_text(tmp_path, text, env={"BLIPMQ_SERVER_PORT": "7002"})
    assert cfg.server.port == 7002 and cfg.server.max_connections == 5
    cfg = load_text(tmp_path, text, env={"BLIPMQ_SERVER_PORT": "7002"},
                    overrides={"server.port": "7003", "queues.capacity": 9})
    assert cfg.server.port == 7003 and cfg.queues.capacity == 9
    assert cfg.queues.overflow == "drop_new"


def test_env_parsing() -> None:
    cfg = config.load(None, env={
        "BLIPMQ_AUTH_API_KEYS": "k1, k2,,", "BLIPMQ_METRICS_ENABLED": "no",
        "BLIPMQ_ADDR": "ignored:1", "BLIPMQ_API_KEY": "ignored", "HOME": "/root",
    })
    assert cfg.auth.api_keys == tuple(  # kept hashed, as [[auth.keys]] are
        "blake2b:" + hashlib.blake2b(k).hexdigest() for k in (b"k1", b"k2"))
    assert cfg.metrics.enabled is False


def test_api_keys_are_never_kept_in_clear(tmp_path: Path) -> None:
    secret = "s3cret-" + "x" * 20
    path = tmp_path / "c.toml"
    path.write_text(f'[auth]\napi_keys = ["{secret}"]\n')
    for cfg in (config.load(path, env={}), config.load(None, env={"BLIPMQ_AUTH_API_KEYS": secret}),
                config.load(None, env={}, overrides={"auth.api_keys": (secret,)})):
        assert secret not in repr(cfg) and cfg.auth.enabled
    hashed = config.load(path, env={}).auth.api_keys[0]
    assert config.load(None, env={}, overrides={"auth.api_keys": (hashed,)}).auth.api_keys == (
        hashed,)  # a hash given stays that hash


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\ncolour = 1\n", "server.colour: unknown key"),
        ("[srv]\nport = 1\n", "[srv]: unknown section"),
        ("[server]\nport = 70000\n", "server.port: 70000 is out of range (0-65535)"),
        ("[server]\nport = true\n", "server.port: expected an integer, got boolean True"),
        ("[queues]\ncapacity = \"abc\"\n", "queues.capacity: expected an integer, got string"),
        ("[queues]\noverflow = \"dropp\"\n",
         "queues.overflow: 'dropp' is not one of drop_oldest, drop_new, block"),
        ("[queues]\ncapacity = 0\n", "queues.capacity: 0 is out of range"),
        ("[auth]\napi_keys = \"k\"\n", "auth.api_keys: expected a list of strings"),
        ("[server]\nhost = \"\"\n", "server.host: must not be empty"),
        ("[delivery]\nmax_batch_bytes = 10\n", "delivery.max_batch_bytes: 10 is out of range"),
        ("[server]\nport = \n", "TOML syntax error at line 2"),
        ("server = 1\n", "[server]: must be a table"),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    err = error_of(lambda: load_text(tmp_path, text))
    assert needle in str(err)
    assert "\n" not in str(err)


def test_env_errors_name_the_variable() -> None:
    err = error_of(lambda: config.load(None, env={"BLIPMQ_SERVER_PORT": "http"}))
    assert str(err).startswith("BLIPMQ_SERVER_PORT: expected an integer")
    err = error_of(lambda: config.load(None, env={"BLIPMQ_SERVER_PROT": "1"}))
    assert str(err).startswith("BLIPMQ_SERVER_PROT: unknown setting")
    err = error_of(lambda: config.load(None, env={"BLIPMQ_METRICS_ENABLED": "maybe"}))
    assert "expected true or false" in str(err)


def test_misspelled_section_names_are_reported_not_refused() -> None:
    """A ``BLIPMQ_*`` name outside every section that looks like a setting is reported
    (it was ignored without a word); other programs' names are left alone, and so is what
    ``blipmq sub --exec`` gives its children, one of which starts with ``BLIPMQ_DELIVERY_``
    (``load`` refused that as an unknown setting)."""
    env = {"BLIPMQ_SERVR_PORT": "7000", "BLIPMQ_WAL_FSYNC": "always", "BLIPMQ_ADDR": "x:1",
           "BLIPMQ_DELIVERY_COUNT": "2", "BLIPMQ_TOPIC": "a", "BLIPMQ_MY_SCRIPT": "1",
           "HOME": "/root"}
    assert config.load(None, env=env).wal.fsync == "always"
    assert config.env_doubts(env) == [
        "BLIPMQ_SERVR_PORT is not a setting and is ignored; did you mean BLIPMQ_SERVER_PORT?"]
    assert config.env_doubts({"BLIPMQ_MQT_ENABLED": "1", "BLIPMQ_RETAIN_MAX_TOPICS": "1"}) == [
        "BLIPMQ_MQT_ENABLED is not a setting and is ignored; did you mean BLIPMQ_MQTT_ENABLED?",
        "BLIPMQ_RETAIN_MAX_TOPICS is not a setting and is ignored; did you mean "
        "BLIPMQ_RETAINED_MAX_TOPICS?"]


def test_override_errors() -> None:
    assert "unknown key" in str(error_of(lambda: config.load(None, env={},
                                                             overrides={"server.nope": 1})))
    err = error_of(lambda: config.load(None, env={}, overrides={"log.level": "loud"}))
    assert str(err).startswith("log.level: 'loud' is not one of")


def test_missing_file() -> None:
    err = error_of(lambda: config.load("/nonexistent/blipmq.toml", env={}))
    assert "not found" in str(err)


def test_schema_covers_every_option() -> None:
    assert sorted(config.option_fields()) == sorted(k.dotted for k in config.SCHEMA)


def test_default_text_is_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text(config.default_text())
    # the written file differs from the code's defaults in one key only: MQTT is on there
    assert config.load(path, env={}) == config.load(None, env={},
                                                    overrides={"mqtt.enabled": True})


def test_shipped_config_is_the_default_text() -> None:
    assert (ROOT / "config" / "blipmq.toml").read_text() == config.default_text()


def test_docs_describe_every_key() -> None:
    doc = (ROOT / "docs" / "CONFIG.md").read_text()
    for key in config.SCHEMA:
        assert f"`{key.name}`" in doc and f"`{key.env}`" in doc, key.dotted


def test_write_default_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "new.toml"
    config.write_default(path)
    assert path.read_text() == config.default_text()
    assert "already exists" in str(error_of(lambda: config.write_default(path)))


def test_combinations_that_cannot_work_are_refused() -> None:
    # a queue smaller than the largest message could never hold it
    err = error_of(lambda: config.load(None, env={}, overrides={
        "queues.capacity_bytes": 1 << 20, "server.max_message_bytes": 2 << 20}))
    assert err.key == "queues.capacity_bytes" and "max_message_bytes" in str(err)
    ok = config.load(None, env={}, overrides={
        "queues.capacity_bytes": 2 << 20, "server.max_message_bytes": 2 << 20})
    assert ok.queues.capacity_bytes == ok.server.max_message_bytes


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "gateway.lan"])
def test_mqtt_beyond_loopback_needs_auth_or_allow_anonymous(host: str) -> None:
    on = {"mqtt.enabled": True, "mqtt.host": host}
    err = error_of(lambda: config.load(None, env={}, overrides=on))
    assert err.key == "mqtt.host" and "allow_anonymous" in str(err)
    assert config.load(None, env={}, overrides={**on, "mqtt.allow_anonymous": True})
    assert config.load(None, env={}, overrides={**on, "auth.api_keys": ("k",)})
    assert config.load(None, env={}, overrides={"mqtt.host": host})  # MQTT off: no matter


@pytest.mark.parametrize("host", ["127.0.0.1", "127.5.5.5", "::1", "localhost"])
def test_mqtt_on_loopback_without_auth_is_fine(host: str) -> None:
    assert config.load(None, env={}, overrides={"mqtt.enabled": True, "mqtt.host": host})


def test_mqtt_bind_flag() -> None:
    from blipmq_server.daemon import overrides

    assert overrides(mqtt_bind="127.0.0.1:0") == {
        "mqtt.host": "127.0.0.1", "mqtt.port": "0", "mqtt.enabled": True}
    assert overrides(mqtt_bind="off") == {"mqtt.enabled": False}
    cfg = config.load(None, env={}, overrides=overrides(mqtt_bind="[::1]:1884"))
    assert (cfg.mqtt.enabled, cfg.mqtt.host, cfg.mqtt.port) == (True, "::1", 1884)
    with pytest.raises(ConfigError):
        overrides(mqtt_bind="1883")


def test_the_written_bridge_example_is_a_valid_bridge(tmp_path: Path) -> None:
    text = config.default_text()
    example = text[text.index("# [[bridge]]"):]
    path = tmp_path / "bridge.toml"
    path.write_text("\n".join(line[2:] for line in example.splitlines()))
    loaded = config.load(path, env={})
    (bridge,) = loaded.bridges
    assert (bridge.name, bridge.addresses, bridge.tls) == (
        "cloud", (("mqtt.example.net", 8883),), True)
    assert [r.text() for r in bridge.rules] == ['sensors/# out 1 "" site17/',
                                                'cmd/# in 1 "" site17/']


def test_a_config_file_is_read_only_to_a_bound(tmp_path: Path) -> None:
    """``--config /dev/zero`` (or a log given by mistake) read without end, gigabytes in
    seconds; a config file is read up to 4 MiB and refused past it."""
    big = tmp_path / "big.toml"
    big.write_text("#" * (5 << 20))
    assert "is over 4 MiB" in str(error_of(lambda: config.load(big, env={})))
    assert "is over 4 MiB" in str(error_of(lambda: config.load("/dev/zero", env={})))


def test_a_bridge_rule_too_long_for_max_topic_bytes_is_named_in_one_short_line(
        tmp_path: Path) -> None:
    """The error names the bridge as every bridge error does, and quotes the start of the
    rule, not its 2 kB (it said `bridge[0]: 'aaa...(2,000 more)... out 1 "" ""': ...`)."""
    path = tmp_path / "long.toml"
    path.write_text('[server]\nmax_topic_bytes = 1024\n[[bridge]]\nname = "c"\n'
                    'addresses = ["127.0.0.1:1883"]\n'
                    f'topics = ["{"a" * 2000} out 1"]\n')
    text = str(error_of(lambda: config.load(path, env={})))
    assert text.startswith("bridge[0] (c): the rule 'aaaa"), text
    assert "the local filter is 2000 bytes long, server.max_topic_bytes is 1024" in text
    assert len(text) < 200, text


def test_a_keys_own_limits_are_integers_in_range() -> None:
    base = {"name": "hall", "hash": "blake2b:" + "ab" * 64}
    ok = config.load(None, env={}, overrides={"auth.keys": [
        {**base, "max_retained_topics": 8000, "max_sessions": 0}]})
    (spec,) = ok.auth.keys
    assert spec.limits == (None, 0, 8000, None)  # absent: the default share
    for bad in ({"max_sessions": -1}, {"max_durable_groups": True},
                {"max_retained_bytes": "1 MiB"}, {"max_retained_topics": 10_000_001}):
        err = error_of(lambda bad=bad: config.load(None, env={}, overrides={
            "auth.keys": [{**base, **bad}]}))
        assert str(err).startswith(f"auth.keys[0] (hall): {next(iter(bad))} must be an integer "
                                   "from 0 to "), err
    err = error_of(lambda: config.load(None, env={}, overrides={
        "auth.keys": [{**base, "max_groups": 1}]}))
    assert "unknown field 'max_groups'" in str(err) and "max_retained_bytes" in str(err)

"""``blipmq start``: configuration, logging, the data directory lock, then the Trio server.

Exit codes: 0 after a clean shutdown, 1 when the broker cannot run (address in use, data
directory locked or not writable, a log of a newer format), 2 for a configuration error.
Every failure is one line on stderr.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
from typing import IO, Any

from blipmq_server.errors import ConfigError, WalError

# logging is imported by ``logs``, after ``deferred.defer``: it imports traceback, deferred.


def _split_bind(value: str, key: str) -> dict[str, object]:
    host, sep, port = value.rpartition(":")
    inner = host[1:-1]
    bracketed = (host[:1] == "[" and host[-1:] == "]" and bool(inner)
                 and "[" not in inner and "]" not in inner)
    if not sep or not host or (("[" in host or "]" in host) and not bracketed):
        raise ConfigError(f"{value!r} is not HOST:PORT (an IPv6 address: [ADDRESS]:PORT)",
                          key)
    return {"host": inner if bracketed else host, "port": port}


def overrides(
    data_dir: str | None = None,
    bind: str | None = None,
    metrics_bind: str | None = None,
    log_level: str | None = None,
    log_format: str | None = None,
    mqtt_bind: str | None = None,
) -> dict[str, object]:
    """Flags of ``blipmq start`` as dotted config keys."""
    out: dict[str, object] = {}
    if data_dir is not None:
        out["storage.data_dir"] = data_dir
    if bind is not None:
        out.update({f"server.{k}": v for k, v in _split_bind(bind, "--bind").items()})
    if metrics_bind is not None:
        parts = _split_bind(metrics_bind, "--metrics-bind")
        out.update({f"metrics.{k}": v for k, v in parts.items()})
    if mqtt_bind is not None:
        if mqtt_bind.strip().lower() == "off":
            out["mqtt.enabled"] = False
        else:
            parts = _split_bind(mqtt_bind, "--mqtt-bind")
            out.update({f"mqtt.{k}": v for k, v in parts.items()})
            out["mqtt.enabled"] = True
    if log_level is not None:
        out["log.level"] = log_level
    if log_format is not None:
        out["log.format"] = log_format
    return out


def lock_data_dir(path: str) -> tuple[int, IO[str]]:
    """Create the data directory and hold its lock for the life of the process: an flock
    on the directory itself, which a cleanup cannot delete and create again as it can a
    file, and one on ``blipmq.lock``, which names the owner's PID (and is what brokers
    before this one lock). Returns both, for ``unlock_data_dir``."""
    os.makedirs(path, exist_ok=True)
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        handle = open(os.path.join(path, "blipmq.lock"), "a+")
    except OSError:
        os.close(directory)
        raise
    try:
        fcntl.flock(directory, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "?"
        handle.close()
        os.close(directory)
        raise OSError(f"data directory {path} is in use by another broker (pid {owner})") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return directory, handle


def unlock_data_dir(lock: tuple[int, IO[str]]) -> None:
    """Give the data directory's locks back (closing their descriptors)."""
    directory, handle = lock
    handle.close()
    os.close(directory)


def start(config: str | None = None, **flags: str | None) -> int:
    from blipmq_server import deferred

    deferred.defer()  # before the broker's modules and trio: what they need only later waits
    from blipmq_server import config as config_module
    from blipmq_server import logs, startup

    startup.hold()  # (main did already: this is for callers that did not)
    startup.forget_reloads()  # the file is read now: a SIGHUP until here is answered
    try:
        cfg = config_module.load(config, overrides=overrides(**flags))
    except ConfigError as exc:
        sys.stderr.write(f"blipmq: config error: {exc}\n")
        return 2
    tls_bridges = [(i, spec) for i, spec in enumerate(cfg.bridges) if spec.tls]
    if config_module.tls_listeners(cfg) or tls_bridges:
        # the certificate files' contents, before anything (the server builds its contexts
        # again from the files: these are only checks)
        from blipmq_server.server.tls import client_context, context  # ssl: only with TLS

        try:
            if config_module.tls_listeners(cfg):
                context(cfg.tls)
            for i, spec in tls_bridges:
                client_context(spec, f"bridge[{i}] ({spec.name})")
        except ConfigError as exc:
            sys.stderr.write(f"blipmq: config error: {exc}\n")
            return 2
    logs.setup(cfg.log.level, cfg.log.format)
    for line in config_module.env_doubts():
        import logging  # logs.setup has it loaded; not at the top (deferred.py's order)

        logging.getLogger("blipmq").warning("config: %s", line)
    stop = startup.stop_held()
    if stop:  # before anything was started: nothing to drain
        import logging

        logging.getLogger("blipmq").info("received %s during start-up: not started",
                                         signal.Signals(stop).name)
        return 0
    from blipmq_server import descriptors

    budget = descriptors.apply(cfg)  # the soft open-file limit up to the hard one
    if budget.warning:
        import logging

        logging.getLogger("blipmq").warning("%s", budget.warning)
    if budget.max_connections != cfg.server.max_connections:  # a reload keeps [server]
        cfg = cfg._replace(server=cfg.server._replace(max_connections=budget.max_connections))
    try:
        lock = lock_data_dir(cfg.storage.data_dir)
    except OSError as exc:
        sys.stderr.write(f"blipmq: cannot use data directory: {_why(exc)}\n")
        return 1

    import trio

    from blipmq_server.server.app import run

    def reload() -> Any:  # SIGHUP: the same file, environment and flags, read again
        return config_module.load(config, overrides=overrides(**flags), regular=True)

    # From here on the broker's own handling (app.run) decides what a signal does, and
    # takes what was held until it ran (startup.take). After the server has stopped they
    # are still held, never acted on: in the onefile executable a signal to the process
    # group arrives twice, and the forwarded copy can come after the broker has stopped,
    # where the default action would turn a clean exit 0 into death by signal.
    try:
        trio.run(run, cfg, reload)
    except (OSError, ConfigError, WalError, BaseExceptionGroup) as exc:
        refusal = _inner(exc, ConfigError)
        if refusal is not None:  # found only once the log was open (a bridge's group)
            sys.stderr.write(f"blipmq: config error: {refusal}\n")
            return 2
        unreadable = _inner(exc, WalError)
        if unreadable is not None:  # a log this broker must not repair (a newer format)
            sys.stderr.write(f"blipmq: cannot start: {unreadable}\n")
            return 1
        failure = _inner(exc, OSError)
        if failure is None:
            raise
        sys.stderr.write(f"blipmq: cannot start: {_why(failure)}\n")  # type: ignore[arg-type]
        return 1
    finally:
        unlock_data_dir(lock)
    return 0


def _why(exc: OSError) -> str:
    """An OS error as one line, naming the file when it is about one (a segment that
    cannot be read, a directory that cannot be written)."""
    if exc.strerror and exc.filename:
        return f"{exc.strerror}: {exc.filename}"
    return exc.strerror or str(exc)


def _inner(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The ``kind`` of error inside what trio raised (nurseries wrap errors in exception
    groups), or None."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _inner(inner, kind)
            if found is not None:
                return found
    return None

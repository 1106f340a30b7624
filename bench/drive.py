"""One side of a bench/compare.py workload, run as its own process, for any of the brokers.

    drive.py CLIENT sub  URL TOPIC N [EXTRA_FILTERS]  count N messages (latency, loss), then exit
    drive.py CLIENT pub  URL TOPIC N SIZE [RATE [TOPICS]]
                                              publish N messages; RATE msg/s open loop (0: flat
                                              out); TOPICS > 1 spreads them over TOPIC/0..TOPICS-1
    drive.py CLIENT durable URL TOPIC N SIZE  publish N confirmed-durable messages (blipmq QoS 1,
                                              nats JetStream), 100 at a time: send 100,
                                              wait for their 100 confirms, send the next
    drive.py CLIENT hold URL TOPIC C          keep C connections open, each subscribed to
                                              TOPIC/i, until stdin closes

CLIENT is blipmq (its client library), paho (mosquitto; also BlipMQ's MQTT listener in
compare.py's mqtt workloads), nats (nats-py) or redis (redis-py).
Topics and filters are given in MQTT's syntax (`/`, `+`, `#`); each client translates them:
nats subjects use `.`, `*` and `>`, and a redis filter with a wildcard becomes a PSUBSCRIBE
glob pattern (`*`). EXTRA_FILTERS more subscriptions on the subscriber's connection match
nothing the publisher sends (the cost curve's subscriptions axis).
Payloads carry blipmq bench's 16-byte header (send time, publisher, sequence), so the
subscriber measures latency and counts loss and duplicates the same way for every broker.
Sub workers print "ready" once subscribed; every worker ends with one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import threading
import time

from blipmq_cli.bench import HEADER, Histogram

IDLE = 3.0  # s without a message, after the first: the rest is lost
FIRST = 30.0  # s to wait for the first message
IN_FLIGHT = 100  # durable: confirmed publishes in flight, in lockstep batches


class Counter:
    """Latency histogram plus seen-marks for one publisher's sequence numbers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = bytearray(n)
        self.hist = Histogram()
        self.unique = self.duplicates = 0
        self.first = self.last = 0.0

    def take(self, payloads: list[bytes]) -> None:
        now = time.monotonic_ns()
        heads = list(map(HEADER.unpack_from, payloads))
        self.hist.add_all([now - head[0] for head in heads])
        seen, n = self.seen, self.n
        unique = 0
        for _, _, seq in heads:
            if seq < n and not seen[seq]:
                seen[seq] = 1
                unique += 1
        self.unique += unique
        self.duplicates += len(heads) - unique
        self.last = time.monotonic()
        self.first = self.first or self.last

    def done(self) -> bool:
        return self.unique >= self.n

    def result(self) -> dict:
        h = self.hist
        q = lambda x: None if h.total == 0 else round(h.quantile(x) / 1000, 1)  # noqa: E731
        return {"received": self.unique, "duplicates": self.duplicates, "first": self.first,
                "last": self.last, "p50_us": q(0.5), "p95_us": q(0.95), "p99_us": q(0.99),
                "max_us": round(h.max / 1000, 1) if h.total else None}


def ready() -> None:
    print("ready", flush=True)


def wait_done(counter: Counter) -> None:
    start = time.monotonic()
    while not counter.done():
        time.sleep(0.01)
        now = time.monotonic()
        if counter.last and now - counter.last > IDLE:
            return
        if not counter.last and now - start > FIRST:
            return


def payloads(n: int, size: int, rate: int):
    """Yield ``(index, payload)`` pairs, paced to ``rate``/s when it is not 0."""
    filler = b"x" * (size - HEADER.size)
    pack, clock = HEADER.pack, time.monotonic_ns
    if not rate:
        for i in range(n):
            yield i, pack(clock(), 0, i) + filler
        return
    interval = 1e9 / rate
    origin = clock()
    for i in range(n):
        due = origin + i * interval
        while (now := clock()) < due:
            if due - now > 200_000:
                time.sleep((due - now - 100_000) / 1e9)
        yield i, pack(clock(), 0, i) + filler


def extra_filters(topic: str, extra: int) -> list[str]:
    """``extra`` filters like ``topic`` (exact, or with ``+``) that match none of its traffic."""
    if "+" in topic:
        return [f"other/{i}/+" for i in range(extra)]
    return [f"{topic}-other/{i}" for i in range(extra)]


def chunks(items: list[str], size: int) -> list[list[str]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def topic_of(topic: str, topics: int, sep: str):
    if topics <= 1:
        return lambda i: topic
    names = [f"{topic}{sep}{t}" for t in range(topics)]
    return lambda i: names[i % topics]


# --- blipmq -------------------------------------------------------------------------------

def blipmq_sub(url: str, topic: str, n: int, extra: int = 0) -> dict:
    from blipmq_cli.client import Client

    client = Client(url)
    subscription = client.subscribe(topic)
    for other in extra_filters(topic, extra):
        client.subscribe(other)
    ready()
    counter = Counter(n)
    idle_deadline = time.monotonic() + FIRST
    while not counter.done() and time.monotonic() < idle_deadline:
        try:
            batch = subscription.next_batch(0.2)
        except TimeoutError:
            continue
        if batch:
            counter.take([d.payload for d in batch])
            idle_deadline = time.monotonic() + IDLE
    client.abort()
    return counter.result()


def blipmq_pub(url: str, topic: str, n: int, size: int, rate: int = 0, topics: int = 1) -> dict:
    from blipmq_cli.client import Client

    client = Client(url)
    name = topic_of(topic, topics, "/")
    start = time.monotonic()
    if rate:
        for i, p in payloads(n, size, rate):
            client.publish(name(i), p)
    else:
        chunk: list = []
        for i, p in payloads(n, size, 0):
            chunk.append((name(i), p))
            if len(chunk) == 1000:
                client.publish_many(chunk)
                chunk = []
        client.publish_many(chunk)
    client.flush(timeout=300)
    end = time.monotonic()
    client.close()
    return {"start": start, "end": end, "sent": n}


def blipmq_durable(url: str, topic: str, n: int, size: int) -> dict:
    from blipmq_cli.client import Client
    from blipmq_server.protocol.codec import Message

    client = Client(url)
    start = time.monotonic()
    batch: list = []
    for _, p in payloads(n, size, 0):
        batch.append(Message(topic, p, 1))
        if len(batch) == IN_FLIGHT:  # as nats_durable: send 100, wait for their 100 confirms
            client.publish_many(batch)
            client.wait_confirms(timeout=60)
            batch = []
    client.publish_many(batch)
    client.wait_confirms(timeout=60)
    end = time.monotonic()
    confirmed = client.confirmed
    client.close()
    return {"start": start, "end": end, "sent": n, "confirmed": confirmed}


def blipmq_hold(url: str, topic: str, connections: int) -> dict:
    from blipmq_cli.client import Client

    clients = []
    for i in range(connections):
        c = Client(url)
        c.subscribe(f"{topic}/{i}")
        clients.append(c)
    ready()
    sys.stdin.read()
    for c in clients:
        c.abort()
    return {"held": connections}


# --- paho-mqtt (mosquitto) ------------------------------------------------------------------

def _paho(url: str, keepalive: int = 60):
    import paho.mqtt.client as mqtt

    host, port = url.rsplit(":", 1)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    client.max_queued_messages_set(0)
    client.connect(host, int(port), keepalive=keepalive)
    return client


def paho_sub(url: str, topic: str, n: int, extra: int = 0) -> dict:
    counter = Counter(n)
    client = _paho(url)
    packets = chunks([topic, *extra_filters(topic, extra)], 100)  # 100 filters a SUBSCRIBE
    acks: list[int] = []
    subscribed = threading.Event()

    def on_subscribe(*_: object) -> None:
        acks.append(1)
        if len(acks) == len(packets):
            subscribed.set()

    client.on_message = lambda c, u, m: counter.take([m.payload])
    client.on_subscribe = on_subscribe
    client.loop_start()
    for packet in packets:
        client.subscribe([(f, 0) for f in packet])
    if not subscribed.wait(FIRST):
        raise SystemExit("paho: no SUBACK")
    ready()
    wait_done(counter)
    client.loop_stop()
    client.disconnect()
    return counter.result()


def paho_pub(url: str, topic: str, n: int, size: int, rate: int = 0, topics: int = 1) -> dict:
    client = _paho(url)
    client.loop_start()
    name = topic_of(topic, topics, "/")
    start = time.monotonic()
    info = None
    for i, p in payloads(n, size, rate):
        info = client.publish(name(i), p, qos=0)
    if info is not None:
        info.wait_for_publish(300)
    end = time.monotonic()
    client.disconnect()
    client.loop_stop()
    return {"start": start, "end": end, "sent": n}


def paho_hold(url: str, topic: str, connections: int) -> dict:
    """Idle MQTT connections, no network thread each: they only read their SUBACK (with
    loop_read/loop_write: paho's loop() uses select(), which stops at descriptor 1,024)."""
    clients, acked = [], set()
    for i in range(connections):
        c = _paho(url, keepalive=3600)  # idle for minutes without a PINGREQ
        c.on_subscribe = lambda cl, *a: acked.add(id(cl))
        c.subscribe(f"{topic}/{i}", qos=0)
        clients.append(c)
    deadline = time.monotonic() + FIRST
    while len(acked) < connections and time.monotonic() < deadline:
        for c in clients:
            if id(c) not in acked:
                c.loop_write()
                c.loop_read()
        time.sleep(0.01)
    ready()
    sys.stdin.read()
    for c in clients:
        c.disconnect()
    return {"held": len(acked)}


# --- nats-py --------------------------------------------------------------------------------

def subject(topic: str) -> str:
    """An MQTT-style topic or filter as a NATS subject."""
    return topic.replace("/", ".").replace("+", "*").replace("#", ">")


def nats_sub(url: str, topic: str, n: int, extra: int = 0) -> dict:
    import nats

    counter = Counter(n)

    async def run() -> None:
        nc = await nats.connect(f"nats://{url}")
        async def take(m) -> None:
            counter.take([m.data])

        await nc.subscribe(subject(topic), cb=take)
        for other in extra_filters(topic, extra):
            await nc.subscribe(subject(other))
        await nc.flush(timeout=FIRST)
        ready()
        start = time.monotonic()
        while not counter.done():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            if (counter.last and now - counter.last > IDLE) or (
                    not counter.last and now - start > FIRST):
                break
        await nc.close()

    asyncio.run(run())
    return counter.result()


def nats_pub(url: str, topic: str, n: int, size: int, rate: int = 0, topics: int = 1) -> dict:
    import nats

    async def run() -> dict:
        nc = await nats.connect(f"nats://{url}", pending_size=64 * 1024 * 1024)
        name = topic_of(subject(topic), topics, ".")
        start = time.monotonic()
        for i, p in payloads(n, size, rate):
            await nc.publish(name(i), p)
            if rate:
                await nc.flush()
        await nc.flush(timeout=300)
        end = time.monotonic()
        await nc.close()
        return {"start": start, "end": end, "sent": n}

    return asyncio.run(run())


def nats_durable(url: str, topic: str, n: int, size: int) -> dict:
    import nats

    async def run() -> dict:
        nc = await nats.connect(f"nats://{url}")
        js = nc.jetstream()
        name = subject(topic)
        await js.add_stream(name="BENCH", subjects=[name])
        start = time.monotonic()
        confirmed = 0
        batch: list = []
        for _, p in payloads(n, size, 0):
            batch.append(js.publish(name, p, timeout=60))
            if len(batch) == IN_FLIGHT:
                confirmed += len(await asyncio.gather(*batch))
                batch = []
        confirmed += len(await asyncio.gather(*batch))
        end = time.monotonic()
        await nc.close()
        return {"start": start, "end": end, "sent": n, "confirmed": confirmed}

    return asyncio.run(run())


def nats_hold(url: str, topic: str, connections: int) -> dict:
    import nats

    async def run() -> dict:
        clients = []
        for i in range(connections):
            nc = await nats.connect(f"nats://{url}")
            await nc.subscribe(subject(f"{topic}/{i}"))
            await nc.flush()
            clients.append(nc)
        ready()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for nc in clients:
            await nc.close()
        return {"held": len(clients)}

    return asyncio.run(run())


# --- redis-py -------------------------------------------------------------------------------

def _redis(url: str, connections: int = 10):
    import redis

    host, port = url.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), max_connections=connections)


def redis_subscribe(pubsub, filters: list[str]) -> int:
    """SUBSCRIBE the exact filters, PSUBSCRIBE the others as glob patterns, 1,000 a
    command; wait for every confirmation and return how many came."""
    exact = [f for f in filters if "+" not in f and "#" not in f]
    patterns = [f.replace("+", "*").replace("#", "*") for f in filters if f not in exact]
    for names in chunks(exact, 1000):
        pubsub.subscribe(*names)
    for names in chunks(patterns, 1000):
        pubsub.psubscribe(*names)
    confirmed = 0
    deadline = time.monotonic() + FIRST
    while confirmed < len(filters) and time.monotonic() < deadline:
        m = pubsub.get_message(timeout=1)
        confirmed += m is not None and m["type"] in ("subscribe", "psubscribe")
    return confirmed


def redis_sub(url: str, topic: str, n: int, extra: int = 0) -> dict:
    r = _redis(url)
    pubsub = r.pubsub()
    redis_subscribe(pubsub, [topic, *extra_filters(topic, extra)])
    ready()
    counter = Counter(n)
    idle_deadline = time.monotonic() + FIRST
    while not counter.done() and time.monotonic() < idle_deadline:
        m = pubsub.get_message(timeout=0.2)
        if m is not None and m["type"] in ("message", "pmessage"):
            counter.take([m["data"]])
            idle_deadline = time.monotonic() + IDLE
    pubsub.close()
    return counter.result()


def redis_pub(url: str, topic: str, n: int, size: int, rate: int = 0, topics: int = 1) -> dict:
    r = _redis(url)
    name = topic_of(topic, topics, "/")
    start = time.monotonic()
    if rate:
        for i, p in payloads(n, size, rate):
            r.publish(name(i), p)
    else:
        pipe = r.pipeline(transaction=False)
        for i, p in payloads(n, size, 0):
            pipe.publish(name(i), p)
            if len(pipe) == 1000:
                pipe.execute()
        pipe.execute()
    end = time.monotonic()
    r.close()
    return {"start": start, "end": end, "sent": n}


def redis_hold(url: str, topic: str, connections: int) -> dict:
    r = _redis(url, connections)
    held = [r.pubsub() for _ in range(connections)]  # a connection each
    confirmed = sum(redis_subscribe(p, [f"{topic}/{i}"]) for i, p in enumerate(held))
    ready()
    sys.stdin.read()
    for p in held:
        p.close()
    return {"held": confirmed}


def main() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # hold: 1,000 connections
    client, mode, url, topic, *rest = sys.argv[1:]
    nums = [int(x) for x in rest]
    fn = globals().get(f"{client}_{mode}")
    if fn is None:
        raise SystemExit(f"drive.py: no {mode} for {client}")
    print(json.dumps(fn(url, topic, *nums)), flush=True)


if __name__ == "__main__":
    main()

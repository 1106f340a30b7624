"""MQTT codec micro-benchmark: the cost of one QoS 1 PUBLISH each way; prints, never fails.

    .venv/bin/python bench/mqtt_codec.py [--rounds 7] [--packets 1000] [--iterations 200]

The packet is a QoS 1 PUBLISH of a 64-byte payload to a 20-byte topic (90 bytes on the
wire), the hot path of an MQTT front end:

  encode   ``encode_publish`` of the topic (already UTF-8), payload, QoS, flags and id;
  decode   ``Decoder.feed`` of a chunk holding ``--packets`` of them at once, then
           ``packets()``, per packet (the decoder reads a full socket buffer this way);
  decode1  the same, a chunk of one packet (a peer that sends one at a time).

Wall-clock time (``time.perf_counter_ns``) over many iterations, the best of several
rounds, with the garbage collector off while timing. Target on the reference machine:
1.5 us or less each way.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blipmq_server.mqtt.codec import Decoder, Publish, encode, encode_publish

TOPIC = "site/7/sensor/0042/t"  # 20 bytes
PAYLOAD = bytes(range(64))


def best_ns(run: Callable[[], None], per_call: int, iterations: int, rounds: int) -> float:
    """The best over ``rounds`` of the mean time of one unit (``run`` does ``per_call``)."""
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for _ in range(iterations):
                run()
            elapsed = time.perf_counter_ns() - t0
        finally:
            gc.enable()
        best = min(best, elapsed / (iterations * per_call))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--packets", type=int, default=1000, help="packets in a decoded chunk")
    parser.add_argument("--iterations", type=int, default=200, help="chunks per round")
    args = parser.parse_args()

    topic = TOPIC.encode()
    wire = encode_publish(topic, PAYLOAD, 1, False, False, 4242)
    assert wire == encode(Publish(TOPIC, PAYLOAD, 1, False, False, 4242))
    chunk = wire * args.packets
    expected = Publish(TOPIC, PAYLOAD, 1, False, False, 4242)

    def encode_many() -> None:
        for i in range(1, args.packets + 1):
            encode_publish(topic, PAYLOAD, 1, False, False, i)

    def decode_chunk() -> None:
        decoder = Decoder()
        decoder.feed(chunk)
        decoder.packets()

    def decode_single() -> None:
        decoder = Decoder()
        for _ in range(args.packets):
            decoder.feed(wire)
            decoder.packets()

    check = Decoder()
    check.feed(chunk)
    assert check.packets() == [expected] * args.packets and not check.buffered

    figures = {
        "encode": best_ns(encode_many, args.packets, args.iterations, args.rounds),
        "decode": best_ns(decode_chunk, args.packets, args.iterations, args.rounds),
        "decode1": best_ns(decode_single, args.packets, args.iterations, args.rounds),
    }
    print(f"QoS 1 PUBLISH, {len(topic)}-byte topic, {len(PAYLOAD)}-byte payload: "
          f"{len(wire)} bytes on the wire; best of {args.rounds} rounds, "
          f"Python {sys.version.split()[0]}")
    for name, ns in figures.items():
        print(f"  {name:<8} {ns:8.0f} ns per packet  ({1e9 / ns:,.0f} packets/s)")


if __name__ == "__main__":
    main()

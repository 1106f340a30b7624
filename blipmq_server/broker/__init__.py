"""The broker's domain: topics, subscriptions, consumer groups, bounded queues, TTL.

Pure and synchronous: never imports trio, never sleeps, never reads a clock (time arrives
as ``now_ms``). The Trio shell in ``blipmq_server.server`` drives it.
"""

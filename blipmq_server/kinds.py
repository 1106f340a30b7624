"""The kinds of write-ahead-log records, declared once.

The log validates them and hands non-MESSAGE records to their owner at recovery, the broker
writes them (``broker/durable.py`` owns the GROUP and ACK bodies), and readers (``blipmq``,
the Spark source) name them. Imports nothing, so every layer may use it.
"""

from __future__ import annotations

from enum import IntEnum


class Kind(IntEnum):
    MESSAGE = 1  # a published message: its body is the message's wire record
    GROUP = 2  # a durable group was created, deleted, went idle or was checkpointed
    ACK = 3  # a durable group's consumer acknowledged offsets
    RETAINED = 4  # a topic's retained value carried forward by maintenance (not a message)
    STATE = 5  # a protocol front end's saved state under a key (an MQTT persistent session)

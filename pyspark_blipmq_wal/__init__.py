"""Spark finds Python data sources in top-level modules named ``pyspark_*`` that expose
``DefaultSource``: this one makes ``format("blipmq-wal")`` work in any session, with no
``register()`` call, wherever BlipMQ's ``spark`` extra is installed."""

from spark_tools.source import WalSource as DefaultSource

__all__ = ["DefaultSource"]

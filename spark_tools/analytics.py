"""Fleet aggregates: plain DataFrame -> DataFrame functions over ``blipmq-wal`` records.

Each takes the records (the source's schema, ``source.DDL``) and returns a small frame
keyed by device first, so that every aggregate can be written partitioned by device and a
re-export of one device replaces only its rows. Topic filters of durable groups are matched
with the broker's rules (``+`` one level, ``#`` the rest, ``$`` topics only by name) as a
Spark SQL expression, not a Python UDF.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.window import Window

PERCENTILES = [0.5, 0.95, 0.99]


def messages(records: DataFrame) -> DataFrame:
    return records.where(F.col("kind") == "message")


def traffic(records: DataFrame) -> DataFrame:
    """Per device and topic: messages, payload bytes, payload size percentiles, QoS 1 share,
    first and last message."""
    sizes = F.percentile_approx("payload_size", PERCENTILES, 10_000)
    return (messages(records).groupBy("device", "topic")
            .agg(F.count("*").alias("messages"), F.sum("payload_size").alias("bytes"),
                 sizes.alias("_p"), F.sum(F.col("qos").cast("long")).alias("qos1"),
                 F.min("timestamp").alias("first"), F.max("timestamp").alias("last"))
            .select("device", "topic", "messages", "bytes",
                    F.col("_p")[0].alias("size_p50"), F.col("_p")[1].alias("size_p95"),
                    F.col("_p")[2].alias("size_p99"), "qos1", "first", "last"))


def rates(records: DataFrame) -> DataFrame:
    """Per device and minute: messages and payload bytes."""
    return (messages(records)
            .groupBy("device", F.date_trunc("minute", "timestamp").alias("minute"))
            .agg(F.count("*").alias("messages"), F.sum("payload_size").alias("bytes")))


def devices(records: DataFrame) -> DataFrame:
    """Per device: first and last seen (any record), messages, bytes, topics, offsets."""
    is_msg = F.col("kind") == "message"
    return (records.where(F.col("kind") != "damage").groupBy("device")
            .agg(F.min("timestamp").alias("first_seen"), F.max("timestamp").alias("last_seen"),
                 F.count(F.when(is_msg, 1)).alias("messages"),
                 F.sum(F.when(is_msg, F.col("payload_size"))).alias("bytes"),
                 F.countDistinct(F.when(is_msg, F.col("topic"))).alias("topics"),
                 F.min("offset").alias("first_offset"), F.max("offset").alias("last_offset")))


def sizes(records: DataFrame) -> DataFrame:
    """Per device: messages by payload size bucket (the next power of two, at least 1)."""
    bucket = F.when(F.col("payload_size") <= 1, F.lit(1)).otherwise(
        F.pow(F.lit(2), F.ceil(F.log2("payload_size")))).cast("long")
    return (messages(records).groupBy("device", bucket.alias("size_up_to"))
            .agg(F.count("*").alias("messages")))


def dead_letters(records: DataFrame) -> DataFrame:
    """Per device, dead-letter topic and reason: how many."""
    return (messages(records).where(F.col("dead_reason").isNotNull())
            .groupBy("device", "topic", F.col("dead_reason").alias("reason"))
            .agg(F.count("*").alias("messages"),
                 F.max("dead_deliveries").alias("max_deliveries")))


def damage(records: DataFrame) -> DataFrame:
    """Per device and segment: damaged parts skipped, and their bytes."""
    return (records.where(F.col("kind") == "damage").groupBy("device", "segment")
            .agg(F.count("*").alias("parts"), F.sum("payload_size").alias("bytes"),
                 F.first("problem").alias("first_problem")))


def filter_matches(filter_col: str, topic_col: str) -> Column:
    """The broker's topic filter rule as a Spark SQL expression."""
    f, t = f"split({filter_col}, '/')", f"split({topic_col}, '/')"
    h = f"CAST(array_position({f}, '#') AS INT)"
    same = f"(element_at({f}, i) = '+' OR element_at({f}, i) = element_at({t}, i))"
    expr = (f"(CASE WHEN {h} > 0 THEN size({t}) >= {h} - 1 AND "
            f"forall(sequence(1, greatest({h} - 1, 1)), i -> {h} = 1 OR {same}) "
            f"ELSE size({t}) = size({f}) AND forall(sequence(1, size({f})), i -> {same}) END) "
            f"AND NOT (startswith({topic_col}, '$') AND element_at({f}, 1) IN ('+', '#'))")
    return F.expr(expr)


def instances(records: DataFrame) -> DataFrame:
    """Each durable group instance (device, group_id: the offset of its create record, or
    the id its checkpoints carry when the create is gone) with its filter, name, start,
    creation time and, if deleted, the offset and time of its deletion. A DELETE record
    names a group by filter and name only: it ends the instance of that name live then (the
    latest create or checkpoint before it), so a name deleted and created again is two
    instances, each with its own deletion or none."""
    g = records.where((F.col("kind") == "group")
                      & F.col("group_op").isin("create", "checkpoint", "delete"))
    owner = F.when(F.col("group_op") == "create", F.col("offset")).when(
        F.col("group_op") == "checkpoint", F.col("group_id"))
    order = (Window.partitionBy("device", "topic", "group_name").orderBy("offset")
             .rowsBetween(Window.unboundedPreceding, -1))
    deletes = (g.withColumn("_owner", owner)
               .withColumn("_live", F.last("_owner", ignorenulls=True).over(order))
               .where((F.col("group_op") == "delete") & F.col("_live").isNotNull())
               .groupBy("device", F.col("_live").alias("group_id"))
               .agg(F.min("offset").alias("deleted_offset"),
                    F.min("timestamp").alias("deleted")))
    created = (g.where(F.col("group_op") == "create")
               .select("device", F.col("offset").alias("group_id"),
                       F.col("topic").alias("filter"), "group_name",
                       F.col("group_start").alias("start"),
                       F.col("timestamp").alias("created")))
    anchored = (g.where(F.col("group_op") == "checkpoint")  # its create may be gone
                .groupBy("device", "group_id")
                .agg(F.first("topic").alias("filter"), F.first("group_name").alias("group_name"),
                     F.min("group_start").alias("start"), F.min("timestamp").alias("created")))
    known = (created.unionByName(anchored).groupBy("device", "group_id")
             .agg(F.first("filter").alias("filter"), F.first("group_name").alias("group_name"),
                  F.min("start").alias("start"), F.min("created").alias("created")))
    return known.join(deletes, ["device", "group_id"], "left")


def groups(records: DataFrame) -> DataFrame:
    """Consumer health per device and durable group instance: messages published to it from
    its creation to its deletion (if any), offsets acked (dead-lettered ones included, as the
    log records them), and the lag at dump time: matching messages at or above its ack floor
    that were not acked (0 for a deleted group: nothing waits for it any more)."""
    known = instances(records)
    acks = records.where((F.col("kind") == "ack") | (F.col("group_op") == "checkpoint"))
    acked = (acks.select("device", "group_id", F.explode("acked").alias("acked_offset"))
             .distinct())
    floors = (records.where(F.col("kind") == "ack").groupBy("device", "group_id")
              .agg(F.max("ack_floor").alias("floor")))
    msgs = messages(records).select("device", "topic", "offset")
    matched = (msgs.alias("m").join(F.broadcast(known.alias("k")), on="device")
               .where(filter_matches("k.filter", "m.topic")
                      & (F.col("m.offset") >= F.col("k.start"))
                      & (F.col("k.deleted_offset").isNull()
                         | (F.col("m.offset") < F.col("k.deleted_offset"))))
               .select("device", "group_id", F.col("m.offset").alias("msg_offset"),
                       F.col("k.deleted_offset").alias("deleted_offset")))
    published = matched.groupBy("device", "group_id").agg(F.count("*").alias("published"))
    pending = (matched.where(F.col("deleted_offset").isNull())
               .join(floors, ["device", "group_id"], "left")
               .where(F.col("floor").isNull() | (F.col("msg_offset") >= F.col("floor")))
               .join(acked.withColumnRenamed("acked_offset", "msg_offset"),
                     ["device", "group_id", "msg_offset"], "left_anti")
               .groupBy("device", "group_id").agg(F.count("*").alias("lag")))
    n_acked = acked.groupBy("device", "group_id").agg(F.count("*").alias("acked"))
    return (known.join(published, ["device", "group_id"], "left")
            .join(n_acked, ["device", "group_id"], "left")
            .join(pending, ["device", "group_id"], "left")
            .select("device", "group_id", "filter", "group_name", "start", "created", "deleted",
                    F.coalesce("published", F.lit(0)).alias("published"),
                    F.coalesce("acked", F.lit(0)).alias("acked"),
                    F.coalesce("lag", F.lit(0)).alias("lag")))


ALL = {"traffic": traffic, "rates": rates, "devices": devices, "sizes": sizes,
       "groups": groups, "dead_letters": dead_letters, "damage": damage}

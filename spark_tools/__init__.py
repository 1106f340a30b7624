"""Fleet analytics on BlipMQ write-ahead-log dumps with PySpark (the ``spark`` extra).

``source``: the ``blipmq-wal`` data source; ``batches``: a segment to Arrow batches with the
log's own record code; ``analytics``: DataFrame -> DataFrame aggregates; ``job``: what
``blipmq export`` runs; ``report``: the HTML report. Never imported by the broker or by the
``wal`` commands (the edge executable carries no Spark).
"""

"""Spark schemas of the two sources: one row per record, one row per dispatch-log entry."""
from __future__ import annotations

from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, IntegerType, LongType, MapType, StringType,
                               StructField, StructType)

RECORDS = StructType([
    StructField("segment_ms", LongType()),  # UTC start of the segment, epoch ms
    StructField("segment", StringType()),  # its directory name, YYYYMMDDHHMM
    StructField("part", IntegerType()),
    StructField("offset", LongType()),  # byte offset of the record in its part
    StructField("length", IntegerType()),  # record bytes, header included
    StructField("msg_id", StringType()),
    StructField("topic", StringType()),
    StructField("tags", StringType()),
    StructField("keys", ArrayType(StringType())),
    StructField("properties", MapType(StringType(), StringType())),
    StructField("body", BinaryType()),
    StructField("due_ms", LongType()),
    StructField("enqueue_ms", LongType()),
    StructField("crc_ok", BooleanType()),  # false: the record fails a check; its fields are null
    # from the segment's dispatch log: how many entries of each outcome name this record
    StructField("delivered", IntegerType()),
    StructField("dead_lettered", IntegerType()),
    StructField("cancelled", IntegerType()),
    StructField("marked_corrupt", IntegerType()),
    StructField("replayed", IntegerType()),
    StructField("first_delivered_ms", LongType()),  # dispatch time of its first delivery, null if none
])

DISPATCH = StructType([
    StructField("segment_ms", LongType()),
    StructField("segment", StringType()),
    StructField("part", IntegerType()),
    StructField("offset", LongType()),
    StructField("due_ms", LongType()),
    StructField("dispatch_ms", LongType()),
    StructField("attempts", IntegerType()),
    StructField("outcome", IntegerType()),  # storage.DELIVERED, DEAD_LETTERED, CANCELLED, REPLAYED, CORRUPT
    StructField("outcome_name", StringType()),
    StructField("record_exists", BooleanType()),  # false: the entry names no record of its segment
])

#: the audit's cells (`format("timewheel_audit")`, see spark._cells): counts of records per segment,
#: topic, due-time bucket and lateness bin; a record with findings, a dispatch entry naming no
#: record, or a settled part's records that cannot be read, is a row of its own with `finding` set
#: (for the last two every count is 0 but `unknown_entries` or `unreadable`)
AUDIT_CELLS = StructType([
    StructField("segment_ms", LongType()),
    StructField("segment", StringType()),
    StructField("topic", StringType()),  # null for records whose bytes fail a check
    StructField("bucket_ms", LongType()),  # start of the due-time bucket
    StructField("lateness_bin", LongType()),  # first delivery - due, binned; null when not delivered
    StructField("finding", StructType([
        StructField("part", IntegerType()),
        StructField("offset", LongType()),
        StructField("msg_id", StringType()),
        StructField("due_ms", LongType()),
        StructField("delivered", IntegerType()),
        StructField("first_delivered_ms", LongType()),
        StructField("crc_ok", BooleanType()),
        StructField("outcome", IntegerType()),  # of a dispatch entry naming no record
        StructField("kinds", ArrayType(StringType())),  # lost, duplicate, corrupt, unknown_dispatch_entry,
        # unreadable_records
        StructField("reason", StringType()),  # what an unreadable_records finding says of its part
    ])),
    # records (each status, replayed, lost: pending past due + grace, duplicates: delivered more than
    # once, deliveries: delivered at all), dispatch entries naming no record, and records a settled
    # part cannot give back (`spark._damage`)
    *(StructField(c, LongType()) for c in ("scheduled", "dispatched", "cancelled", "dead_lettered", "corrupt",
                                            "pending", "replayed", "lost", "duplicates", "deliveries",
                                            "unknown_entries", "unreadable")),
    StructField("max_ms", LongType()),  # largest lateness of the cell's records
])

#: what a backfill writes: the fields of a `timewheel.Message`, validated, with its id and due time
BACKFILL_INPUT = StructType([
    StructField("msg_id", StringType()),
    StructField("topic", StringType()),
    StructField("body", BinaryType()),
    StructField("due_ms", LongType()),
    StructField("tags", StringType()),
    StructField("keys", ArrayType(StringType())),
    StructField("properties", MapType(StringType(), StringType())),
])

#: what the backfill writer takes: BACKFILL_INPUT, plus (optionally) what the plan found per id:
#: status "new" rows are written, "existing" ones (already in the data directory) only counted;
#: copies is how many input rows carried the id
BACKFILL_PLAN = StructType(BACKFILL_INPUT.fields + [StructField("status", StringType()),
                                                     StructField("copies", LongType())])


def require_subset(requested: StructType, full: StructType, source: str) -> list[str]:
    """Names of the requested columns, after checking each exists in `full` with the same type."""
    by_name = {f.name: f.dataType for f in full.fields}
    names = []
    for f in requested.fields:
        want = by_name.get(f.name)
        if want is None:
            raise ValueError(f"{source} has no column {f.name!r}; it has {', '.join(by_name)}")
        if f.dataType != want:
            raise ValueError(f"{source} column {f.name!r} is {want.simpleString()}, "
                             f"not {f.dataType.simpleString()}")
        names.append(f.name)
    return names

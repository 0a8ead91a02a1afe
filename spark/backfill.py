"""Backfill: bulk-schedule messages from Parquet, JSON or CSV into sealed parts of a data directory.

Input columns are named like the fields of `timewheel.Message`: `topic`, `body`, `deliver_at_ms`
(epoch ms; `due_ms` is taken too) or `deliver_at` (a timestamp, or ISO-8601 text), and optionally
`keys` (array, or text split on commas and spaces), `tags`, `properties` (map, struct, or JSON
text) and `msg_id`. The job:

1. `check_rows`: every row gets a `reason` when it breaks the producer contract (no topic, a topic
   ingest would not deliver to (a RocketMQ system topic, the engine's own), no body, no or unparsable time, due in a segment already past, delay past the maximum, body too large,
   a property named like the contract's or RocketMQ's own, a separator (\\x00-\\x02) in an id, tags,
   keys or properties, a field too long to encode, properties too large to deliver): the rules of
   ingest (`forwarder.contract.to_message`, `check_deliverable`), as columns, so that nothing
   stored is dead-lettered for them at its due time; rejected rows are written out with their
   reason, never dropped;
2. `with_ids`: rows without an id get one derived from their content (so a rerun derives the same);
3. `plan`: one row per id, marked "existing" when the data directory already holds it, with the
   number of input rows that carried it;
4. the plan is range-partitioned by due time and written by the `timewheel` source's writer:
   tasks stage parts, the driver publishes them (`SegmentLayout.publish_part`) on commit.

Running the same backfill twice schedules nothing twice.
"""
from __future__ import annotations

import json
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (ArrayType, BinaryType, MapType, NumericType, StringType, StructType,
                               TimestampNTZType, TimestampType)

from forwarder.contract import (CONTRACT_PROPERTIES, DEAD_LETTER_MAX_BODY, DELIVERY_PROPERTIES_BUDGET, DUE_MS,
                                ORIGINAL_MSG_ID, SYSTEM_TOPIC_PREFIXES, TOPIC_PATTERN)
from forwarder.rocketmq.message import KEYS, SYSTEM_PROPERTIES, TAGS
from spark._util import require_readable
from storage import TWO_YEARS_MS, SegmentLayout
from storage.record import MAX_FIELD
from timewheel.config import DEFAULT_MAX_BODY_BYTES

PastDue = Literal["reject", "now"]
REASONS = {
    "no_topic": "no topic",
    "bad_topic": "not a delivery target: an invalid name, a RocketMQ system topic or one of the engine's own "
                 "(the check ingest applies)",
    "no_body": "no body",
    "no_time": "no delivery time (deliver_at_ms or deliver_at)",
    "bad_time": "unparsable delivery time",
    "past_segment": "due in a segment already past (the engine would only pick it up on restart)",
    "too_late": "delay past the maximum",
    "body_too_large": "body too large",
    "bad_properties": "properties are not a map of strings (or JSON text of one)",
    "reserved_property": "a property named like one of the contract's (TW_TARGET_TOPIC, TW_DELAY_MS, ...) or "
                         "RocketMQ's own (UNIQ_KEY, DELAY, ...), which ingest never carries to the delivered message",
    "separator": "an id, tags, keys or a property holding \\x00, \\x01 or \\x02, the separators RocketMQ uses",
    "field_too_long": "a field is too long to encode",
    "properties_too_large": f"properties, tags and keys take more than the {DELIVERY_PROPERTIES_BUDGET} bytes "
                            f"delivery can send beside the engine's own",
}
#: property names ingest drops (`forwarder._ingest_pass`): a row carrying one is refused, not altered
_NOT_CARRIED = sorted(SYSTEM_PROPERTIES | CONTRACT_PROPERTIES)
_TRANSIENT_PREFIX = "__RMQ.TRANSIENT."
_SEPARATORS = r"[\x00-\x02]"  # java.util.regex, as Spark's rlike reads it
#: a derived id's length (`content_id`), for rows without one
_CONTENT_ID_LEN = 32
_RECORD_COLUMNS = ("msg_id", "topic", "body", "due_ms", "tags", "keys", "properties")


def read_input(spark: SparkSession, paths: Sequence[str], fmt: str | None = None) -> DataFrame:
    """Parquet, JSON (lines) or CSV (with a header row); the format from the first path's suffix
    when not given."""
    if not paths:
        raise ValueError("give at least one input path")
    if fmt is None:
        suffix = Path(str(paths[0]).rstrip("/")).suffix.lower()
        fmt = {".parquet": "parquet", ".pq": "parquet", ".json": "json", ".jsonl": "json", ".ndjson": "json",
               ".csv": "csv"}.get(suffix, "parquet")
    if fmt == "parquet":
        return spark.read.parquet(*paths)
    if fmt == "json":
        return spark.read.json(list(paths))
    if fmt == "csv":
        return spark.read.option("header", True).option("escape", '"').csv(list(paths))  # RFC 4180 quoting
    raise ValueError(f"input format must be parquet, json or csv, not {fmt!r}")


def _text(df: DataFrame, name: str) -> Column:
    """A column as a string, null when absent or empty."""
    if name not in df.columns:
        return F.lit(None).cast("string")
    c = F.col(name).cast("string")
    return F.when(c == "", F.lit(None)).otherwise(c)


def _body(df: DataFrame, encoding: str) -> Column:
    """The body as binary (text encoded as UTF-8 or decoded from base64)."""
    if "body" not in df.columns:
        raise ValueError("the input has no body column")
    dt = df.schema["body"].dataType
    if isinstance(dt, BinaryType):
        return F.col("body")
    if encoding == "base64":
        return F.try_to_binary(F.col("body").cast("string"), F.lit("base64"))
    if encoding != "utf-8":
        raise ValueError(f"body encoding must be utf-8 or base64, not {encoding!r}")
    return F.encode(F.col("body").cast("string"), "UTF-8")


def _due(df: DataFrame) -> tuple[Column, Column]:
    """(due ms or null, whether a time was given at all); per row, the first time column given."""
    parsed, given = [], []
    for name in ("deliver_at_ms", "due_ms", "deliver_at"):
        if name not in df.columns:
            continue
        dt = df.schema[name].dataType
        c = F.col(name)
        if isinstance(dt, (TimestampType, TimestampNTZType)):
            parsed.append(F.unix_millis(c.cast("timestamp")))
            given.append(c.isNotNull())
        elif isinstance(dt, NumericType):
            parsed.append(c.cast("long"))
            given.append(c.isNotNull())
        else:
            text = F.trim(c.cast("string"))
            value = text.try_cast("long") if name != "deliver_at" else F.unix_millis(text.try_cast("timestamp"))
            parsed.append(F.when(text != "", value))
            given.append(text.isNotNull() & (text != ""))
    if not parsed:
        raise ValueError("the input has no delivery time: give deliver_at_ms (epoch ms) or deliver_at (timestamp)")
    # the first column given decides: an unparsable value is not rescued by a later column
    due = F.lit(None).cast("long")
    for p, g in reversed(list(zip(parsed, given))):
        due = F.when(g, p).otherwise(due)
    has = given[0]
    for g in given[1:]:
        has = has | g
    return due, has


def _keys(df: DataFrame) -> Column:
    """Keys as array<string> (text split on commas and spaces), never null."""
    if "keys" not in df.columns:
        return F.array().cast(ArrayType(StringType()))
    dt = df.schema["keys"].dataType
    if isinstance(dt, ArrayType):
        arr = F.col("keys").cast(ArrayType(StringType()))
    else:
        arr = F.split(F.trim(F.col("keys").cast("string")), r"[,\s]+")
    arr = F.filter(arr, lambda k: k.isNotNull() & (k != ""))
    return F.coalesce(arr, F.array().cast(ArrayType(StringType())))


def _properties(df: DataFrame) -> tuple[Column, Column]:
    """(properties as map<string,string>, whether they parsed)."""
    mtype = MapType(StringType(), StringType())
    if "properties" not in df.columns:
        return F.create_map().cast(mtype), F.lit(True)
    dt = df.schema["properties"].dataType
    c = F.col("properties")
    if isinstance(dt, MapType):
        m = c.cast(mtype)
    elif isinstance(dt, StructType):
        m = F.from_json(F.to_json(c), mtype)
    else:
        m = F.from_json(c.cast("string"), mtype)
    parsed = c.isNull() | m.isNotNull()
    m = F.map_filter(F.coalesce(m, F.create_map().cast(mtype)), lambda k, v: v.isNotNull())
    return m, parsed


def _not_a_target(topic: Column, reserved: frozenset[str]) -> Column:
    """True where `topic` is not one ingest delivers to (`forwarder.contract.check_target_topic`, as columns)."""
    # Spark matches with java.util.regex, whose `$` also matches before a final line break ("ORDERS\n"
    # would pass); `\z` is the end of the text, as the ingest check's fullmatch requires
    bad = ~topic.rlike(f"^{TOPIC_PATTERN}\\z")
    for prefix in SYSTEM_TOPIC_PREFIXES:
        bad = bad | topic.startswith(prefix)
    return bad | topic.isin(*sorted(reserved)) if reserved else bad


def _reserved_name(props: Column) -> Column:
    """True where a property is named like one ingest never carries to the delivered message."""
    return F.exists(F.map_keys(props), lambda k: k.isin(*_NOT_CARRIED) | k.startswith(_TRANSIENT_PREFIX))


def _has_separator(msg_id: Column, tags: Column, keys: Column, props: Column) -> Column:
    """True where the id, tags, a key or a property's name or value holds a RocketMQ separator."""
    def sep(c: Column) -> Column:
        return F.coalesce(c.rlike(_SEPARATORS), F.lit(False))
    return (sep(msg_id) | sep(tags) | F.exists(keys, sep) | F.exists(F.map_keys(props), sep)
            | F.exists(F.map_values(props), sep))


def _delivered_size(msg_id: Column, due: Column, tags: Column, keys: Column, props: Column) -> Column:
    """The bytes properties, tags and keys take as delivered (`forwarder.contract.properties_size` of
    `to_outgoing`): name \\x01 value \\x02 each, with the id and the due time the engine adds."""
    def pair(name: str, value: Column) -> Column:
        return F.lit(len(name) + 2) + F.octet_length(value)
    own = F.aggregate(F.map_entries(props), F.lit(0).cast("long"),
                      lambda acc, e: acc + F.octet_length(e["key"]) + F.octet_length(e["value"]) + 2)
    added = pair(ORIGINAL_MSG_ID, F.coalesce(msg_id, F.lit("x" * _CONTENT_ID_LEN))) + pair(DUE_MS, due.cast("string"))
    return (own + added + F.coalesce(pair(TAGS, tags), F.lit(0))
            + F.when(F.size(keys) > 0, pair(KEYS, F.array_join(keys, " "))).otherwise(F.lit(0)))


def check_rows(df: DataFrame, *, now_ms: int, segment_ms: int, max_delay_ms: int = TWO_YEARS_MS,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, past_due: PastDue = "reject",
               body_encoding: str = "utf-8", reserved_topics: frozenset[str] = frozenset()) -> DataFrame:
    """The input with `reason` (null for a row that keeps the contract, else a key of REASONS) and
    `record` (the row as msg_id, topic, body, due_ms, tags, keys, properties; `due_ms` moved to
    `now_ms` for a past-due row when past_due="now")."""
    if past_due not in ("reject", "now"):
        raise ValueError(f"past_due must be 'reject' or 'now', not {past_due!r}")
    topic = _text(df, "topic")
    body = _body(df, body_encoding)
    due, has_time = _due(df)
    keys = _keys(df)
    props, props_ok = _properties(df)
    current = now_ms - now_ms % segment_ms
    past = due < F.lit(current)
    moved = F.when(past, F.lit(now_ms)).otherwise(due) if past_due == "now" else due
    # delivery cannot send a larger body whatever the engine allows (`contract.check_deliverable`)
    max_body = min(max_body_bytes, DEAD_LETTER_MAX_BODY)
    msg_id, tags = _text(df, "msg_id"), _text(df, "tags")
    # conservative sizes: JSON text is never shorter than the encoded keys or properties
    nested_large = (F.octet_length(F.to_json(keys)) > MAX_FIELD) | \
        (F.octet_length(F.to_json(props)) > MAX_FIELD)
    too_long = ((F.coalesce(F.octet_length(msg_id), F.lit(0)) > MAX_FIELD)
                | (F.octet_length(topic) > MAX_FIELD)
                | (F.coalesce(F.octet_length(tags), F.lit(0)) > MAX_FIELD)
                | nested_large)
    reason = (F.when(topic.isNull(), F.lit("no_topic"))
              .when(_not_a_target(topic, reserved_topics), F.lit("bad_topic"))
              .when(body.isNull(), F.lit("no_body"))
              .when(~has_time, F.lit("no_time"))
              .when(due.isNull() | (due < 0), F.lit("bad_time"))
              .when(past & F.lit(past_due == "reject"), F.lit("past_segment"))
              .when(due - F.lit(now_ms) > F.lit(max_delay_ms), F.lit("too_late"))
              .when(F.octet_length(body) > F.lit(max_body), F.lit("body_too_large"))
              .when(~props_ok, F.lit("bad_properties"))
              .when(_reserved_name(props), F.lit("reserved_property"))
              .when(_has_separator(msg_id, tags, keys, props), F.lit("separator"))
              .when(too_long, F.lit("field_too_long"))
              .when(_delivered_size(msg_id, moved, tags, keys, props) > DELIVERY_PROPERTIES_BUDGET,
                    F.lit("properties_too_large")))
    record = F.struct(msg_id.alias("msg_id"), topic.alias("topic"), body.alias("body"),
                      moved.alias("due_ms"), tags.alias("tags"), keys.alias("keys"),
                      props.alias("properties"), due.alias("content_due_ms"))
    out = df.withColumn("reason", reason).withColumn("record", record) \
        .withColumn("_tw_check", F.col("reason").isNull() & nested_large)
    # keys or properties near the limit: storage's encoder decides, for those few rows only (a
    # Python UDF runs on every row that reaches it, whatever condition surrounds it)
    refusal = F.udf(_encode_refusal, StringType(), useArrow=False)
    near = out.where(F.col("_tw_check")).withColumn("reason", refusal(F.col("record")))
    return out.where(~F.col("_tw_check")).unionByName(near).drop("_tw_check")


def _encode_refusal(rec: object) -> str | None:
    """"field_too_long" when storage's encoder refuses the row's id, topic, tags, keys or properties."""
    from storage import InvalidRecordError, Record, encode

    r = rec.asDict()  # type: ignore[attr-defined]
    try:
        encode(Record(r["msg_id"] or "x", r["topic"] or "x", b"", 0, 0, r["tags"] or "", tuple(r["keys"] or ()),
                      dict(r["properties"] or {})))
    except InvalidRecordError:
        return "field_too_long"
    return None


def content_id(record: Column) -> Column:
    """A message id from a record's content: 32 hex digits of SHA-256 over its canonical JSON."""
    canonical = F.to_json(F.struct(
        record["topic"].alias("t"), record["content_due_ms"].alias("d"), record["tags"].alias("g"),
        record["keys"].alias("k"), F.array_sort(F.map_entries(record["properties"])).alias("p"),
        F.base64(record["body"]).alias("b")))
    return F.substring(F.sha2(canonical, 256), 1, 32)


def with_ids(accepted: DataFrame) -> DataFrame:
    """Accepted rows (the `record` struct) as BACKFILL_INPUT columns, each with an id."""
    r = F.col("record")
    return accepted.select(F.coalesce(r["msg_id"], content_id(r)).alias("msg_id"),
                           *(r[c].alias(c) for c in _RECORD_COLUMNS[1:]))


def plan(records: DataFrame, existing_ids: DataFrame) -> DataFrame:
    """One row per id (the first by due time), with `copies` (input rows carrying it) and `status`:
    "existing" when `existing_ids` (column msg_id) holds it, else "new"."""
    firsts = records.groupBy("msg_id").agg(
        F.min_by(F.struct(*(F.col(c) for c in _RECORD_COLUMNS[1:])), F.col("due_ms")).alias("r"),
        F.count(F.lit(1)).alias("copies"))
    known = existing_ids.where(F.col("msg_id").isNotNull()).select("msg_id").distinct() \
        .withColumn("existing", F.lit(True))
    joined = firsts.join(known, "msg_id", "left")
    return joined.select("msg_id", *(F.col("r")[c].alias(c) for c in _RECORD_COLUMNS[1:]),
                         F.when(F.col("existing"), F.lit("existing")).otherwise(F.lit("new")).alias("status"),
                         "copies")


@dataclass
class BackfillResult:
    """What a backfill did."""

    job: str
    scheduled: int = 0
    already_scheduled: int = 0
    duplicates: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    rejects_path: str | None = None
    parts: list[dict] = field(default_factory=list)

    @property
    def input_rows(self) -> int:
        """Rows read."""
        return self.scheduled + self.already_scheduled + self.duplicates + self.rejected

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        out = asdict(self)
        out["input_rows"] = self.input_rows
        out["segments"] = len({p["segment"] for p in self.parts})
        return out


def backfill(spark: SparkSession, data_dir: str | Path, source: DataFrame, *, now_ms: int | None = None,
             rejects_path: str | Path | None = None, max_delay_ms: int = TWO_YEARS_MS,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, past_due: PastDue = "reject", body_encoding: str = "utf-8",
             partitions: int | None = None, max_part_bytes: int = 1 << 30,
             reserved_topics: frozenset[str] = frozenset()) -> BackfillResult:
    """Schedule the rows of `source` into `data_dir`; see the module docstring."""
    data_dir = str(data_dir)
    layout = SegmentLayout.open_existing(data_dir)
    require_readable(layout, dispatch=False)  # every stored id is read, to schedule none twice
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    job = f"backfill-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now / 1000))}-{uuid.uuid4().hex[:8]}"
    result = BackfillResult(job)
    checked = check_rows(source, now_ms=now, segment_ms=layout.segment_ms, max_delay_ms=max_delay_ms,
                         max_body_bytes=max_body_bytes, past_due=past_due, body_encoding=body_encoding,
                         reserved_topics=reserved_topics)
    rejected = checked.where(F.col("reason").isNotNull()).drop("record")
    if rejects_path is not None:
        rp = str(rejects_path)
        writer = rejected.coalesce(1).write.mode("overwrite")
        (writer.json(rp) if rp.endswith(".json") else writer.parquet(rp))
        back = spark.read.json(rp) if rp.endswith(".json") else spark.read.parquet(rp)
        counts = back.groupBy("reason").count().collect()
        result.rejects_path = rp
    else:
        counts = rejected.groupBy("reason").count().collect()
    result.rejected_by_reason = {r["reason"]: r["count"] for r in counts}
    result.rejected = sum(result.rejected_by_reason.values())
    existing = spark.read.format("timewheel").schema("msg_id string").load(data_dir)
    planned = plan(with_ids(checked.where(F.col("reason").isNull())), existing)
    with tempfile.TemporaryDirectory(prefix="timewheel-backfill-") as tmp:
        report = Path(tmp) / "report.json"
        ranged = planned.repartitionByRange(partitions, "due_ms") if partitions else \
            planned.repartitionByRange("due_ms")  # adaptive execution sizes the partitions
        (ranged.sortWithinPartitions("due_ms")
         .write.format("timewheel").mode("append")
         .option("job", job).option("enqueue_ms", str(now)).option("report", str(report))
         .option("max_part_bytes", str(max_part_bytes))
         .save(data_dir))
        done = json.loads(report.read_text())
    result.scheduled = done["counts"]["written"]
    result.already_scheduled = done["counts"]["existing"]
    result.duplicates = done["counts"]["duplicates"]
    result.parts = done["parts"]
    return result

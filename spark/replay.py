"""Replay: re-send the records of a time range to RocketMQ from the Spark executors.

Each task (one per part file) opens one producer, sends its records in due order at most
`rate / task slots per executor` messages a second (so an executor stays under `rate`), and
appends a REPLAYED entry for every message sent to its segment's dispatch log (one frame per
batch), so the audit tells replays from duplicates. A replayed message carries what the engine's
delivery carries: body, tags, keys, properties, the original id in `TW_ORIGINAL_MSG_ID`, and
`TW_REPLAY=1`. Records that fail their checks are counted and skipped. Records a settled part
cannot give back (`spark._damage`: the index names them past the end of the log, or the log has no
index) are counted per part as an export counts them (`unreadable_records`, `damaged_parts`,
whatever the topic asked for): the rest is sent, and the result says the range was not replayed
whole. A dry run sends nothing and writes nothing: it says what would be sent, and what could not be.

Spark only reads: the sending side is a `Sender` from a factory the caller passes in (for RocketMQ,
`forwarder.replay_sender.replay_sender`, which sends through the wire client).
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import MapType, StringType

from spark._damage import GRACE_MS, damaged_parts
from spark._util import of_topic, require_readable
from storage import SegmentLayout

ORIGINAL_ID_PROPERTY = "TW_ORIGINAL_MSG_ID"
REPLAY_PROPERTY = "TW_REPLAY"
COLUMNS = ("segment_ms long, part int, offset long, msg_id string, topic string, tags string, keys array<string>, "
           "properties map<string,string>, body binary, due_ms long, crc_ok boolean")
RESULT_SCHEMA = "segment_ms long, sent long, failed long, skipped_corrupt long, error string"
_SEND_ATTEMPTS = 3


class Sender(Protocol):
    """Sends one message; raises when it was not accepted."""

    def send(self, topic: str, body: bytes, tags: str | None, keys: Sequence[str], properties: Mapping[str, str]) -> None:
        """Send one message."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


def select(records: DataFrame, *, since_ms: int, until_ms: int, topic: str | None = None) -> DataFrame:
    """Records due in [since_ms, until_ms), of one topic when given (records that fail their checks
    stay, to be counted: their topic is unknown)."""
    out = records.where((F.col("due_ms") >= since_ms) & (F.col("due_ms") < until_ms))
    return of_topic(out, topic) if topic is not None else out


def delivery_properties(records: DataFrame) -> DataFrame:
    """Records with `properties` as the replayed message carries them."""
    extra = F.create_map(F.lit(ORIGINAL_ID_PROPERTY), F.col("msg_id"), F.lit(REPLAY_PROPERTY), F.lit("1"))
    props = F.coalesce(F.col("properties"), F.create_map().cast(MapType(StringType(), StringType())))
    merged = F.map_concat(F.map_filter(props, lambda k, v: ~k.isin(ORIGINAL_ID_PROPERTY, REPLAY_PROPERTY)), extra)
    return records.withColumn("properties", merged)


class _Pace:
    """At most `rate` calls a second (0: unlimited), without drift."""

    def __init__(self, rate: float) -> None:
        """Pace calls at `rate` a second."""
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.next = time.monotonic()

    def wait(self) -> None:
        """Sleep until the next call is allowed."""
        if not self.interval:
            return
        now = time.monotonic()
        if self.next > now:
            time.sleep(self.next - now)
        self.next = max(self.next, now - 1.0) + self.interval  # at most a second of burst after a stall


def _record_replays(data_dir: str, segment_ms: int, part: int, offsets: list[int], dues: list[int]) -> None:
    """Append one frame of REPLAYED entries to a segment's dispatch log (`storage.append_dispatch`)."""
    import numpy as np

    from storage import REPLAYED, SegmentLayout, append_dispatch, dispatch_entries

    now = time.time_ns() // 1_000_000
    layout = SegmentLayout.open_existing(data_dir)
    append_dispatch(layout, segment_ms, dispatch_entries(part, np.asarray(offsets, np.uint32),
                                                         np.asarray(dues, np.int64), now, REPLAYED, 1), now)


def send_partition(batches: Iterator, *, data_dir: str, sender_factory: Callable[[], Sender],
                   rate_per_task: float) -> Iterator:
    """mapInArrow body: send one partition's records, record the replays, yield one summary row."""
    import pyarrow as pa

    sent = failed = skipped = 0
    segment = -1
    error: str | None = None
    sender: Sender | None = None
    pace = _Pace(rate_per_task)
    try:
        for batch in batches:
            cols = batch.to_pydict()
            done: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
            for i in range(batch.num_rows):
                segment = cols["segment_ms"][i]
                if not cols["crc_ok"][i]:
                    skipped += 1
                    continue
                if sender is None:
                    sender = sender_factory()
                pace.wait()
                for attempt in range(_SEND_ATTEMPTS):
                    try:
                        sender.send(cols["topic"][i], cols["body"][i], cols["tags"][i], cols["keys"][i] or [],
                                    dict(cols["properties"][i] or ()))
                    except ValueError as e:  # refused before sending (a system or engine topic): no retry
                        failed += 1
                        error = error or f"{type(e).__name__}: {e}"
                        break
                    except Exception as e:  # the client raises plain exceptions: retry, then count
                        if attempt + 1 == _SEND_ATTEMPTS:
                            failed += 1
                            error = error or f"{type(e).__name__}: {e}"
                        else:
                            time.sleep(0.2 * (attempt + 1))
                        continue
                    sent += 1
                    offs, dues = done.setdefault((segment, cols["part"][i]), ([], []))
                    offs.append(cols["offset"][i])
                    dues.append(cols["due_ms"][i])
                    break
            for (seg, part), (offs, dues) in done.items():
                _record_replays(data_dir, seg, part, offs, dues)
    finally:
        if sender is not None:
            sender.close()
    yield pa.RecordBatch.from_pydict({"segment_ms": [segment], "sent": [sent], "failed": [failed],
                                      "skipped_corrupt": [skipped], "error": [error]},
                                     schema=pa.schema([("segment_ms", pa.int64()), ("sent", pa.int64()),
                                                       ("failed", pa.int64()), ("skipped_corrupt", pa.int64()),
                                                       ("error", pa.string())]))


@dataclass
class ReplayResult:
    """What a replay did (or, dry, would do)."""

    since_ms: int
    until_ms: int
    topic: str | None
    dry_run: bool
    matched: int = 0
    sent: int = 0
    failed: int = 0
    skipped_corrupt: int = 0
    unreadable_records: int = 0  # records of settled parts due in the range that could not be read, so not sent
    damaged_parts: list[dict] = field(default_factory=list)  # `spark._damage.PartDamage.as_dict` of each part
    by_topic: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    sample: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # repairs made before sending (torn dispatch-log tails cut)

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        return asdict(self)


def task_slots(spark: SparkSession) -> int:
    """Tasks one executor runs at once (for the per-executor rate limit)."""
    from spark.session import _local_cores

    conf = spark.sparkContext.getConf()
    master = conf.get("spark.master", "local[*]")
    cores = _local_cores(master) if master.startswith("local") else int(conf.get("spark.executor.cores", "1"))
    return max(1, cores // max(1, int(conf.get("spark.task.cpus", "1"))))


def check_dispatch_logs(data_dir: str, since_ms: int, until_ms: int) -> list[str]:
    """Make the dispatch logs replay appends to end in a whole frame: a REPLAYED frame appended after
    a torn one would be skipped with it. A crash's torn frame is cut as the engine cuts it when it
    opens a log (under the log's lock, only a tail that stands still); what was cut is said, one
    line a log. A tail still being written by a writer that takes no lock is refused."""
    from storage import SegmentLayout, StorageError, cut_dispatch_tail, read_dispatch_log

    layout = SegmentLayout.open_existing(data_dir)
    notes = []
    for seg in layout.list_segments(since_ms, until_ms):
        path = layout.dispatch_log(seg)
        if not read_dispatch_log(path).torn_bytes:
            continue
        cut = cut_dispatch_tail(path)  # a tail that keeps moving is refused there, in words that say so
        left = read_dispatch_log(path).torn_bytes
        if left:  # torn again at once: the same kind of writer
            raise StorageError(f"{path} ends in {left} bytes of a frame that is still being written by a process "
                               "that takes no lock on it (an engine of an older build?); stop it, then replay")
        if cut:
            notes.append(f"cut {cut} bytes of a torn frame (a crash's, never a whole record) at the end of {path}")
    return notes


def replay(spark: SparkSession, data_dir: str | Path, *, since_ms: int, until_ms: int, topic: str | None = None,
           dry_run: bool = False, sender_factory: Callable[[], Sender] | None = None, rate: float = 1000.0,
           sample: int = 20, now_ms: int | None = None, grace_ms: int = GRACE_MS) -> ReplayResult:
    """Re-send (or, with dry_run, list) the records due in [since_ms, until_ms) of `topic` (all when
    None); `rate` is messages a second per executor (0: unlimited). Records that parts of segments
    ended before `now_ms - grace_ms` (now: the wall clock) cannot give back are counted in the result."""
    if until_ms <= since_ms:
        raise ValueError(f"--until ({until_ms}) must be after --since ({since_ms})")
    data_dir = str(data_dir)
    layout = SegmentLayout.open_existing(data_dir)
    # a dry run reads no dispatch log; a replay appends to those of the segments it sends from
    require_readable(layout, since_ms, until_ms, dispatch=not dry_run)
    now = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    damaged = damaged_parts(layout, now_ms=now, grace_ms=grace_ms, since_ms=since_ms, until_ms=until_ms)
    result = ReplayResult(since_ms, until_ms, topic, dry_run, unreadable_records=sum(d.records for d in damaged),
                          damaged_parts=[d.as_dict() for d in damaged])
    records = (spark.read.format("timewheel").schema(COLUMNS)
               .option("since_ms", str(since_ms)).option("until_ms", str(until_ms)).load(data_dir))
    chosen = delivery_properties(select(records, since_ms=since_ms, until_ms=until_ms, topic=topic))
    if dry_run:
        chosen = chosen.persist()
        try:
            rows = chosen.groupBy("crc_ok", "topic").count().collect()
            result.by_topic = {r["topic"]: r["count"] for r in rows if r["crc_ok"]}
            result.skipped_corrupt = sum(r["count"] for r in rows if not r["crc_ok"])
            result.matched = sum(result.by_topic.values()) + result.skipped_corrupt
            result.sample = [r.asDict(recursive=True) for r in
                             chosen.where(F.col("crc_ok")).orderBy("due_ms", "segment_ms", "part", "offset")
                             .withColumn("body_bytes", F.octet_length("body")).drop("body", "crc_ok")
                             .limit(sample).collect()]
        finally:
            chosen.unpersist()
        return result
    if sender_factory is None:
        raise ValueError("give a sender factory (e.g. forwarder.replay_sender.replay_sender(namesrv, group)) "
                         "or dry_run=True")
    result.notes = check_dispatch_logs(data_dir, since_ms, until_ms)
    fn = functools.partial(send_partition, data_dir=data_dir, sender_factory=sender_factory,
                           rate_per_task=rate / task_slots(spark) if rate > 0 else 0.0)
    out = chosen.sortWithinPartitions("due_ms").mapInArrow(fn, RESULT_SCHEMA).collect()
    result.sent = sum(r["sent"] for r in out)
    result.failed = sum(r["failed"] for r in out)
    result.skipped_corrupt = sum(r["skipped_corrupt"] for r in out)
    result.matched = result.sent + result.failed + result.skipped_corrupt
    result.errors = sorted({r["error"] for r in out if r["error"]})
    return result

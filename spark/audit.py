"""Audit: reconcile what was scheduled with what the dispatch logs say happened to it.

Per record (`with_status`), from its dispatch entries: how often it was delivered, dead-lettered,
cancelled, marked corrupt or replayed, when it was first delivered, and one status:

    corrupt        its bytes fail a check (crc_ok = false), or the engine marked it CORRUPT and
                   nothing else happened to it
    cancelled      a CANCELLED entry
    dispatched     a DELIVERED entry
    dead_lettered  a DEAD_LETTERED entry
    pending        none of the above

so that, per segment and topic, scheduled = dispatched + cancelled + dead_lettered + corrupt +
pending (`reconcile`; the precedence is storage.summarize's, with bad bytes first). Findings
(`findings`): lost records (pending, due before `now - grace`), duplicates (delivered more than
once; REPLAYED entries are an operator's re-sends, not duplicates), corrupt records, and dispatch
entries naming no record. Lateness (`lateness`): dispatch_ms - due_ms of each record's first
delivery, p50/p99/max per segment and topic.

Every function here is `DataFrame -> DataFrame`; `run_audit` does the I/O.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from storage import CANCELLED, CORRUPT, DEAD_LETTERED, DELIVERED, REPLAYED

KEY = ["segment_ms", "part", "offset"]
OUTCOME_COUNTS = ("delivered", "dead_lettered", "cancelled", "marked_corrupt", "replayed")
#: what the audit reads of each record: identity, topic, due time, checks, and its outcomes
RECORD_COLUMNS = ("segment_ms long, part int, offset long, msg_id string, topic string, "
                  "due_ms long, crc_ok boolean, delivered int, dead_lettered int, cancelled int, "
                  "marked_corrupt int, replayed int, first_delivered_ms long")
DISPATCH_COLUMNS = "segment_ms long, part int, offset long, due_ms long, dispatch_ms long, " \
                   "outcome int, record_exists boolean"
FINDING_KINDS = ("lost", "duplicate", "corrupt", "unknown_dispatch_entry")
FAILING_KINDS = ("lost", "duplicate", "corrupt")  # the audit fails (exit 1) when it finds any of these
_OUTCOME_OF = {"delivered": DELIVERED, "dead_lettered": DEAD_LETTERED, "cancelled": CANCELLED,
               "marked_corrupt": CORRUPT, "replayed": REPLAYED}
STATUSES = ("dispatched", "cancelled", "dead_lettered", "corrupt", "pending")


def attach_outcomes(records: DataFrame, dispatch: DataFrame) -> DataFrame:
    """Records without outcome columns, given them from dispatch entries by a join (the
    `timewheel` source computes the same columns while reading, without a shuffle)."""
    o = F.col("outcome")
    per_key = dispatch.groupBy(*KEY).agg(
        *(F.sum(F.when(o == v, 1).otherwise(0)).cast("int").alias(k) for k, v in _OUTCOME_OF.items()),
        F.min(F.when(o == DELIVERED, F.col("dispatch_ms"))).alias("first_delivered_ms"))
    joined = records.join(per_key, KEY, "left")
    return joined.select(*(F.col(c) for c in records.columns),
                         *(F.coalesce(F.col(k), F.lit(0)).alias(k) for k in OUTCOME_COUNTS),
                         F.col("first_delivered_ms"))


def with_status(records: DataFrame) -> DataFrame:
    """Records with outcome columns, plus `lateness_ms` (first delivery - due) and `status`."""
    c = {k: F.coalesce(F.col(k), F.lit(0)) for k in OUTCOME_COUNTS}
    status = (F.when(~F.coalesce(F.col("crc_ok"), F.lit(False)), "corrupt")
              .when(c["cancelled"] > 0, "cancelled")
              .when(c["delivered"] > 0, "dispatched")
              .when(c["dead_lettered"] > 0, "dead_lettered")
              .when(c["marked_corrupt"] > 0, "corrupt")
              .otherwise("pending"))
    return records.withColumn("lateness_ms", F.col("first_delivered_ms") - F.col("due_ms")) \
        .withColumn("status", status)


def lateness_bin(ms: Column) -> Column:
    """Lateness rounded toward zero to within 1%: exact below 1024 ms, then 128 steps per power
    of two (as HdrHistogram does with 2 significant digits)."""
    a = F.abs(ms)
    step = F.pow(F.lit(2.0), F.floor(F.log2(a)) - 7).cast("long")
    binned = F.when(a < 1024, a).otherwise(F.floor(a / step).cast("long") * step)
    return F.when(ms < 0, -binned).otherwise(binned)


_CELL_COUNTS = ("scheduled", *STATUSES, "replayed", "duplicates", "deliveries")
_FINDING_FIELDS = ("part", "offset", "msg_id", "due_ms", "delivered", "first_delivered_ms", "crc_ok", "kinds")


def finding_kinds(now_ms: int, grace_ms: int) -> Column:
    """Per record (of `with_status`), what the audit finds wrong with it: a possibly empty array of
    "lost" (pending, due before now - grace), "duplicate" (delivered more than once) and "corrupt"."""
    st = F.col("status")
    kinds = F.array(F.when((st == "pending") & (F.col("due_ms") < now_ms - grace_ms), F.lit("lost")),
                    F.when(F.col("delivered") > 1, F.lit("duplicate")),
                    F.when(st == "corrupt", F.lit("corrupt")))
    return F.filter(kinds, lambda k: k.isNotNull())


def cells(status: DataFrame, bucket_ms: int, *, now_ms: int, grace_ms: int) -> DataFrame:
    """The audit's one pass over the records: counts per segment, topic, `bucket_ms` of due time
    and lateness bin (each status, replayed records, duplicates, deliveries, largest lateness),
    except that a record with findings is a cell of its own, its details in `finding`. Both
    `histogram` and `findings` come from this small table."""
    s = F.col("status")
    kinds = finding_kinds(now_ms, grace_ms)
    finding = F.when(F.size(kinds) > 0, F.struct(*(F.col(c) for c in _FINDING_FIELDS[:-1]), kinds.alias("kinds")))
    return status.groupBy(
        "segment_ms", "topic", (F.col("due_ms") - F.col("due_ms") % bucket_ms).alias("bucket_ms"),
        lateness_bin(F.col("lateness_ms")).alias("lateness_bin"), finding.alias("finding"),
    ).agg(F.count(F.lit(1)).alias("scheduled"),
          *(F.sum(F.when(s == st, 1).otherwise(0)).alias(st) for st in STATUSES),
          F.sum(F.when(F.col("replayed") > 0, 1).otherwise(0)).alias("replayed"),
          F.sum(F.when(F.col("delivered") > 1, 1).otherwise(0)).alias("duplicates"),
          F.count("lateness_ms").alias("deliveries"),
          F.max("lateness_ms").alias("max_ms"))


def histogram(cells_df: DataFrame) -> DataFrame:
    """Counts per segment, topic, due-time bucket and lateness bin (findings folded back in)."""
    return cells_df.groupBy("segment_ms", "topic", "bucket_ms", "lateness_bin").agg(
        *(F.sum(c).alias(c) for c in _CELL_COUNTS), F.max("max_ms").alias("max_ms"))


def reconcile(hist: DataFrame) -> DataFrame:
    """Per segment and topic: scheduled, each status's count, replayed records, duplicates, and
    whether the counts add up."""
    counted = ("scheduled", *STATUSES, "replayed", "duplicates")
    out = hist.groupBy("segment_ms", "topic").agg(*(F.sum(c).alias(c) for c in counted))
    return out.withColumn("balanced", F.col("scheduled") == sum((F.col(st) for st in STATUSES), F.lit(0)))


def lateness(hist: DataFrame, by: list[str] | None = None) -> DataFrame:
    """Delivery lateness (ms) per segment and topic (or `by`; [] for all): p50 and p99 (within
    1%, from the histogram's bins), exact max, and the number of deliveries."""
    by = ["segment_ms", "topic"] if by is None else list(by)
    group = by or ["_all"]
    h = hist.where(F.col("lateness_bin").isNotNull())
    if not by:
        h = h.withColumn("_all", F.lit(0))
    h = h.groupBy(*group, "lateness_bin").agg(F.sum("deliveries").alias("n"), F.max("max_ms").alias("max_ms"))
    upto = Window.partitionBy(*group).orderBy("lateness_bin").rowsBetween(Window.unboundedPreceding, 0)
    h = h.withColumn("cum", F.sum("n").over(upto)).withColumn("total", F.sum("n").over(Window.partitionBy(*group)))
    out = h.groupBy(*group).agg(
        F.min(F.when(F.col("cum") >= F.ceil(F.col("total") * 0.5), F.col("lateness_bin"))).alias("p50_ms"),
        F.min(F.when(F.col("cum") >= F.ceil(F.col("total") * 0.99), F.col("lateness_bin"))).alias("p99_ms"),
        F.max("max_ms").alias("max_ms"), F.first("total").alias("delivered"))
    return out.drop("_all") if not by else out


def summaries(hist: DataFrame) -> DataFrame:
    """Everything the report needs from the histogram, in one table (one job to collect): column
    `level` is "segment" (counts and lateness per segment and topic), "bucket" (lateness per
    due-time bucket, for the chart) or "total" (lateness over all deliveries)."""
    late = ("p50_ms", "p99_ms", "max_ms", "delivered")
    seg = reconcile(hist).join(lateness(hist), ["segment_ms", "topic"], "left").withColumn("level", F.lit("segment"))
    bucket = lateness(hist, ["bucket_ms"]).withColumn("level", F.lit("bucket"))
    total = lateness(hist, []).withColumn("level", F.lit("total"))
    return seg.unionByName(bucket, allowMissingColumns=True).unionByName(total, allowMissingColumns=True) \
        .select("level", "segment_ms", "topic", "bucket_ms", *(c for c in seg.columns if c not in (
            "level", "segment_ms", "topic") and c not in late), *late)


def unknown_entries(dispatch: DataFrame) -> DataFrame:
    """Dispatch entries (with `record_exists`) that name no record."""
    return dispatch.where(~F.col("record_exists"))


def findings(cells_df: DataFrame, unknown: DataFrame) -> DataFrame:
    """One row per finding: lost, duplicated and corrupt records (a record both duplicated and
    corrupt gives two) from `cells`, and dispatch entries naming no record."""
    f = F.col("finding")
    detail = (F.when(F.col("kind") == "lost", F.lit("no terminal outcome"))
              .when(F.col("kind") == "duplicate",
                    F.concat(F.lit("delivered "), F.col("delivered").cast("string"), F.lit(" times")))
              .when(~F.coalesce(F.col("crc_ok"), F.lit(False)), F.lit("bytes fail their checks (CRC32C or header)"))
              .otherwise(F.lit("marked corrupt by the engine")))
    rec = cells_df.where(f.isNotNull()).select(
        "segment_ms", "topic", *(f[c].alias(c) for c in _FINDING_FIELDS[:-1]), F.explode(f["kinds"]).alias("kind"))
    rec = rec.select("kind", "segment_ms", "part", "offset", "msg_id", "topic", "due_ms", "delivered",
                     "first_delivered_ms", detail.alias("detail"))
    unk = unknown.select(
        F.lit("unknown_dispatch_entry").alias("kind"), "segment_ms", "part", "offset",
        F.lit(None).cast("string").alias("msg_id"), F.lit(None).cast("string").alias("topic"), "due_ms",
        F.lit(None).cast("int").alias("delivered"), F.lit(None).cast("long").alias("first_delivered_ms"),
        F.concat(F.lit("outcome "), F.col("outcome").cast("string"), F.lit(" names no record")).alias("detail"))
    return rec.unionByName(unk)


@dataclass
class AuditReport:
    """The audit's JSON report."""

    now_ms: int
    grace_ms: int
    scheduled: int = 0
    dispatched: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    pending: int = 0
    corrupt: int = 0
    replayed: int = 0
    lost: int = 0
    duplicates: int = 0
    unknown_dispatch_entries: int = 0
    lateness_ms: dict = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)
    lateness_by_segment: list[dict] = field(default_factory=list)
    sample_findings: list[dict] = field(default_factory=list)
    findings_path: str | None = None
    chart_path: str | None = None

    @property
    def failed(self) -> bool:
        """True when lost, duplicated or corrupt records were found."""
        return bool(self.lost or self.duplicates or self.corrupt)

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        from dataclasses import asdict

        out = asdict(self)
        out["ok"] = not self.failed
        return out


def _bucket_ms(lo: int, hi: int, points: int = 240) -> int:
    """A round bucket (a whole number of minutes, or 1 s) giving at most about `points` buckets."""
    span = max(1, hi - lo)
    raw = span / points
    if raw <= 1000:
        return 1000
    return int(math.ceil(raw / 60_000)) * 60_000


def run_audit(spark: SparkSession, data_dir: str | Path, *, now_ms: int, grace_ms: int = 300_000,
              out_dir: str | Path | None = None, sample: int = 100) -> AuditReport:
    """Audit a data directory: one pass over the records (`cells`), one over the dispatch logs.
    With `out_dir`: report.json, findings/ (Parquet), lateness.png."""
    from storage import SegmentLayout, segment_name

    data_dir = str(data_dir)
    layout = SegmentLayout.open_existing(data_dir)
    segments = layout.list_segments()
    rep = AuditReport(now_ms, grace_ms)
    rep.lateness_ms = {"p50_ms": None, "p99_ms": None, "max_ms": None, "delivered": 0}
    if not segments:
        _write_report(rep, out_dir)
        return rep
    records = spark.read.format("timewheel").schema(RECORD_COLUMNS).load(data_dir)
    status = with_status(records)
    dispatch = spark.read.format("timewheel_dispatch").schema(DISPATCH_COLUMNS).load(data_dir)
    table = cells(status, _bucket_ms(segments[0], segments[-1] + layout.segment_ms), now_ms=now_ms,
                  grace_ms=grace_ms).persist()
    try:
        late = ("p50_ms", "p99_ms", "max_ms", "delivered")
        rows = [r.asDict() for r in summaries(histogram(table)).collect()]
        for r in sorted((r for r in rows if r["level"] == "segment"), key=lambda r: (r["segment_ms"], r["topic"] or "")):
            head = {"segment_ms": r["segment_ms"], "segment": segment_name(r["segment_ms"]), "topic": r["topic"]}
            rep.segments.append(head | {k: r[k] for k in ("scheduled", *STATUSES, "replayed", "duplicates",
                                                          "balanced")})
            if r["delivered"]:
                rep.lateness_by_segment.append(head | {k: r[k] for k in late})
        for k in ("scheduled", *STATUSES, "replayed"):
            setattr(rep, k, int(sum(r[k] for r in rep.segments)))
        total = [r for r in rows if r["level"] == "total"]
        if total:
            rep.lateness_ms = {k: total[0][k] for k in late}
        series = sorted((r for r in rows if r["level"] == "bucket"), key=lambda r: r["bucket_ms"])
        name = F.udf(segment_name, "string", useArrow=False)
        found = findings(table, unknown_entries(dispatch))
        found = found.select("kind", "segment_ms", name("segment_ms").alias("segment"),
                             *(c for c in found.columns if c not in ("kind", "segment_ms")))
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            rep.findings_path = str(out / "findings")
            found.write.mode("overwrite").parquet(rep.findings_path)
            found = spark.read.parquet(rep.findings_path)
        else:
            found = found.persist()
        counts = {r["kind"]: r["count"] for r in found.groupBy("kind").count().collect()}
        rep.sample_findings = [r.asDict() for r in
                               found.orderBy("kind", "segment_ms", "part", "offset").limit(sample).collect()]
        found.unpersist()
    finally:
        table.unpersist()
    rep.lost = counts.get("lost", 0)
    rep.duplicates = counts.get("duplicate", 0)
    rep.unknown_dispatch_entries = counts.get("unknown_dispatch_entry", 0)
    if out_dir is not None and series:
        rep.chart_path = write_chart(series, Path(out_dir) / "lateness.png")
    _write_report(rep, out_dir)
    return rep


def _write_report(rep: AuditReport, out_dir: str | Path | None) -> None:
    """Write report.json into `out_dir`, when given."""
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "report.json").write_text(json.dumps(rep.as_dict(), indent=2) + "\n")


def write_chart(series: list[dict], path: Path) -> str | None:
    """A PNG of lateness p50/p99/max over due time; None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from datetime import datetime, timezone

    import matplotlib.pyplot as plt

    t = [datetime.fromtimestamp(r["bucket_ms"] / 1000, tz=timezone.utc) for r in series]
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max")):
        ax.plot(t, [max(r[key], 0.5) for r in series], label=label, linewidth=1.2, marker="." if len(t) < 60 else None)
    ax.set_yscale("log")
    ax.set_ylabel("lateness (ms): dispatch - due")
    ax.set_xlabel("due time (UTC)")
    ax.set_title("timewheel delivery lateness")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)

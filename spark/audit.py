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
pending (`reconcile`). The precedence is `storage.audit.record_status`, which `timewheel inspect`
uses too; `with_status` is the same rule as Spark expressions, for DataFrames of records (export).
Findings (`findings`): lost records (pending, due before `now - grace`), duplicates (delivered more
than once; REPLAYED entries are an operator's re-sends, not duplicates), corrupt records, records a
part of a segment that ended before `now - grace` cannot give back (`unreadable_records`, see
`spark._damage`: index entries past the end of the log, a log without its index), and dispatch
entries naming no record. All of them fail the audit but the last, which fails it only in a
segment that ended before `now - grace`: nothing records an outcome for a record it has not
indexed, and the audit lists a segment's parts after reading its dispatch log, so there such an
entry names a record gone; in a segment still being written it is reported only, as a record
pending there is not lost yet. Copies of sidecars a crash left beside parts (`leftover_copies`,
`timewheel inspect`'s `leftover_copy`) are listed with what settling them does, and do not fail it.
Lateness (`lateness`): dispatch_ms - due_ms of each record's first
delivery, p50/p99/max per segment and topic.

The per-record work happens in numpy inside the partitions of the `timewheel_audit` source
(`cells`, see `spark._cells`): Spark only sees a few thousand cells per part file, so the audit
is one scan and one small shuffle (`histogram`). `histogram` and `findings` are `DataFrame ->
DataFrame`; `reconcile` and `lateness` reduce the collected histogram (Arrow, bounded by segments
x topics x lateness bins) on the driver; `run_audit` does the I/O.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark._util import require_readable
from storage import DELIVERED, SegmentLayout, leftovers_of
from storage.audit import OUTCOME_COUNTS as _OUTCOME_OF
from storage.audit import STATUSES

KEY = ["segment_ms", "part", "offset"]
OUTCOME_COUNTS = tuple(_OUTCOME_OF)
#: what the audit reads of each record: identity, topic, due time, checks, and its outcomes
RECORD_COLUMNS = ("segment_ms long, part int, offset long, msg_id string, topic string, "
                  "due_ms long, crc_ok boolean, delivered int, dead_lettered int, cancelled int, "
                  "marked_corrupt int, replayed int, first_delivered_ms long")
FINDING_KINDS = ("lost", "duplicate", "corrupt", "unreadable_records", "unknown_dispatch_entry")
# the audit fails (exit 1) when it finds any of these, or an unknown_dispatch_entry of a settled segment
FAILING_KINDS = ("lost", "duplicate", "corrupt", "unreadable_records")


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
    """Records with outcome columns, plus `lateness_ms` (first delivery - due) and `status`
    (`storage.audit.record_status`'s precedence, bad bytes first)."""
    c = {k: F.coalesce(F.col(k), F.lit(0)) for k in OUTCOME_COUNTS}
    status = (F.when(~F.coalesce(F.col("crc_ok"), F.lit(False)), "corrupt")
              .when(c["cancelled"] > 0, "cancelled")
              .when(c["delivered"] > 0, "dispatched")
              .when(c["dead_lettered"] > 0, "dead_lettered")
              .when(c["marked_corrupt"] > 0, "corrupt")
              .otherwise("pending"))
    return records.withColumn("lateness_ms", F.col("first_delivered_ms") - F.col("due_ms")) \
        .withColumn("status", status)


_CELL_COUNTS = ("scheduled", *STATUSES, "replayed", "lost", "duplicates", "deliveries", "unknown_entries",
                "unreadable")
_RECONCILED = ("scheduled", *STATUSES, "replayed", "lost", "duplicates")
_LATE = ("p50_ms", "p99_ms", "max_ms", "delivered")
_FINDING_FIELDS = ("part", "offset", "msg_id", "due_ms", "delivered", "first_delivered_ms", "crc_ok", "outcome",
                   "reason")


def cells(spark: SparkSession, data_dir: str | Path, *, bucket_ms: int, now_ms: int, grace_ms: int) -> DataFrame:
    """The audit's one pass over the records: counts per segment, topic, `bucket_ms` of due time
    and lateness bin, a record with findings (or a dispatch entry naming no record) a cell of its
    own; computed in numpy inside each partition (`spark._cells`). `histogram` and `findings` come
    from this small table."""
    return (spark.read.format("timewheel_audit")
            .options(now_ms=str(now_ms), grace_ms=str(grace_ms), bucket_ms=str(bucket_ms)).load(str(data_dir)))


def histogram(cells_df: DataFrame) -> DataFrame:
    """Counts per segment, topic, due-time bucket and lateness bin (findings folded back in). Its
    size is bounded by segments x topics x buckets x bins, whatever the number of records; the
    report's figures are computed from it on the driver (`reconcile`, `lateness`)."""
    return cells_df.groupBy("segment_ms", "topic", "bucket_ms", "lateness_bin").agg(
        *(F.sum(c).alias(c) for c in _CELL_COUNTS), F.max("max_ms").alias("max_ms"))


def _groups(hist: pa.Table, by: Sequence[str]) -> tuple[np.ndarray, list[tuple]]:
    """Group number of each histogram row by the columns `by` (nulls a group of their own), and
    each group's key values, in order of the keys."""
    combined = np.zeros(hist.num_rows, np.int64)
    values, codes = [], []
    for c in by:
        enc = pc.dictionary_encode(hist[c].combine_chunks())
        code = enc.indices.fill_null(len(enc.dictionary)).to_numpy().astype(np.int64)  # null: one past the end
        values.append(enc.dictionary.to_pylist() + [None])
        codes.append(code)
        combined = combined * (len(enc.dictionary) + 1) + code
    _, first, group = np.unique(combined, return_index=True, return_inverse=True)
    keys = [tuple(values[j][codes[j][i]] for j in range(len(by))) for i in first.tolist()]
    return group.reshape(-1), keys


def _col(hist: pa.Table, name: str, fill: int = 0) -> np.ndarray:
    """A histogram column as int64 numpy, nulls as `fill`."""
    return hist[name].combine_chunks().fill_null(fill).to_numpy().astype(np.int64)


def reconcile(hist: pa.Table) -> list[dict]:
    """Per segment and topic that has records: scheduled, each status's count, replayed, lost and
    duplicated records, and whether the counts add up."""
    group, keys = _groups(hist, ["segment_ms", "topic"])
    sums = {c: np.zeros(len(keys), np.int64) for c in _RECONCILED}
    for c in _RECONCILED:
        np.add.at(sums[c], group, _col(hist, c))
    out = []
    for i, (seg, topic) in enumerate(keys):
        row = {"segment_ms": seg, "topic": topic, **{c: int(sums[c][i]) for c in _RECONCILED}}
        if row["scheduled"]:  # a group of dispatch entries naming no record counts nothing
            out.append(row | {"balanced": row["scheduled"] == sum(row[st] for st in STATUSES)})
    return out


def lateness(hist: pa.Table, by: Sequence[str] | None = None) -> list[dict]:
    """Delivery lateness (ms) per segment and topic (or `by`; [] for all): p50 and p99 (nearest
    rank within 1%, from the histogram's bins), exact max, and the number of deliveries."""
    by = ["segment_ms", "topic"] if by is None else list(by)
    hist = hist.filter(pc.is_valid(hist["lateness_bin"]))
    if not hist.num_rows:
        return []
    group, keys = _groups(hist, by)
    late, n, top = _col(hist, "lateness_bin"), _col(hist, "deliveries"), _col(hist, "max_ms")
    order = np.lexsort((late, group))
    group, late, n, top = group[order], late[order], n[order], top[order]
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    cum = np.cumsum(n)
    total = np.add.reduceat(n, starts)
    before = cum[starts] - n[starts]
    ranks = {q: late[np.searchsorted(cum, before + np.ceil(total * f).astype(np.int64), "left")]
             for q, f in (("p50_ms", 0.5), ("p99_ms", 0.99))}
    most = np.maximum.reduceat(top, starts)
    return [dict(zip(by, keys[g])) | {"p50_ms": int(ranks["p50_ms"][i]), "p99_ms": int(ranks["p99_ms"][i]),
                                      "max_ms": int(most[i]), "delivered": int(total[i])}
            for i, g in enumerate(group[starts].tolist())]


def findings(cells_df: DataFrame) -> DataFrame:
    """One row per finding: lost, duplicated and corrupt records (a record both duplicated and
    corrupt gives two), a part's records that cannot be read, and dispatch entries naming no
    record, from `cells`."""
    f, kind = F.col("finding"), F.col("kind")
    detail = (F.when(kind == "unreadable_records", F.col("reason"))
              .when(kind == "lost", F.lit("no terminal outcome"))
              .when(kind == "duplicate", F.concat(F.lit("delivered "), F.col("delivered").cast("string"),
                                                  F.lit(" times")))
              .when(kind == "unknown_dispatch_entry",
                    F.concat(F.lit("outcome "), F.col("outcome").cast("string"), F.lit(" names no record")))
              .when(~F.coalesce(F.col("crc_ok"), F.lit(False)), F.lit("bytes fail their checks (CRC32C or header)"))
              .otherwise(F.lit("marked corrupt by the engine")))
    rec = cells_df.where(f.isNotNull()).select(
        "segment_ms", "segment", "topic", *(f[c].alias(c) for c in _FINDING_FIELDS),
        F.explode(f["kinds"]).alias("kind"))
    return rec.select("kind", "segment_ms", "segment", "part", "offset", "msg_id", "topic", "due_ms", "delivered",
                      "first_delivered_ms", detail.alias("detail"))


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
    unreadable_records: int = 0  # records settled parts cannot give back (not among `scheduled`)
    unknown_dispatch_entries: int = 0
    unknown_dispatch_entries_settled: int = 0  # of those, the ones of segments that ended before now - grace
    lateness_ms: dict = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)
    lateness_by_segment: list[dict] = field(default_factory=list)
    sample_findings: list[dict] = field(default_factory=list)
    findings_path: str | None = None
    chart_path: str | None = None
    #: copies of sidecars a crash left beside parts (`storage.check`'s `leftover_copy`), each with what
    #: `timewheel inspect --fix` does with it: not a fault of any record, so the audit does not fail on them
    leftover_copies: list[dict] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """True when lost, duplicated, corrupt or unreadable records were found, or dispatch entries
        naming no record in a segment that ended before now - grace."""
        return bool(self.lost or self.duplicates or self.corrupt or self.unreadable_records
                    or self.unknown_dispatch_entries_settled)

    def as_dict(self) -> dict:
        """Plain dict for JSON."""
        from dataclasses import asdict

        out = asdict(self)
        out["ok"] = not self.failed
        return out


def leftover_copies(layout: SegmentLayout, segments: Sequence[int]) -> list[dict]:
    """The copies of sidecars a crash left beside the parts of `segments` (a listing, read in the driver):
    each one's path and what settling it does (`storage.Leftover.plan`)."""
    return [{"path": str(copy.path), "plan": copy.plan()}
            for seg in segments for part in layout.list_parts(seg) for copy in leftovers_of(layout.part_log(seg, part))]


def _bucket_ms(lo: int, hi: int, points: int = 240) -> int:
    """A round bucket (a whole number of minutes, or 1 s) giving at most about `points` buckets."""
    span = max(1, hi - lo)
    raw = span / points
    if raw <= 1000:
        return 1000
    return int(math.ceil(raw / 60_000)) * 60_000


def run_audit(spark: SparkSession, data_dir: str | Path, *, now_ms: int, grace_ms: int = 300_000,
              out_dir: str | Path | None = None, sample: int = 100) -> AuditReport:
    """Audit a data directory: one scan reducing records to cells (`cells`, cached), then at
    most three small jobs: the histogram (collected), the findings (written), a sample of them.
    With `out_dir`: report.json, findings/ (Parquet), lateness.png."""
    from storage import segment_name

    layout = SegmentLayout.open_existing(data_dir)
    require_readable(layout)
    segments = layout.list_segments()
    rep = AuditReport(now_ms, grace_ms)
    rep.lateness_ms = {"p50_ms": None, "p99_ms": None, "max_ms": None, "delivered": 0}
    rep.leftover_copies = leftover_copies(layout, segments)
    if not segments:
        _write_report(rep, out_dir)
        return rep
    bucket = _bucket_ms(segments[0], segments[-1] + layout.segment_ms)
    # cached: the histogram and the findings both read it, and it is small (cells, not records)
    table = cells(spark, data_dir, bucket_ms=bucket, now_ms=now_ms, grace_ms=grace_ms).persist()
    try:
        hist = histogram(table).toArrow()  # small (see histogram): the report's figures come from it here
        by_seg = {(r["segment_ms"], r["topic"]): r for r in lateness(hist)}
        for r in sorted(reconcile(hist), key=lambda r: (r["segment_ms"], r["topic"] or "")):
            head = {"segment_ms": r["segment_ms"], "segment": segment_name(r["segment_ms"]), "topic": r["topic"]}
            rep.segments.append(head | {k: r[k] for k in (*_RECONCILED, "balanced")})
            if (r["segment_ms"], r["topic"]) in by_seg:
                rep.lateness_by_segment.append(head | {k: by_seg[r["segment_ms"], r["topic"]][k] for k in _LATE})
        for k in ("scheduled", *STATUSES, "replayed"):
            setattr(rep, k, int(sum(r[k] for r in rep.segments)))
        total = lateness(hist, [])
        if total:
            rep.lateness_ms = {k: total[0][k] for k in _LATE}
        series = sorted(lateness(hist, ["bucket_ms"]), key=lambda r: r["bucket_ms"])
        unknown = _col(hist, "unknown_entries")
        done = _col(hist, "segment_ms") + layout.segment_ms <= now_ms - grace_ms  # as spark._damage.settled
        counts = {"lost": int(_col(hist, "lost").sum()), "duplicate": int(_col(hist, "duplicates").sum()),
                  "unknown_dispatch_entry": int(unknown.sum()), "settled_unknown": int(unknown[done].sum()),
                  "unreadable_records": int(_col(hist, "unreadable").sum())}
        found = findings(table)
        any_found = bool(counts["lost"] or counts["duplicate"] or counts["unknown_dispatch_entry"] or rep.corrupt
                         or counts["unreadable_records"])
        if out_dir is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if any_found:
                rep.findings_path = str(out / "findings")
                found.write.mode("overwrite").parquet(rep.findings_path)
            else:  # nothing found: an empty table, without a Spark job
                rep.findings_path = _write_empty_findings(found, out / "findings")
        if any_found:
            rep.sample_findings = [r.asDict() for r in
                                   found.orderBy("kind", "segment_ms", "part", "offset").limit(sample).collect()]
    finally:
        table.unpersist()
    rep.lost = counts.get("lost", 0)
    rep.duplicates = counts.get("duplicate", 0)
    rep.unknown_dispatch_entries = counts.get("unknown_dispatch_entry", 0)
    rep.unknown_dispatch_entries_settled = counts.get("settled_unknown", 0)
    rep.unreadable_records = counts.get("unreadable_records", 0)
    if out_dir is not None and series:
        rep.chart_path = write_chart(series, Path(out_dir) / "lateness.png")
    _write_report(rep, out_dir)
    return rep


def _write_empty_findings(found: DataFrame, path: Path) -> str:
    """An empty findings table (Parquet, the findings' schema), replacing what `path` held."""
    import shutil

    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    pq.write_table(to_arrow_schema(found.schema, timezone="UTC").empty_table(), path / "part-00000.parquet")
    return str(path)


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
        ax.plot(t, [max(r[key], 0.5) for r in series],  # type: ignore[arg-type]  # matplotlib plots datetimes
                label=label, linewidth=1.2, marker="." if len(t) < 60 else None)
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

"""The audit's per-record work, done in numpy inside a data-source partition: one part's records
(and, for the first part of a segment, the dispatch entries naming no record) reduced to the small
`spark.schema.AUDIT_CELLS` table the audit aggregates further in Spark.

A record's status comes from `storage.audit.record_status` (the precedence `timewheel inspect`
uses, bad bytes first). Records without findings are counted per topic, due-time bucket and
lateness bin; a record with findings (lost, duplicate, corrupt) is a cell of its own carrying its
details in `finding`; so is a dispatch entry naming no record (with all counts 0), and a settled
part's records that cannot be read (`spark._damage`: counted in `unreadable`). Shipping a few
thousand cells per part to the JVM, instead of every record, is what makes the audit one cheap
shuffle over a small table rather than a shuffle of every record.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spark._codec import OUTCOME_COLUMNS, PartFiles, read_part, segment_identity
from spark._damage import PartDamage
from storage import read_dispatch_log
from storage.audit import CORRUPT_STATUS, NO_TIME, PENDING, STATUSES, known_keys, outcomes_of, record_status

#: what makes a record a finding of its own, in the order a record's kinds are listed
RECORD_FINDINGS = ("lost", "duplicate", "corrupt")
UNKNOWN_ENTRY = "unknown_dispatch_entry"
UNREADABLE = "unreadable_records"
_READ = ("offset", "msg_id", "topic", "due_ms", "crc_ok", *OUTCOME_COLUMNS, "first_delivered_ms")
_COUNTS = ("scheduled", *STATUSES, "replayed", "lost", "duplicates", "deliveries", "unknown_entries", "unreadable")
_NO_LATENESS = np.iinfo(np.int64).min  # stands for "never delivered" in a lateness array
_FINDING_TYPE = pa.struct([
    ("part", pa.int32()), ("offset", pa.int64()), ("msg_id", pa.string()), ("due_ms", pa.int64()),
    ("delivered", pa.int32()), ("first_delivered_ms", pa.int64()), ("crc_ok", pa.bool_()),
    ("outcome", pa.int32()), ("kinds", pa.list_(pa.string())), ("reason", pa.string()),
])


def lateness_bins(ms: np.ndarray) -> np.ndarray:
    """Lateness rounded toward zero to within 1%: exact below 1024 ms, then 128 steps per power of
    two (as HdrHistogram does with 2 significant digits)."""
    a = np.abs(ms.astype(np.int64))
    _, e = np.frexp(a.astype(np.float64))  # a = m * 2**e with m in [0.5, 1): floor(log2 a) = e - 1
    step = np.left_shift(np.int64(1), np.maximum(e.astype(np.int64) - 8, 0))
    binned = np.where(a < 1024, a, a // step * step)
    return np.where(ms < 0, -binned, binned)


def _concat(batches: list[dict[str, pa.Array]]) -> dict[str, pa.Array]:
    """One array per column out of read_part's batches."""
    return {c: pa.concat_arrays([b[c] for b in batches]) for c in _READ}


def _finding_kinds(flags: Sequence[np.ndarray], names: Sequence[str]) -> pa.Array:
    """list<string> of the names whose flag is set, per row."""
    stacked = np.stack(flags, axis=1)
    counts = stacked.sum(axis=1)
    offsets = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    values = np.broadcast_to(np.array(names, object), stacked.shape)[stacked]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.tolist(), pa.string()))


def part_cells(pf: PartFiles, *, bucket_ms: int, now_ms: int, grace_ms: int, verify: bool = True) -> dict[str, pa.Array]:
    """The cells of one part's records (columns of AUDIT_CELLS, `segment_ms`/`segment` excepted)."""
    batches = list(read_part(pf, _READ, verify=verify))
    if not batches:
        return {}
    cols = _concat(batches)
    n = len(cols["offset"])
    due = cols["due_ms"].to_numpy()
    ok = cols["crc_ok"].to_numpy(zero_copy_only=False)
    counts = {k: cols[k].to_numpy() for k in OUTCOME_COLUMNS}
    first = cols["first_delivered_ms"].fill_null(NO_TIME).to_numpy()
    status = record_status(counts, bad=~ok)
    delivered = first != NO_TIME
    late = np.where(delivered, first - due, _NO_LATENESS)
    lbin = np.where(delivered, lateness_bins(late), _NO_LATENESS)
    bucket = due - due % bucket_ms
    flags = ((status == PENDING) & (due < now_ms - grace_ms), counts["delivered"] > 1, status == CORRUPT_STATUS)
    finding = flags[0] | flags[1] | flags[2]
    values = {"scheduled": np.ones(n, np.int64),
              **{st: (status == i).astype(np.int64) for i, st in enumerate(STATUSES)},
              "replayed": (counts["replayed"] > 0).astype(np.int64), "lost": flags[0].astype(np.int64),
              "duplicates": flags[1].astype(np.int64), "deliveries": delivered.astype(np.int64),
              "unknown_entries": np.zeros(n, np.int64), "unreadable": np.zeros(n, np.int64)}
    enc = pc.dictionary_encode(cols["topic"])
    topics = enc.dictionary
    codes = enc.indices.fill_null(len(topics)).to_numpy().astype(np.int64)  # a null topic is code len(topics)

    # records without findings: one row per (topic, bucket, lateness bin), sums and the largest lateness
    rest = np.flatnonzero(~finding)
    lb_values, lb_code = np.unique(lbin[rest], return_inverse=True)
    b_code = (bucket[rest] - int(bucket.min())) // bucket_ms
    key = (codes[rest] * (int(b_code.max(initial=0)) + 1) + b_code) * len(lb_values) + lb_code
    perm = np.argsort(key, kind="stable")
    order, sk = rest[perm], key[perm]
    starts = np.flatnonzero(np.concatenate(([True], sk[1:] != sk[:-1]))) if len(sk) else np.empty(0, np.int64)
    grouped = {c: np.add.reduceat(values[c][order], starts) if len(starts) else np.empty(0, np.int64)
               for c in _COUNTS}
    g_max = np.maximum.reduceat(late[order], starts) if len(starts) else np.empty(0, np.int64)
    head = order[starts]

    # records with findings: a row each
    fi = np.flatnonzero(finding)
    rows = np.concatenate((head, fi))
    out_counts = {c: np.concatenate((grouped[c], values[c][fi])) for c in _COUNTS}
    out_max = np.concatenate((g_max, late[fi]))
    out_bin = lbin[rows]
    kinds = _finding_kinds([f[fi] for f in flags], RECORD_FINDINGS)
    details = pa.StructArray.from_arrays(
        [pa.array(np.full(len(fi), pf.part, np.int32)), cols["offset"].take(fi), cols["msg_id"].take(fi),
         pa.array(due[fi]), pa.array(counts["delivered"][fi]),
         pa.array(first[fi], mask=first[fi] == NO_TIME), pa.array(ok[fi]), pa.nulls(len(fi), pa.int32()), kinds,
         pa.nulls(len(fi), pa.string())],
        fields=list(_FINDING_TYPE))
    finding_col = pa.concat_arrays([pa.nulls(len(head), _FINDING_TYPE), details])
    topic_col = pa.concat_arrays([topics, pa.nulls(1, pa.string())]).take(pa.array(codes[rows]))
    return {"topic": topic_col, "bucket_ms": pa.array(bucket[rows]),
            "lateness_bin": pa.array(out_bin, mask=out_bin == _NO_LATENESS), "finding": finding_col,
            **{c: pa.array(v) for c, v in out_counts.items()},
            "max_ms": pa.array(out_max, mask=out_max == _NO_LATENESS)}


def unknown_entry_cells(dispatch_log: str, parts_now: Callable[[], Sequence[tuple[int, str, str]]]
                        ) -> dict[str, pa.Array]:
    """Cells of the dispatch entries of a segment that name no record of its parts (entries past
    the end of a part's log count as naming nothing, as readers skip those records). `parts_now`
    lists the segment's parts as (number, log, index) once the entries are read: a part made after
    the audit was planned (a late message stored in its past segment) holds records they name."""
    import os

    segment = segment_identity(dispatch_log)
    entries = read_dispatch_log(dispatch_log).entries if os.path.exists(dispatch_log) else None
    if entries is None or not len(entries):
        return {}
    try:
        known = known_keys(parts_now())
    except FileNotFoundError:
        return {}  # retired meanwhile (its directory, or a part of it, gone)
    if segment is None or segment_identity(dispatch_log) != segment:
        return {}  # retired meanwhile: its parts may have gone after its dispatch log was read
    stray = entries[~outcomes_of(known, entries).entry_hit]
    m = len(stray)
    if not m:
        return {}
    details = pa.StructArray.from_arrays(
        [pa.array(stray["part"].astype(np.int32)), pa.array(stray["offset"].astype(np.int64)),
         pa.nulls(m, pa.string()), pa.array(stray["due_ms"].astype(np.int64)), pa.nulls(m, pa.int32()),
         pa.nulls(m, pa.int64()), pa.nulls(m, pa.bool_()), pa.array(stray["outcome"].astype(np.int32)),
         _finding_kinds([np.ones(m, bool)], (UNKNOWN_ENTRY,)), pa.nulls(m, pa.string())],
        fields=list(_FINDING_TYPE))
    zero = pa.array(np.zeros(m, np.int64))
    return {"topic": pa.nulls(m, pa.string()), "bucket_ms": pa.nulls(m, pa.int64()),
            "lateness_bin": pa.nulls(m, pa.int64()), "finding": details, **{c: zero for c in _COUNTS},
            "unknown_entries": pa.array(np.ones(m, np.int64)), "max_ms": pa.nulls(m, pa.int64())}


def damage_cells(damage: PartDamage) -> dict[str, pa.Array]:
    """The cell of a settled part's records that cannot be read: a finding of its own (the part,
    where the first starts, why), every count 0 but `unreadable`."""
    details = pa.StructArray.from_arrays(
        [pa.array([damage.part], pa.int32()), pa.array([damage.offset], pa.int64()), pa.nulls(1, pa.string()),
         pa.nulls(1, pa.int64()), pa.nulls(1, pa.int32()), pa.nulls(1, pa.int64()), pa.nulls(1, pa.bool_()),
         pa.nulls(1, pa.int32()), _finding_kinds([np.ones(1, bool)], (UNREADABLE,)), pa.array([damage.detail])],
        fields=list(_FINDING_TYPE))
    zero = pa.array(np.zeros(1, np.int64))
    return {"topic": pa.nulls(1, pa.string()), "bucket_ms": pa.nulls(1, pa.int64()),
            "lateness_bin": pa.nulls(1, pa.int64()), "finding": details, **{c: zero for c in _COUNTS},
            "unreadable": pa.array([damage.records], pa.int64()), "max_ms": pa.nulls(1, pa.int64())}

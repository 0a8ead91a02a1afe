"""The zero-duplicates harness's independent checker: every queue of every target topic read from
offset 0 on every broker with plain PULL_MESSAGE requests (a group of its own, nothing committed),
each copy counted per `TW_ORIGINAL_MSG_ID` and compared with what the producers had acknowledged.

It trusts nothing of the engines' own bookkeeping (dispatch logs, counters): only what the brokers
store. Each duplicate is put in the round during which its second (third, ...) copy was stored, by
the broker's store timestamp; each lost message in the round during which it came due.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordination import EPOCH_PROPERTY
from forwarder.contract import ORIGINAL_MSG_ID
from forwarder.rocketmq import Connection, NameServerClient, decode_messages
from forwarder.rocketmq.namesrv import parse_route
from forwarder.rocketmq.protocol import PULL_MESSAGE, PULL_NOT_FOUND, PULL_OFFSET_MOVED, PULL_RETRY_IMMEDIATELY, SUCCESS
from tests.coordination.cluster import Sent

_SUBSCRIPTION_FLAG = 4  # the request carries its subscription ("*"): the group needs no state on the broker
COUNTERS = ("found", "missing", "unknown", "looked_up", "episodes")


@dataclass(frozen=True, slots=True)
class StoredCopy:
    """One message stored on a target queue."""

    original_id: str  # its TW_ORIGINAL_MSG_ID ("" if it carries none)
    msg_id: str  # its own UNIQ_KEY
    body: bytes
    store_ms: int
    epoch: int  # the lease epoch a replica set's holder stamped on it (-1: none)
    where: str  # broker:queue@offset


class TopicReader:
    """Reads every queue of one topic on every broker from offset 0; `read()` returns what is new
    since the last call (a fresh reader reads everything again)."""

    def __init__(self, namesrv: str, topic: str, timeout: float = 5.0) -> None:
        """Nothing connects until read()."""
        self.namesrv, self.topic, self.timeout = namesrv, topic, timeout
        self.group = f"zero_dups_checker_{uuid.uuid4().hex[:8]}"
        self.offsets: dict[tuple[str, int], int] = {}
        self.problems: list[str] = []

    def read(self) -> list[StoredCopy]:
        """Every copy stored since the previous read (from offset 0 the first time)."""
        names = NameServerClient(self.namesrv, self.timeout)
        try:
            doc = names.route_document(self.topic)
        finally:
            names.close()
        if doc is None:
            raise AssertionError(f"no route to {self.topic}")
        route = parse_route(self.topic, doc, readable=True)
        out: list[StoredCopy] = []
        for broker, addr in route.brokers.items():
            conn = Connection(addr, self.timeout)
            try:
                for name, qid in route.queues:
                    if name == broker:
                        out += self._read_queue(conn, broker, qid)
            finally:
                conn.close()
        return out

    def _read_queue(self, conn: Connection, broker: str, qid: int) -> list[StoredCopy]:
        out: list[StoredCopy] = []
        offset = self.offsets.get((broker, qid), 0)
        retries = 0
        while True:
            ext = {"consumerGroup": self.group, "topic": self.topic, "queueId": str(qid), "queueOffset": str(offset),
                   "maxMsgNums": "32", "sysFlag": str(_SUBSCRIPTION_FLAG), "commitOffset": "0",
                   "suspendTimeoutMillis": "0", "subscription": "*", "subVersion": "0", "expressionType": "TAG"}
            resp = conn.request(PULL_MESSAGE, ext, b"", time.monotonic() + self.timeout)
            nxt = int(resp.ext.get("nextBeginOffset", offset))
            if resp.code == SUCCESS:
                for m in decode_messages(resp.body, broker=broker):
                    out.append(StoredCopy(m.properties.get(ORIGINAL_MSG_ID, ""), m.msg_id, m.body, m.store_timestamp,
                                          int(m.properties.get(EPOCH_PROPERTY, "-1")),
                                          f"{broker}:{qid}@{m.queue_offset}"))
                offset = nxt
            elif resp.code == PULL_RETRY_IMMEDIATELY:
                # nothing readable up to nxt: asked again a few times, then a gap the checker reports
                retries += 1
                if retries < 3:
                    time.sleep(0.2)
                    continue
                if nxt <= offset:
                    raise AssertionError(f"pull of {self.topic} {broker}:{qid}@{offset} answered {resp.code} "
                                         f"{retries} times: {resp.remark}")
                self.problems.append(f"{self.topic} {broker}:{qid}: offsets {offset}..{nxt} could not be read")
                offset = nxt
            elif resp.code == PULL_OFFSET_MOVED:
                if nxt > offset:
                    self.problems.append(f"{self.topic} {broker}:{qid}: offsets {offset}..{nxt} are gone")
                offset = nxt
            elif resp.code == PULL_NOT_FOUND:
                break
            else:
                raise AssertionError(f"pull of {self.topic} {broker}:{qid}@{offset} answered {resp.code}: {resp.remark}")
            retries = 0
            if offset >= int(resp.ext.get("maxOffset", offset + 1)):
                break
        self.offsets[(broker, qid)] = offset
        return out


@dataclass
class RoundRecord:
    """What one round did, for the checker: its window, the engine that recovered and its counters."""

    number: int
    fault: str
    start_ms: int
    end_ms: int = 0
    recovered_by: str = ""
    takeover_s: float | None = None
    #: the recovering engine's dedupe counters over the round (None: its status carries none)
    dedupe: dict[str, int] | None = None
    resolve_ms_max: int | None = None
    #: (epoch, ms): copies stamped with that deposed epoch and stored after that time are failures
    fenced: list[tuple[int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Report:
    """Per round and in total: acknowledged, lost, duplicates and the engines' look-up counters."""

    rows: list[dict[str, Any]]
    totals: dict[str, Any]
    failures: list[str]

    def table(self) -> str:
        """The rounds as a Markdown table."""
        lines = ["| round | fault | recovered by | takeover s | acked (due in round) | lost | duplicates stored | "
                 "found | re-sent (missing) | unknown | resolve ms max | notes |",
                 "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in self.rows:
            lines.append(f"| {r['round']} | {r['fault']} | {r['recovered_by']} | {_dash(r['takeover_s'])} | "
                         f"{r['acked']} | {r['lost']} | {r['duplicates']} | {_dash(r['found'])} | "
                         f"{_dash(r['missing'])} | {_dash(r['unknown'])} | {_dash(r['resolve_ms_max'])} | "
                         f"{'; '.join(r['notes'])} |")
        t = self.totals
        lines.append(f"| all | | | | {t['acked']} | {t['lost']} | {t['duplicates']} | {_dash(t['found'])} | "
                     f"{_dash(t['missing'])} | {_dash(t['unknown'])} | {_dash(t['resolve_ms_max'])} | |")
        return "\n".join(lines)


def _dash(v: object) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def check(rounds: Sequence[RoundRecord], sent: Mapping[bytes, Sent], copies: Iterable[StoredCopy],
          *, unacked: int = 0, problems: Sequence[str] = (), produced: Mapping[bytes, int] | None = None) -> Report:
    """Compare what the producers had acknowledged with the copies the brokers store.

    Passing needs 0 lost, 0 duplicates, no late copy of a deposed holder, and look-ups that found
    copies and look-ups that led to a re-send (summed over the run), so that it cannot pass vacuously.
    `produced`: per body, how many delay messages (distinct UNIQ_KEYs) the delay topics hold: a
    producer that sent one body twice under two ids (its own retry) gets two deliveries under two
    original ids, which is not the engines' doing.
    """
    failures = list(problems)
    starts = [r.start_ms for r in rounds]

    def round_at(ms: int) -> int:  # index into rounds, -1: before the first
        i = -1
        for k, s in enumerate(starts):
            if ms >= s:
                i = k
        return i

    per = {i: dict(acked=0, lost=0, duplicates=0) for i in range(-1, len(rounds))}
    by_id: dict[str, list[StoredCopy]] = {}
    by_body: dict[bytes, set[str]] = {}
    unnamed = 0
    for c in copies:
        if not c.original_id:
            unnamed += 1
        by_id.setdefault(c.original_id, []).append(c)
        by_body.setdefault(c.body, set()).add(c.original_id)
    dup_examples: list[str] = []
    for oid, got in by_id.items():
        got.sort(key=lambda c: c.store_ms)
        for c in got[1:]:
            per[round_at(c.store_ms)]["duplicates"] += 1
        if len(got) > 1 and len(dup_examples) < 5:
            dup_examples.append(f"{oid}: " + ", ".join(f"{c.where} stored {c.store_ms} epoch {c.epoch}" for c in got))
    lost_examples: list[str] = []
    for body, s in sent.items():
        if s.cancel_acked_ms is not None or s.cancel_unsure:
            continue
        p = per[round_at(s.effective_ms)]
        p["acked"] += 1
        if body not in by_body:
            p["lost"] += 1
            if len(lost_examples) < 5:
                lost_examples.append(f"{body.decode()} (due {s.due_ms})")
    several = [b for b, ids in by_body.items() if len(ids) > (produced or {}).get(b, 1)]
    resent_by_producer = sum(1 for n in (produced or {}).values() if n > 1)
    # a send the producer saw fail may still have been stored: a body on a delay topic was produced
    strangers = sum(1 for b in by_body if b not in sent and b not in (produced or {}))
    late = [(r, c) for r in rounds for epoch, after in r.fenced for cs in by_id.values() for c in cs
            if c.epoch == epoch and c.store_ms > after]
    rows: list[dict[str, Any]] = []
    totals: dict[str, Any] = dict(acked=per[-1]["acked"], lost=per[-1]["lost"], duplicates=per[-1]["duplicates"],
                                  found=None, missing=None, unknown=None, resolve_ms_max=None)
    for i, r in enumerate(rounds):
        p = per[i]
        d = r.dedupe or {}
        rows.append(dict(round=r.number, fault=r.fault, recovered_by=r.recovered_by, takeover_s=r.takeover_s,
                         acked=p["acked"], lost=p["lost"], duplicates=p["duplicates"], found=d.get("found"),
                         missing=d.get("missing"), unknown=d.get("unknown"), looked_up=d.get("looked_up"),
                         resolve_ms_max=r.resolve_ms_max, notes=r.notes, problems=r.problems))
        for k in ("acked", "lost", "duplicates"):
            totals[k] += p[k]
        for k in ("found", "missing", "unknown"):
            if k in d:
                totals[k] = (totals[k] or 0) + d[k]
        if r.resolve_ms_max is not None:
            totals["resolve_ms_max"] = max(totals["resolve_ms_max"] or 0, r.resolve_ms_max)
        if p["lost"]:
            failures.append(f"round {r.number} ({r.fault}): {p['lost']} acknowledged messages never stored")
        if p["duplicates"]:
            failures.append(f"round {r.number} ({r.fault}): {p['duplicates']} duplicate copies stored")
        failures += [f"round {r.number} ({r.fault}): {x}" for x in r.problems]
    totals.update(copies=sum(len(v) for v in by_id.values()), unacked=unacked, without_original_id=unnamed,
                  bodies_under_several_ids=len(several), resent_by_producer=resent_by_producer,
                  not_produced=strangers, late_deposed_copies=len(late),
                  rounds=len(rounds))
    if per[-1]["lost"] or per[-1]["duplicates"]:
        failures.append(f"before the first round: {per[-1]['lost']} lost, {per[-1]['duplicates']} duplicates")
    if unnamed or several or strangers:
        failures.append(f"{unnamed} copies without {ORIGINAL_MSG_ID}, {len(several)} bodies under more ids than "
                        f"the delay topic holds them, {strangers} bodies no producer sent; e.g. "
                        + "; ".join(f"{b[:40]!r}: {sorted(by_body[b])}" for b in several[:3]))
    for r, c in late[:5]:
        failures.append(f"round {r.number} ({r.fault}): a deposed holder's copy (epoch {c.epoch}) stored "
                        f"{c.store_ms} at {c.where}, after its deadline")
    if not totals["found"] or not totals["missing"]:
        failures.append(f"vacuous: look-ups that found copies {_dash(totals['found'])}, re-sends after a look-up "
                        f"{_dash(totals['missing'])} (both must be > 0)")
    if lost_examples:
        failures.append("lost, e.g. " + "; ".join(lost_examples))
    if dup_examples:
        failures.append("duplicates, e.g. " + "; ".join(dup_examples))
    return Report(rows, totals, failures)

"""One commit's rows in arrival order: the rows a one-pass read encoded, and between them the
messages that took the general path, encoded by the engine.

The store writes rows in the order it gets them (and keeps the first of a repeated id), so the
merge puts every row back where its message stood in its pull answer, answers in the order they
were read: the same order `DelayTopicIngest` stored them in before the one pass.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

from forwarder._ingest_pass import PulledAnswer
from forwarder.rocketmq import ReceivedMessage
from storage import EncodedRecords

__all__ = ["RowSources", "merge_answers"]


@dataclass(slots=True)
class RowSources:
    """What each row of a merged batch was read from, by runs of rows (one entry per run)."""

    starts: list[int] = field(default_factory=list)
    #: per run: (the answer, its first row there) for one-pass rows, or the message for one row
    runs: list[tuple[PulledAnswer, int] | ReceivedMessage] = field(default_factory=list)

    def add(self, start: int, source: tuple[PulledAnswer, int] | ReceivedMessage) -> None:
        """A run of rows from `start` on."""
        self.starts.append(start)
        self.runs.append(source)

    def is_general(self, row: int) -> bool:
        """Whether row `row` took the general path."""
        return isinstance(self.runs[bisect_right(self.starts, row) - 1], ReceivedMessage)

    def received(self, row: int) -> ReceivedMessage:
        """Row `row` as the general path reads it (to dead-letter it)."""
        k = bisect_right(self.starts, row) - 1
        run = self.runs[k]
        if isinstance(run, ReceivedMessage):
            return run
        answer, first = run
        return answer.received(first + row - self.starts[k])


def merge_answers(answers: Sequence[PulledAnswer], general: Sequence[ReceivedMessage], encoded: EncodedRecords,
                  refusals: Sequence[object | None]) -> tuple[EncodedRecords, RowSources]:
    """The rows of `answers` in arrival order: each answer's own rows, and in their places the
    `general` messages the engine encoded (`encoded`: one row per message whose refusal is None;
    the others, and general messages not in `general`, have no row)."""
    sources = RowSources()
    if len(answers) == 1 and not answers[0].general:  # the usual case: nothing to interleave
        sources.add(0, (answers[0], 0))
        return answers[0].rows, sources
    row_of: dict[int, int] = {}
    j = 0
    for msg, refusal in zip(general, refusals):
        if refusal is None:
            row_of[id(msg)] = j
            j += 1
    out = EncodedRecords()
    for a in answers:
        taken = prev = 0
        for at, msg in zip(a.general_at, a.general):
            if at > prev:
                sources.add(len(out), (a, taken))
                out.extend(a.rows, taken, taken + at - prev)
                taken += at - prev
            j = row_of.get(id(msg), -1)
            if j >= 0:
                sources.add(len(out), msg)
                out.extend(encoded, j, j + 1)
            prev = at + 1
        if taken < len(a.rows):
            sources.add(len(out), (a, taken))
            out.extend(a.rows, taken)
    return out, sources

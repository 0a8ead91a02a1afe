"""One send batch through the sink, its answer read row by row (`Dispatcher._sink_send` calls it)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from timewheel._held import Batch
from timewheel.message import RecordSink, SendResults, Sink

#: delivered or not per row, the broker's answers, the errors, the rows a fence held, each topic's rows
SinkAnswer = tuple[np.ndarray, np.ndarray | None, list[str | None] | None, np.ndarray | None,
                   Mapping[str, list[int]] | None]


def sink_send(sink: Sink, record_sink: RecordSink | None, b: Batch) -> SinkAnswer:
    """Send `b` through `record_sink` (its stored bytes, when the batch has them) or `sink`: delivered
    or not per row, with the broker's answers, the errors, the rows held by a fence and each topic's
    rows when the sink gives them (raises if the sink fails whole)."""
    if b.raw is not None:
        assert record_sink is not None  # only such a sink is handed stored bytes
        results = record_sink.send_records(b.raw)
    else:
        results = sink.send_batch(b.messages)
    n = len(b)
    if len(results) != n:
        raise RuntimeError(f"sink answered {len(results)} results for {n} messages")
    if isinstance(results, SendResults):
        answers = results.answers if results.answers is not None and len(results.answers) == n else None
        errors = results.errors if results.errors is not None and len(results.errors) == n else None
        held = results.held if results.held is not None and len(results.held) == n else None
        by_topic = results.by_topic
        if by_topic is not None and sum(map(len, by_topic.values())) != n:
            by_topic = None  # not every row once: the batch's own topics answer instead
        return np.asarray(results, bool), answers, errors, held, by_topic
    return np.asarray(results, bool), None, None, None, None

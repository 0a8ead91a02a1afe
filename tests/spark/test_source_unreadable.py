"""The data sources read directly (`spark.read.format("timewheel")`, `timewheel_dispatch`,
`timewheel_audit`) over a data directory holding a file they cannot read: the read is refused while
Spark plans it, in the words the jobs use (the file, why, what to check), not by a task's traceback
after other tasks may have produced rows."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.spark.conftest import HOUR, T0
from tests.spark.test_unreadable_files import _DISPATCH, _INDEX, _LOG, _stored

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

# what each source reads of a segment: records read parts and their dispatch outcomes; the dispatch
# source reads dispatch logs and the parts' indexes; the audit source all three
_CASES = [("timewheel", d) for d in (_LOG, _INDEX, _DISPATCH)] + [("timewheel_dispatch", d) for d in (_INDEX, _DISPATCH)] \
    + [("timewheel_audit", d) for d in (_LOG, _INDEX, _DISPATCH)]


@pytest.mark.parametrize(("source", "damage"), _CASES, ids=[f"{s}-{d.__name__.strip('_')}" for s, d in _CASES])
def test_a_source_read_over_a_file_it_cannot_read_is_refused_naming_it(spark: SparkSession, tmp_path: Path,
                                                                       source: str, damage: object) -> None:
    d, seg = _stored(tmp_path)
    bad = damage(d, seg)  # type: ignore[operator]
    with pytest.raises(Exception) as raised:
        reader = spark.read.format(source)
        if source == "timewheel_audit":
            reader = reader.option("now_ms", str(T0 + 3 * HOUR))
        reader.load(str(d)).collect()
    text = str(raised.value)
    assert f"cannot read {bad}: Is a directory; check that path" in text, text[-3000:]
    assert "UnreadableDataError" in text, text[-3000:]  # refused by the planner's check, not met by a task


def test_a_dispatch_log_the_records_read_do_not_need_stops_nothing(spark: SparkSession, tmp_path: Path) -> None:
    """Without outcome columns, the records source reads no dispatch log: one it cannot read is left alone."""
    d, seg = _stored(tmp_path)
    _DISPATCH(d, seg)
    rows = spark.read.format("timewheel").schema("msg_id string, due_ms long").load(str(d)).collect()
    assert len(rows) == 6

"""bench.serve_gc reads serve's GC metrics from the Prometheus text it exposes."""
from __future__ import annotations

import pytest

from bench.serve_gc import _samples, main

TEXT = """# HELP timewheel_gc_pauses_total Garbage collections, by generation.
# TYPE timewheel_gc_pauses_total counter
timewheel_gc_pauses_total{generation="0"} 12.0
timewheel_gc_pauses_total{generation="2"} 1.0
timewheel_gc_pause_seconds_total{generation="0"} 0.004
timewheel_gc_frozen_objects 53458.0
"""


def test_each_sample_of_a_family_by_its_labels() -> None:
    assert _samples(TEXT, "timewheel_gc_pauses_total") == {'timewheel_gc_pauses_total{generation="0"}': 12.0,
                                                            'timewheel_gc_pauses_total{generation="2"}': 1.0}
    assert _samples(TEXT, "timewheel_gc_frozen_objects") == {"timewheel_gc_frozen_objects": 53458.0}
    assert _samples(TEXT, "timewheel_delivered_total") == {}


def test_help_says_what_it_measures(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--no-freeze" in capsys.readouterr().out

"""What a refused command line looks like to its user, shared by the CLI's refusal tests."""
from __future__ import annotations

import pytest
from typer.testing import Result


def refused(res: Result, *words: str) -> None:
    """Exit 2 with one line, `timewheel: ...`, holding each of `words`; never a traceback."""
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("timewheel: "), res.output
    for w in words:
        assert w in res.output, res.output


def forbid_spark(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """Make any Spark session a command starts fail the test: it must refuse `what` before one starts."""
    import timewheel.app.cli_spark as cli_spark

    def no_session(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a Spark session was started for {what} the command refuses")

    monkeypatch.setattr(cli_spark, "_spark", no_session)

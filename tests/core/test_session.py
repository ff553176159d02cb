"""The Stop record and break-on parsing: the contract every front end shares."""
from __future__ import annotations

import json
import sys

import pytest

from mldebug.core.records import Stop, Violation
from mldebug.core.break_on import parse_break_on
from mldebug.core.session import Session

REPORT_KEYS = {"reason", "message", "file", "line", "function", "stage", "op", "module",
               "assertion"}


def test_stop_from_violation_carries_every_report_key():
    v = Violation(kind="nan", op="aten.log.default", torch_op="torch.log",
                  module="encoder.0", module_type="Linear", stage="forward",
                  file="/x/train.py", line=12, function="forward", nan=3, created=True)
    record = json.loads(Stop.from_violation(v).to_json())
    assert REPORT_KEYS <= set(record)
    assert record["reason"] == "nan"
    assert record["op"] == "aten.log.default"
    assert record["module"] == "encoder.0"
    assert record["count"] == 3
    assert record["message"] == (
        "3 NaN from aten.log.default (torch.log) in module encoder.0 (Linear) "
        "at train.py:12 [forward]; this op made it from finite inputs")


def test_message_names_the_input_when_the_value_came_from_outside():
    v = Violation(kind="inf", op="aten.addmm.default", stage="forward", posinf=2,
                  created=False, culprit="input 1 (mat1)", file="/t.py", line=3)
    assert Stop.from_violation(v).message.endswith(
        "it came in through input 1 (mat1), made outside the watched ops")


def test_exception_stop():
    try:
        raise ValueError("bad")
    except ValueError as exc:
        stop = Stop.from_exception(exc, sys._getframe())
    assert stop.reason == "exception"
    assert stop.exception == "ValueError: bad"
    assert stop.file == __file__ and stop.function == "test_exception_stop"


@pytest.mark.parametrize("text, expected", [
    ("nan,inf", {"nan", "inf"}),
    ("NaN, Inf ,assert", {"nan", "inf", "assert"}),
    ("inf-all", {"inf", "inf-all"}),
    ("none", set()),
])
def test_parse_break_on(text, expected):
    assert parse_break_on(text) == expected


@pytest.mark.parametrize("text, needle", [("nan,bogus", "'bogus'"), ("none,nan", "'none'")])
def test_parse_break_on_rejects_with_the_bad_word(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_break_on(text)


def test_report_is_one_json_object_per_line(tmp_path):
    session = Session(report_path=str(tmp_path / "r.jsonl"))
    session.record(Stop(reason="breakpoint", message="a"))
    session.record(Stop(reason="exception", message="b"))
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["a", "b"]


def test_a_stop_in_a_multi_rank_job_carries_its_rank_and_reports_to_its_file(
        tmp_path, monkeypatch):
    from mldebug.core import session as _session
    from mldebug.core.records import Stop
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    session = _session.Session(report_path=str(tmp_path / "stops-{rank}.jsonl"))
    stop = Stop(reason="nan", message="1 NaN")
    session.record(stop)
    assert (stop.rank, stop.local_rank, stop.world_size) == (1, 1, 2) and stop.host
    assert stop.tag == "[rank 1] "
    (line,) = (tmp_path / "stops-1.jsonl").read_text().splitlines()
    assert '"rank": 1' in line and '"world_size": 2' in line


def test_a_single_process_has_no_rank(monkeypatch):
    from mldebug.core.records import Stop
    from mldebug.core.session import Session
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    stop = Stop(reason="nan", message="1 NaN")
    Session().record(stop)
    assert stop.rank is None and stop.host is None and stop.tag == ""
    assert stop.to_dict()["rank"] is None

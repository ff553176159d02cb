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

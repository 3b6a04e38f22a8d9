"""A judged stage's record (training/recipes/gate_reports.py): what a redelivered run reports again
instead of training the stage, read back as it was written, older records included."""

import json
import math

import pytest

from contracts.evals import EvalMetric
from training.recipes.gate_reports import GATE_RECORD, Verdict, record_verdict, recorded_verdict

HELD = EvalMetric(name="held_out_loss", value=2.5, threshold=3.0, op="<=", passed=True, sentence="held")


def test_a_stage_not_judged_has_no_verdict(tmp_path):
    assert recorded_verdict(tmp_path) is None


@pytest.mark.parametrize(
    "verdict",
    [
        Verdict(metrics=[HELD], passed=True, findings=["train loss far below held-out loss"]),
        Verdict(metrics=[HELD, EvalMetric(name="task_accuracy", value=0.25, passed=False)], passed=False),
        Verdict(metrics=[], passed=True),
    ],
)
def test_a_verdict_reads_back_as_recorded(tmp_path, verdict):
    record_verdict(tmp_path, verdict)
    assert recorded_verdict(tmp_path) == verdict
    assert not list(tmp_path.glob("*.tmp")), "the record is written whole, then moved in place"


def test_a_value_that_is_not_finite_reads_back(tmp_path):
    record_verdict(
        tmp_path, Verdict(metrics=[EvalMetric(name="held_out_loss", value=math.nan)], passed=False)
    )
    back = recorded_verdict(tmp_path)
    assert back is not None and math.isnan(back.metrics[0].value)


def test_a_record_written_before_findings_reads_with_none(tmp_path):
    (tmp_path / GATE_RECORD).write_text(json.dumps({"metrics": [], "passed": False}))
    assert recorded_verdict(tmp_path) == Verdict(metrics=[], passed=False, findings=[])

"""A stage's gate once judged: its record (`<run>/<stage>/GATE.json`, written atomically; a
redelivered run reports it again instead of training the stage, and a failed gate stays failed) and
its report (the eval event, the one-line summary, each metric's sentence and the findings)."""

import json
import os
import pathlib
from typing import Any

import msgspec

from contracts.evals import EvalMetric
from contracts.runs import LogLevel
from training.engine.reporting import Reporter
from training.recipes.evals import describe

GATE_RECORD = "GATE.json"


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """A judged stage: its battery's metrics, whether its gate passed, and what it showed that
    does not gate (findings; a record written before findings existed has none)."""

    metrics: list[EvalMetric]
    passed: bool
    findings: list[str] = []


def write_record(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """A run's record (a gate's, data preparation's provenance), whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def recorded_verdict(directory: pathlib.Path) -> Verdict | None:
    """The verdict recorded in a stage's directory, None when the stage was not judged yet."""
    record = directory / GATE_RECORD
    if not record.exists():
        return None
    # json, not msgspec, reads it: a metric's value may be NaN, which json writes and reads back
    return msgspec.convert(json.loads(record.read_text()), Verdict)


def record_verdict(directory: pathlib.Path, verdict: Verdict) -> None:
    write_record(directory / GATE_RECORD, msgspec.to_builtins(verdict))


def report_gate(report: Reporter, stage: str, verdict: Verdict) -> str:
    """The eval event and its one-line summary (logged as an error when the gate failed), each
    metric's sentence, and the findings (as warnings); the summary line."""
    report.eval(stage, verdict.metrics, verdict.passed, verdict.findings)
    line = describe(stage, verdict.metrics)
    report.log(line, LogLevel.info if verdict.passed else LogLevel.error)
    for m in verdict.metrics:
        if m.sentence:
            report.log(f"{stage} gate: {m.sentence}", LogLevel.info if m.passed else LogLevel.error)
    for finding in verdict.findings:
        report.log(f"{stage}: {finding}", LogLevel.warning)
    return line

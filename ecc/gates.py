"""A stage's gate in words, as the terminal prints it (ecc/render.py, ecc/progress.py)."""

from contracts.evals import EvalMetric, StageGate


def bound(metric: EvalMetric) -> str:
    """A metric's gate: its threshold, or that it is reported and not gated."""
    if metric.threshold is None:
        return "reported, not gated"
    return f"gate {metric.op} {metric.threshold:.4f}"


def _said(metric: EvalMetric) -> str:
    """A metric as its gate said it ("held-out loss 2.1000 must be at most 4.0000 (...): passed"),
    or, from an older writer with no sentence, its numbers."""
    return metric.sentence or f"{metric.name} {metric.value:.4f} ({bound(metric)})"


def gate_line(gate: StageGate) -> str:
    """A stage's gate verdict in one line: `gate pretrain: passed: held-out loss 2.1000 must be at
    most 4.4715 (20 % below the untrained model's 5.5894): passed`, then its findings."""
    verdict = "passed" if gate.passed else "FAILED"
    numbers = ", ".join(_said(m) for m in gate.metrics)
    line = f"gate {gate.stage}: {verdict}: {numbers}"
    return line + "".join(f"\n    finding: {f}" for f in gate.findings)

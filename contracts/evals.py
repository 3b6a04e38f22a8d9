"""Eval and data-provenance records, shared by run events and the run view."""

from contracts.base import Internal


class EvalMetric(Internal, frozen=True, kw_only=True):
    name: str
    value: float
    threshold: float | None = None
    op: str = ">="  # how value is compared with threshold: ">=", ">", "<=" or "<"
    passed: bool = True
    # What the gate compared, in words: "held-out loss on the SFT eval split 7.3400 must be at
    # most 2.9799 (1 % below the pretrain model's 3.0100): failed"; "" from older writers.
    sentence: str = ""


class StageGate(Internal, frozen=True, kw_only=True):
    """A stage's eval battery as the run view shows it: every metric and the gate's verdict."""

    stage: str
    passed: bool
    metrics: list[EvalMetric]
    findings: list[str] = []  # what the battery noticed but does not gate (e.g. overfitting)


class ProvenanceStep(Internal, frozen=True, kw_only=True):
    name: str  # "exact_dedup", "near_dedup", "decontamination", ...
    before: int
    after: int
    detail: str | None = None


class Provenance(Internal, frozen=True, kw_only=True):
    steps: list[ProvenanceStep]
    input_digest: str
    output_digest: str

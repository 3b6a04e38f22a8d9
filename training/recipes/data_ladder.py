"""The ladder decision job: should the run's custom (`file:`) data be used at all?

Two short proxy runs of a small model (the "150M ladder" at full scale, `tiny` here) with the same
seed, steps and shape: one on the reference mix (the run's other training data, or the built-in
corpus when there is none), one on the reference mix plus the custom data. Both are scored on the
same held-out text: the run's eval suites, or else a held-out tail of the reference mix that
neither proxy trains on. The custom data is used if it does not raise held-out loss by more than
`max_loss_regression`. The decision is recorded on disk, so a resumed run does not re-decide.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from contracts.evals import EvalMetric
from contracts.runs import CheckpointSaved, Metrics, RunEvent
from domain.curriculum import WARMUP_FRACTION, LadderPlan
from training.data.corpora import load_text
from training.engine.loop import ShouldStop
from training.engine.reporting import Reporter
from training.recipes.pretrain import StageConfig, train_stage

FALLBACK_REFERENCE = "builtin:pydoc_topics"  # the reference mix when every training ref is custom
RECORD = "decision.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class LadderDecision:
    use: bool
    reference_loss: float
    custom_loss: float
    threshold: float
    steps: int

    def metrics(self) -> list[EvalMetric]:
        """The eval event's metrics: the custom mix is judged against reference + tolerance."""
        return [
            EvalMetric(name="held_out_loss_reference", value=self.reference_loss, op="<=", passed=True),
            EvalMetric(
                name="held_out_loss_with_custom",
                value=self.custom_loss,
                threshold=self.threshold,
                op="<=",
                passed=self.use,
            ),
            EvalMetric(name="eval_delta", value=self.reference_loss - self.custom_loss, op=">=", passed=True),
        ]


def decide(reference_loss: float, custom_loss: float, max_loss_regression: float) -> bool:
    """Use the custom data unless it makes held-out loss worse by more than the tolerance."""
    return custom_loss <= reference_loss + max_loss_regression


def _write_text(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return f"file:{path}"


def _proxy_report(report: Reporter, offset: int, total: int) -> Reporter:
    """Proxy metrics numbered as one ladder stage of 2 x steps; proxy checkpoints are scratch, not
    the run's, so they are not reported."""

    def forward(event: RunEvent) -> None:
        match event:
            case Metrics():
                report.send(
                    msgspec.structs.replace(
                        event, stage="ladder", step=event.step + offset, total_steps=total
                    )
                )
            case CheckpointSaved():
                pass
            case _:
                report.send(event)

    return report.with_sink(forward)


def run_ladder(
    plan: LadderPlan,
    *,
    sources: dict[str, str],
    eval_sources: list[str],
    seed: int,
    seq_len: int,
    batch_size: int,
    learning_rate: float,
    directory: str | os.PathLike,
    report: Reporter,
    should_stop: ShouldStop,
) -> LadderDecision | None:
    """The decision, or None if a stop request interrupted a proxy run (its checkpoint is kept)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / RECORD
    if (recorded := recorded_decision(directory)) is not None:
        return recorded
    reference, custom, held_out = _proxy_data(plan, sources, eval_sources, seed, directory)
    losses = []
    for i, (name, train_sources) in enumerate((("reference", reference), ("custom", reference + custom))):
        cfg = StageConfig(
            stage="ladder",
            shape=plan.proxy_shape,
            train_sources=train_sources,
            eval_sources=held_out,
            seq_len=min(seq_len, plan.proxy_shape.max_seq_len),
            batch_size=batch_size,
            learning_rate=learning_rate,
            steps=plan.proxy_steps,
            warmup_steps=max(1, round(WARMUP_FRACTION * plan.proxy_steps)),
            seed=seed,
            checkpoint_dir=str(directory / name),
            checkpoint_interval=plan.proxy_steps,  # one (scratch) checkpoint, at the end
            keep_last=1,
        )
        result = train_stage(
            cfg, _proxy_report(report, i * plan.proxy_steps, 2 * plan.proxy_steps), should_stop
        )
        if result.stopped or result.held_out_loss is None:
            return None
        losses.append(result.held_out_loss)
    decision = LadderDecision(
        use=decide(losses[0], losses[1], plan.max_loss_regression),
        reference_loss=losses[0],
        custom_loss=losses[1],
        threshold=losses[0] + plan.max_loss_regression,
        steps=plan.proxy_steps,
    )
    _record(record, decision)
    return decision


def recorded_decision(directory: Path) -> LadderDecision | None:
    """The decision recorded in `directory`, if any."""
    record = directory / RECORD
    return LadderDecision(**json.loads(record.read_text())) if record.exists() else None


def record_decision(directory: Path, decision: LadderDecision) -> None:
    """Record a decision taken elsewhere (node 0's, on a follower of a run on several nodes) as this
    run's own: a resumed run reads it instead of deciding again."""
    directory.mkdir(parents=True, exist_ok=True)
    _record(directory / RECORD, decision)


def _proxy_data(
    plan: LadderPlan, sources: dict[str, str], eval_sources: list[str], seed: int, directory: Path
) -> tuple[list[str], list[str], list[str]]:
    """(reference sources, custom sources, held-out sources) of the proxies; with no eval suite the
    reference's tail is held out from both."""
    reference = [sources[n] for n in plan.reference] or [FALLBACK_REFERENCE]
    custom = [sources[n] for n in plan.custom]
    held_out = list(eval_sources)
    if not held_out:
        text = "\n\n".join(load_text(s, seed=seed) for s in reference)
        cut = int(len(text) * 0.9)
        reference = [_write_text(directory / "reference-train.txt", text[:cut])]
        held_out = [_write_text(directory / "held-out.txt", text[cut:])]
    return reference, custom, held_out


def _record(record: Path, decision: LadderDecision) -> None:
    tmp = record.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {
                "use": decision.use,
                "reference_loss": decision.reference_loss,
                "custom_loss": decision.custom_loss,
                "threshold": decision.threshold,
                "steps": decision.steps,
            }
        )
    )
    os.replace(tmp, record)

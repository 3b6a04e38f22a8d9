"""Every stage's gate, as the backend defines it: a fixed battery judged on what the stage is for,
with default thresholds relative to the stage's incoming model and never below "no worse than
before", which a manifest may tighten with absolute bounds but never loosen or remove.

- pretrain from scratch (no incoming model to compare with): held-out loss must end at least
  PRETRAIN_MARGIN[size] below the untrained (freshly initialised) model's: a margin set by size,
  large enough that only a model that learnt something clears it; continued pretraining from a
  base model must improve on the base model's (LM_MIN_IMPROVEMENT);
- midtrain, long_context: held-out loss no worse than the incoming model's; long_context also keeps
  short-context loss within `max_short_loss_increase` (default and upper bound
  DEFAULT_MAX_SHORT_LOSS_INCREASE) of the incoming model's;
- sft: held-out loss on the SFT eval split (the SFT objective, the response tokens, on examples it
  never trained on) must fall at least SFT_MIN_IMPROVEMENT below the incoming model's; task
  accuracy must not drop;
- dpo: preference accuracy on held-out pairs above PREFERENCE_ACCURACY_FLOOR (chance) and the
  held-out reward margin positive; held-out loss may rise by at most DPO_MAX_REGRESSION
  (preference tuning trades a little likelihood for the preferred answers); task accuracy must not
  drop;
- rlvr: the verifier pass rate on held-out problems (task accuracy) must not drop.

Training loss far below held-out loss (OVERFIT_RATIO) is reported as a finding, not gated.

Pure: `rules` says what a stage is judged on (shown by `ecc ito plan`, as sentences), `threshold`
turns the rules and the incoming model's measured values into the numbers the gate compares with,
`sentence` says in words what was compared (shown by `ecc ito status` and the desk),
`refuse_loosening` is the plan-time check.
"""

from dataclasses import dataclass

from contracts.manifest import Gate, LongContextGate

# Pretrain from scratch: held-out loss at least this fraction below the untrained model's, by size.
# The untrained model's loss is ~ln(vocab); a model that learnt only token frequencies is already
# ~40 % below it on text, so 20 % is the least that says "it learnt" for the tiny byte model
# (the demo's 400 steps reach 70 %); bigger models train on far more tokens and must show more.
PRETRAIN_MARGIN = {"tiny": 0.20, "150M": 0.30, "1B": 0.35, "8B": 0.40, "70B": 0.40}
LM_MIN_IMPROVEMENT = 0.01  # continued pretraining from a base model: 1 % below the base model's
SFT_MIN_IMPROVEMENT = 0.01  # SFT: the eval split's response-token loss falls >= 1 %
DPO_MAX_REGRESSION = 0.10  # DPO: held-out loss at most 10 % above the incoming (SFT) model's
PREFERENCE_ACCURACY_FLOOR = 0.5  # DPO: held-out pairs ranked right more often than chance
DEFAULT_MAX_SHORT_LOSS_INCREASE = 0.25  # nats/token; the manifest may only lower it
OVERFIT_RATIO = 2.0  # held-out loss above this x the final training loss: reported as overfitting

STRICT = {">": ">=", "<": "<="}
LABELS = {
    "held_out_loss": "held-out loss",
    "task_accuracy": "task accuracy",
    "short_context_loss": "short-context loss",
    "needle_accuracy": "needle accuracy",
    "preference_accuracy": "preference accuracy on held-out pairs",
    "reward_margin": "reward margin on held-out pairs",
    "general_held_out_loss": "held-out loss on the eval text",
}
STAGE_LABELS = {
    ("sft", "held_out_loss"): "held-out loss on the SFT eval split",
    ("dpo", "held_out_loss"): "held-out loss on the SFT eval split",
    ("rlvr", "held_out_loss"): "held-out loss on the SFT eval split",
    ("rlvr", "task_accuracy"): "verifier pass rate on held-out problems",
}


def label(stage: str, metric: str) -> str:
    """A metric as a person reads it ("held-out loss on the SFT eval split")."""
    return STAGE_LABELS.get((stage, metric), LABELS.get(metric, metric.replace("_", " ")))


@dataclass(frozen=True, slots=True)
class Rule:
    """One gated metric: `op` compares the measured value with a bound derived from the incoming
    model's value of `metric` (ratio: incoming x amount; delta: incoming + amount; fixed: amount
    itself), tightened by the manifest's absolute bound when it has one."""

    metric: str  # "held_out_loss", "task_accuracy", "preference_accuracy", ...
    op: str  # "<=", "<", ">=" or ">"
    relative: str | None  # "ratio", "delta", "fixed" or None (the manifest's absolute bound only)
    amount: float
    absolute: float | None = None  # from the manifest: a tighter bound
    stage: str = ""  # the stage judged (for the words)

    def describe(self, incoming: str = "the incoming model") -> str:
        """The rule as a sentence: "held-out loss must fall at least 20 % below the untrained model's"."""
        what = label(self.stage, self.metric)
        lower = self.op in ("<=", "<")
        if self.relative == "ratio":
            pct = abs(1 - self.amount) * 100
            if pct < 1e-9:
                text = f"{what} must be no {'higher' if lower else 'lower'} than {incoming}'s"
            elif (self.amount < 1) == lower:
                text = f"{what} must {'fall' if lower else 'rise'} at least {pct:g} % {'below' if lower else 'above'} {incoming}'s"
            else:
                text = f"{what} may rise at most {pct:g} % above {incoming}'s"
        elif self.relative == "delta":
            if self.amount == 0:
                text = f"{what} must not {'rise above' if lower else 'drop below'} {incoming}'s"
            else:
                text = f"{what} may {'rise' if self.amount > 0 else 'drop'} at most {abs(self.amount):g} from {incoming}'s"
        elif self.relative == "fixed":
            text = f"{what} must {_verb(self.op)} {self.amount:g}"
        else:
            return f"{what} must {_verb(self.op)} {self.absolute:g} (the manifest's bound)"
        if self.absolute is not None:
            text += f", and {_verb(self.op)} {self.absolute:g} (the manifest's bound)"
        return text


def _verb(op: str) -> str:
    return {"<=": "be at most", "<": "fall below", ">=": "be at least", ">": "rise above"}[op]


LM_STAGES = ("pretrain", "midtrain", "long_context")


def rules(
    stage: str,
    gate: Gate | LongContextGate,
    *,
    has_tasks: bool,
    has_held_out: bool,
    chat_eval: bool = False,
    size: str | None = None,
) -> list[Rule]:
    """The battery `stage` is judged on (its defaults and the manifest's tightenings). `size`: the
    from-scratch model size (None: a base model the run continues from). `chat_eval`: kept for
    callers; every post-training stage is judged on its SFT eval split now."""
    del chat_eval
    out: list[Rule] = []
    if stage in LM_STAGES:
        if stage == "pretrain":
            margin = PRETRAIN_MARGIN.get(size, PRETRAIN_MARGIN["tiny"]) if size else LM_MIN_IMPROVEMENT
            out.append(Rule("held_out_loss", "<=", "ratio", 1 - margin, gate.max_held_out_loss, stage))
        else:
            out.append(Rule("held_out_loss", "<=", "ratio", 1.0, gate.max_held_out_loss, stage))
        if gate.min_task_accuracy is not None:
            out.append(Rule("task_accuracy", ">=", None, 0.0, gate.min_task_accuracy, stage))
        if isinstance(gate, LongContextGate):
            increase = gate.max_short_loss_increase
            out.append(
                Rule(
                    "short_context_loss",
                    "<=",
                    "delta",
                    DEFAULT_MAX_SHORT_LOSS_INCREASE if increase is None else increase,
                    stage=stage,
                )
            )
            if gate.min_needle_accuracy is not None:
                out.append(Rule("needle_accuracy", ">=", None, 0.0, gate.min_needle_accuracy, stage))
        return out
    if stage == "sft":
        out.append(
            Rule("held_out_loss", "<=", "ratio", 1 - SFT_MIN_IMPROVEMENT, gate.max_held_out_loss, stage)
        )
    elif stage == "dpo":
        out.append(Rule("preference_accuracy", ">", "fixed", PREFERENCE_ACCURACY_FLOOR, stage=stage))
        out.append(Rule("reward_margin", ">", "fixed", 0.0, stage=stage))
        out.append(
            Rule("held_out_loss", "<=", "ratio", 1 + DPO_MAX_REGRESSION, gate.max_held_out_loss, stage)
        )
    elif gate.max_held_out_loss is not None:
        out.append(Rule("held_out_loss", "<=", None, 0.0, gate.max_held_out_loss, stage))
    if has_tasks:
        out.append(Rule("task_accuracy", ">=", "delta", 0.0, gate.min_task_accuracy, stage))
    elif gate.min_task_accuracy is not None:
        out.append(Rule("task_accuracy", ">=", None, 0.0, gate.min_task_accuracy, stage))
    return out


def threshold(rule: Rule, incoming: float | None) -> float | None:
    """The number the measured value is compared with: the stricter of the relative default (when
    the incoming model's value is known) and the manifest's absolute bound."""
    bounds = []
    if rule.relative == "ratio" and incoming is not None:
        bounds.append(incoming * rule.amount)
    elif rule.relative == "delta" and incoming is not None:
        bounds.append(incoming + rule.amount)
    elif rule.relative == "fixed":
        bounds.append(rule.amount)
    if rule.absolute is not None:
        bounds.append(rule.absolute)
    if not bounds:
        return None
    return min(bounds) if rule.op in ("<=", "<") else max(bounds)


def passes(value: float, op: str, bound: float) -> bool:
    return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]


def sentence(
    rule: Rule | None,
    value: float,
    bound: float | None,
    incoming: float | None,
    *,
    incoming_label: str = "the incoming model",
    stage: str = "",
    metric: str = "",
) -> str:
    """What the gate compared, in words: "held-out loss 7.3400 must be at most 2.9799 (1 % below
    pretrain's 3.0100): failed"; a metric no rule covers is "reported, not gated"."""
    what = label(rule.stage if rule else stage, rule.metric if rule else metric)
    if rule is None or bound is None:
        return f"{what} {value:.4f}: reported, not gated"
    why = ""
    if rule.absolute is not None and bound == rule.absolute:
        why = "the manifest's bound"
    elif rule.relative in ("ratio", "delta") and incoming is not None:
        if rule.relative == "ratio" and abs(1 - rule.amount) > 1e-9:
            pct = abs(1 - rule.amount) * 100
            why = f"{pct:g} % {'below' if rule.amount < 1 else 'above'} {incoming_label}'s {incoming:.4f}"
        elif rule.relative == "delta" and rule.amount != 0:
            why = f"{incoming_label}'s {incoming:.4f} {rule.amount:+g}"
        else:
            why = f"{incoming_label}'s"
    elif rule.relative == "fixed" and rule.metric == "preference_accuracy":
        why = "chance"
    verdict = "passed" if passes(value, rule.op, bound) else "failed"
    return (
        f"{what} {value:.4f} must {_verb(rule.op)} {bound:.4f}"
        + (f" ({why})" if why else "")
        + f": {verdict}"
    )


def overfitting(train_loss: float | None, held_out_loss: float | None) -> str | None:
    """A finding when training loss is far below held-out loss (memorised, not learnt); None otherwise."""
    if train_loss is None or held_out_loss is None or train_loss <= 0:
        return None
    ratio = held_out_loss / train_loss
    if ratio < OVERFIT_RATIO:
        return None
    return (
        f"overfitting: training loss {train_loss:.4f} is far below held-out loss {held_out_loss:.4f} "
        f"(x{ratio:.1f}): the model memorised its training data more than it learnt from it; more "
        "(or more varied) training data, fewer steps or a held-out set closer to the training data "
        "would tell more"
    )


def refuse_loosening(stage: str, gate: Gate | LongContextGate) -> None:
    """A manifest may tighten a gate, never loosen or remove one: ValueError with what to change."""
    if isinstance(gate, LongContextGate):
        increase = gate.max_short_loss_increase
        if increase is None:
            raise ValueError(
                f"stages.{stage}.gate.max_short_loss_increase cannot be removed: the backend gates "
                f"short-context loss (at most +{DEFAULT_MAX_SHORT_LOSS_INCREASE:g})."
            )
        if increase > DEFAULT_MAX_SHORT_LOSS_INCREASE:
            raise ValueError(
                f"stages.{stage}.gate.max_short_loss_increase {increase:g} loosens the backend's gate "
                f"(at most {DEFAULT_MAX_SHORT_LOSS_INCREASE:g}); a manifest may only tighten it."
            )

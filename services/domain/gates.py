"""Every stage's gate, as the backend defines it: a fixed battery with default thresholds that are
relative to the stage's incoming model (absolute numbers make no sense across model sizes), which a
manifest may tighten with absolute bounds but never loosen or remove.

- pretrain: held-out loss must end at least PRETRAIN_MIN_IMPROVEMENT below the incoming (freshly
  initialised) model's;
- midtrain, long_context: held-out loss at most LM_MAX_REGRESSION above the incoming model's;
  long_context also keeps short-context loss within `max_short_loss_increase` (default and upper
  bound DEFAULT_MAX_SHORT_LOSS_INCREASE) of the incoming model's;
- sft, dpo, rlvr: task accuracy at most POST_MAX_ACCURACY_DROP below the incoming model's (held-out
  loss is measured and reported: narrow post-training moves general loss by design, measured here
  at x1.8 after SFT on arithmetic at the tiny size; a manifest may still bound it absolutely);
- sft and dpo on the field's chat data judged on a chat eval split (held-out loss on the eval
  split's assistant tokens, the SFT objective on data it never trained on): SFT must lower it
  below the incoming model's (SFT_MIN_IMPROVEMENT), DPO may not raise it by more than
  DPO_MAX_REGRESSION (preference tuning trades a little likelihood for the preferred answers).

Pure: `rules` says what a stage is judged on (shown by `ecc ito plan`), `thresholds` turns the rules
and the incoming model's measured values into the numbers the gate compares with (shown by
`ecc ito status`), `refuse_loosening` is the plan-time check.
"""

from dataclasses import dataclass

from contracts.manifest import Gate, LongContextGate

PRETRAIN_MIN_IMPROVEMENT = 0.01  # 1 % below the initial loss: any model that learned at all clears it
# (48 tiny steps on arithmetic measured 2.8 %; the demo's 400 steps 70 %)
LM_MAX_REGRESSION = 0.10  # midtrain / long-context may cost a little general loss, not more (tiny: +6 % seen)
POST_MAX_ACCURACY_DROP = 0.05  # post-training must not unlearn the verifiable tasks (5 points)
DEFAULT_MAX_SHORT_LOSS_INCREASE = 0.25  # nats/byte; the manifest may only lower it
SFT_MIN_IMPROVEMENT = 0.01  # SFT on chat data: the eval split's assistant-token loss falls >= 1 %
DPO_MAX_REGRESSION = 0.10  # DPO on chat data: at most 10 % above the incoming (SFT) model's


@dataclass(frozen=True, slots=True)
class Rule:
    """One gated metric: `op` compares the measured value with a bound derived from the incoming
    model's value of `metric` (ratio: incoming x factor; delta: incoming + offset), tightened by the
    manifest's absolute bound when it has one."""

    metric: str  # "held_out_loss", "task_accuracy", "short_context_loss", "needle_accuracy"
    op: str  # "<=" or ">="
    relative: str | None  # "ratio", "delta" or None (absolute only)
    amount: float
    absolute: float | None = None  # from the manifest: a tighter bound

    def describe(self) -> str:
        if self.relative == "ratio":
            base = f"{self.metric} {self.op} {self.amount:g} x the incoming model's"
        elif self.relative == "delta":
            base = f"{self.metric} {self.op} the incoming model's {self.amount:+g}"
        else:
            base = f"{self.metric} {self.op} {self.absolute:g}"
            return base + " (manifest)"
        return base + (f" and {self.op} {self.absolute:g} (manifest)" if self.absolute is not None else "")


LM_STAGES = ("pretrain", "midtrain", "long_context")


def rules(
    stage: str,
    gate: Gate | LongContextGate,
    *,
    has_tasks: bool,
    has_held_out: bool,
    chat_eval: bool = False,
) -> list[Rule]:
    """The battery `stage` is judged on (its defaults and the manifest's tightenings). `chat_eval`:
    the held-out data is a chat eval split, which SFT and DPO on chat data are judged on."""
    out: list[Rule] = []
    if stage in LM_STAGES:
        factor = 1 - PRETRAIN_MIN_IMPROVEMENT if stage == "pretrain" else 1 + LM_MAX_REGRESSION
        out.append(Rule("held_out_loss", "<=", "ratio", factor, gate.max_held_out_loss))
        if gate.min_task_accuracy is not None:
            out.append(Rule("task_accuracy", ">=", None, 0.0, gate.min_task_accuracy))
        if isinstance(gate, LongContextGate):
            increase = gate.max_short_loss_increase
            out.append(
                Rule(
                    "short_context_loss",
                    "<=",
                    "delta",
                    DEFAULT_MAX_SHORT_LOSS_INCREASE if increase is None else increase,
                )
            )
            if gate.min_needle_accuracy is not None:
                out.append(Rule("needle_accuracy", ">=", None, 0.0, gate.min_needle_accuracy))
        return out
    if chat_eval and stage in ("sft", "dpo"):
        factor = 1 - SFT_MIN_IMPROVEMENT if stage == "sft" else 1 + DPO_MAX_REGRESSION
        out.append(Rule("held_out_loss", "<=", "ratio", factor, gate.max_held_out_loss))
    elif gate.max_held_out_loss is not None:
        out.append(Rule("held_out_loss", "<=", None, 0.0, gate.max_held_out_loss))
    if has_tasks:
        out.append(Rule("task_accuracy", ">=", "delta", -POST_MAX_ACCURACY_DROP, gate.min_task_accuracy))
    elif gate.min_task_accuracy is not None:
        out.append(Rule("task_accuracy", ">=", None, 0.0, gate.min_task_accuracy))
    return out


def threshold(rule: Rule, incoming: float | None) -> float | None:
    """The number the measured value is compared with: the stricter of the relative default (when
    the incoming model's value is known) and the manifest's absolute bound."""
    bounds = []
    if rule.relative == "ratio" and incoming is not None:
        bounds.append(incoming * rule.amount)
    elif rule.relative == "delta" and incoming is not None:
        bounds.append(incoming + rule.amount)
    if rule.absolute is not None:
        bounds.append(rule.absolute)
    if not bounds:
        return None
    return min(bounds) if rule.op == "<=" else max(bounds)


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

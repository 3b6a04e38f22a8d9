"""A stage's eval battery: what is measured on the model a stage starts from (the incoming model)
and again on the one it trained, with the same held-out windows, examples and problems, and those
measurements as checks against the stage's gate (its thresholds relative to the incoming values).

Next-token stages: held-out loss, task accuracy, and for long-context the short-context loss and
needle retrieval. Post-training stages: held-out loss on the SFT eval split, loss on the eval text,
task accuracy, and for DPO the preference accuracy and reward margin of held-out pairs."""

import torch

from contracts.manifest import DpoStage, LongContextGate
from contracts.models import ModelShape
from domain.curriculum import Curriculum, LmPlan, PostPlan
from domain.gates import sentence, threshold
from training.data.corpora import load_eval_tokens
from training.engine.checkpoint_load import load_weights
from training.engine.loop import pick_device
from training.model import Transformer
from training.recipes.evals import Check, needle_accuracy, needle_trials, preference, task_accuracy
from training.recipes.held_out import PostSplits
from training.recipes.posttrain import pair_logprobs, response_loss
from training.recipes.pretrain import StageConfig, build_model, held_out_loss, lm_loss, load_stage_data
from training.recipes.run_data import RunData

EVAL_MAX_BATCHES = 8  # held-out loss of post-training stages: the same windows as the LM stages
NEEDLE_ANSWER_ROOM = 6  # five key digits and a spare byte after the needle prompt
Measured = dict[str, float | None]


def battery_suites(plan: Curriculum, seed: int) -> dict[str, list[str]]:
    """Eval text the batteries generate themselves (the needle trials), decontaminated against too."""
    suites = {}
    for stage in plan.stages:
        if (
            isinstance(stage, LmPlan)
            and stage.name == "long_context"
            and isinstance(stage.gate, LongContextGate)
        ):
            trials = needle_trials(stage.gate.needle_trials, stage.seq_len - NEEDLE_ANSWER_ROOM, seed)
            suites["needle-eval"] = [prompt + key for prompt, key in trials]
    return suites


class Battery:
    """The eval batteries of one run's stages, on its data and its post-training splits."""

    def __init__(self, data: RunData, splits: PostSplits) -> None:
        self.data, self.splits = data, splits
        self.seed = data.manifest.seed

    def incoming_model(
        self, shape: ModelShape, seq_len: int, rope_base: float | None, previous: str | None
    ) -> Transformer | None:
        """The model a stage starts from: the previous stage's weights, or a fresh initialisation
        (seeded like the run) for the first stage; None when the previous weights cannot load."""
        if previous is None:
            torch.manual_seed(self.seed)
        model = build_model(shape, seq_len=seq_len, rope_base=rope_base, device=pick_device())
        if previous is not None and load_weights(previous, model) is None:
            return None
        return model

    def lm_incoming(
        self, stage: LmPlan, cfg: StageConfig, held: torch.Tensor, previous: str | None
    ) -> Measured:
        """The battery's values on the model a next-token stage starts from: the gate's defaults are
        relative to them."""
        device = pick_device(cfg.device)
        incoming: Measured = {}
        before = self.incoming_model(stage.shape, stage.seq_len, stage.rope_base, previous)
        if before is not None:
            incoming["held_out_loss"] = held_out_loss(before, held, cfg, device)
        if stage.short_seq_len is not None and previous is not None:
            incoming["short_context_loss"] = _short_loss_before(
                cfg, stage.shape, stage.short_seq_len, previous
            )
        return incoming

    def lm_measures(
        self, stage: LmPlan, cfg: StageConfig, held: torch.Tensor, model: Transformer, loss: float | None
    ) -> Measured:
        """The battery on a trained next-token stage: its held-out `loss` (as the trainer measured
        it), task accuracy, and a long-context stage's short-context loss and needle retrieval."""
        problems = self.data.problems(stage.gate.task_samples)
        measured = {
            "held_out_loss": loss,
            "task_accuracy": task_accuracy(model, problems, self.data.tokenizer),
        }
        if stage.short_seq_len is None or not isinstance(stage.gate, LongContextGate):
            return measured
        trials = needle_trials(stage.gate.needle_trials, stage.seq_len - NEEDLE_ANSWER_ROOM, self.seed)
        short = held_out_loss(model, held, cfg, pick_device(cfg.device), seq_len=stage.short_seq_len)
        return measured | {"short_context_loss": short, "needle_accuracy": needle_accuracy(model, trials)}

    def post_measures(
        self, model: Transformer | None, stage: PostPlan
    ) -> tuple[Measured, torch.Tensor | None]:
        """Held-out loss on the SFT eval split, loss on the eval text, task accuracy, and (DPO) the
        held-out pairs' summed log-probabilities: measured on the incoming model and again on the
        trained one, with the same examples, windows and problems."""
        if model is None:
            return {}, None
        held_out = self.splits.held_out(stage)
        general = self._general_loss(model) if self.data.eval_sources else None
        pad = self.data.tokenizer.pad_id
        measured: Measured = {
            # the SFT objective (the response tokens) on examples the stage never trained on
            "held_out_loss": response_loss(model, held_out.examples, pad) if held_out.examples else None,
            "task_accuracy": task_accuracy(
                model, self.data.problems(stage.gate.task_samples), self.data.tokenizer
            ),
        }
        if general is not None:
            measured["general_held_out_loss"] = general  # next-token loss on the eval text: reported
        sums = pair_logprobs(model, held_out.pairs, pad) if held_out.pairs else None
        return measured, sums

    def post_trained(
        self, model: Transformer | None, stage: PostPlan, reference: torch.Tensor | None
    ) -> Measured:
        """The battery on a trained post-training stage; for DPO, its preference accuracy and reward
        margin on the held-out pairs against the incoming model's log-probabilities (`reference`)."""
        measured, policy = self.post_measures(model, stage)
        if isinstance(stage.section, DpoStage) and policy is not None and reference is not None:
            accuracy, margin = preference(policy, reference, stage.section.beta)
            measured = {"preference_accuracy": accuracy, "reward_margin": margin} | measured
        return measured

    def _general_loss(self, model: Transformer) -> float | None:
        target = self.data.manifest.target
        tokens = load_eval_tokens(self.data.eval_sources, seed=self.seed)
        return lm_loss(
            model,
            tokens,
            seq_len=target.seq_len,
            batch_size=target.batch_size,
            max_batches=EVAL_MAX_BATCHES,
            device=pick_device(),
        )


def _short_loss_before(
    cfg: StageConfig, shape: ModelShape, short_seq_len: int, previous: str
) -> float | None:
    """Short-context held-out loss of the incoming model (previous stage's weights, RoPE base)."""
    device = pick_device(cfg.device)
    incoming = build_model(shape, seq_len=short_seq_len, rope_base=None, device=device)
    if load_weights(previous, incoming) is None:
        return None
    _, held = load_stage_data(cfg)
    return held_out_loss(incoming, held, cfg, device, seq_len=short_seq_len)


def checks(plan: Curriculum, stage: LmPlan | PostPlan, measured: Measured, incoming: Measured) -> list[Check]:
    """The battery's measurements against the stage's gate: every rule of the gate is judged
    (its threshold relative to the incoming model, tightened by the manifest); what the gate
    does not cover is reported with no threshold."""
    rules = {r.metric: r for r in plan.rules(stage)}
    before = plan.incoming_label(stage)
    out = []
    for name, value in measured.items():
        rule = rules.get(name)
        bound = threshold(rule, incoming.get(name)) if rule is not None else None
        words = (
            ""
            if value is None
            else sentence(
                rule, value, bound, incoming.get(name), incoming_label=before, stage=stage.name, metric=name
            )
        )
        if rule is None:
            out.append(Check(name=name, value=value, sentence=words))
        else:
            out.append(Check(name=name, value=value, threshold=bound, op=rule.op, sentence=words))
    return out

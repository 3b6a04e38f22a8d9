"""The cost estimate's wall time: start-up, data prep, every stage's steps, evals and checkpoints,
from figures this backend measured per GPU model, or documented defaults: pure functions.

A run pays for the GPUs it holds from the trainer's start until release (domain/
budget.py), so the estimate is wall seconds x held GPUs x price, not FLOPs at an assumed MFU alone:
a small run is mostly fixed overheads. The figures per GPU model (`Figures`):
- `startup_s`: the trainer's start to the first step (process, model build, data loading);
- `data_prep_s`: a data_prep stage (dedup, filtering, decontamination) when the manifest has one;
- `stage_s`: each further stage's start, and every stage's gate eval;
- `token_s`: each trained token's time per GPU beyond its FLOPs at the GPU's assumed MFU (kernel
  launches, optimizer, data, logging: what the FLOPs-only estimate missed; on this CPU backend,
  the tiny model's whole step), so a step takes its tokens x `token_s` / GPUs + its FLOPs /
  (GPUs x peak x MFU);
- `checkpoint_s`: one checkpoint save's share of wall time.
`desk_calibration.json` holds the figures measured on this backend (bench/cost.py: real runs,
their metered spend and their events); a GPU model with no entry uses `default`. A backend that
trains on GPUs (`trainer: "cuda"`) prices each desk GPU model without a measured entry from its
stated one: FLOPs at its assumed MFU, token_s 0, start-up and stage seconds assumed. The plan says
which it used (`CostEstimate.basis`).
"""

import json
import pathlib
from dataclasses import dataclass, replace

from contracts.manifest import Manifest, RlvrStage
from contracts.models import ModelShape
from domain.curriculum import Curriculum, LmPlan, PostPlan
from domain.model_shapes import count_parameters

CALIBRATION_PATH = pathlib.Path(__file__).with_name("desk_calibration.json")
# FLOPs per token per parameter of one optimizer step, by stage kind (forward 2, backward 4; DPO runs
# the policy on two responses and the reference forward; GRPO samples, scores and trains).
STEP_FLOPS_PER_TOKEN = {"sft": 6.0, "dpo": 2 * 6.0 + 2 * 2.0, "rlvr": 8 * 2.0 + 6.0 + 2.0}
LM_FLOPS_PER_TOKEN = 6.0


@dataclass(frozen=True, slots=True)
class Figures:
    startup_s: float
    data_prep_s: float
    stage_s: float
    token_s: float
    checkpoint_s: float
    basis: str = "defaults"  # what the figures come from, as the plan prints it


@dataclass(frozen=True, slots=True)
class Phases:
    startup_s: float
    data_prep_s: float
    train_s: float
    eval_s: float
    checkpoint_s: float

    @property
    def wall_s(self) -> float:
        return self.startup_s + self.data_prep_s + self.train_s + self.eval_s + self.checkpoint_s

    def as_dict(self) -> dict[str, float]:
        return {
            "startup": round(self.startup_s, 3),
            "data_prep": round(self.data_prep_s, 3),
            "train": round(self.train_s, 3),
            "eval": round(self.eval_s, 3),
            "checkpoint": round(self.checkpoint_s, 3),
        }


def load(
    path: pathlib.Path = CALIBRATION_PATH, *, mfu: dict[str, float] | None = None, trainer: str | None = None
) -> dict[str, Figures]:
    """The figures per GPU model last measured on this backend (and a `default` entry); where the
    backend trains on GPUs (`trainer` "cuda", the file's unless given), each desk GPU model without
    a measured entry gets its stated one: its FLOPs at the assumed MFU (`mfu`, the desk's) and no
    per-token time beyond them, start-up and stage seconds assumed (the basis says so)."""
    raw = json.loads(path.read_text())
    measured = raw.get("measured", "")
    table = {
        name: Figures(**v, basis=f"{name} figures of this backend, measured {measured}")
        for name, v in raw["gpus"].items()
    }
    if (trainer or raw.get("trainer", "cpu")) != "cuda":
        return table  # the CPU stand-in: its booked GPU models are names for CPU cores
    for name, v in raw.get("stated", {}).items():
        rate = f"{mfu[name]:.0%} MFU" if mfu and name in mfu else "the assumed MFU"
        basis = (
            f"{name}: FLOPs at {rate}, stated, not measured (start-up {v['startup_s']:g}s, "
            f"{v['stage_s']:g}s a stage, {v['checkpoint_s']:g}s a checkpoint assumed)"
        )
        table.setdefault(name, Figures(**v, basis=basis))
    return table


def write_measured(path: pathlib.Path, gpu_model: str, figures: dict[str, float], measured: str) -> None:
    """Record a GPU model's measured figures (bench/cost.py on that GPU): they replace its stated
    ones, since measured entries come first (`load`)."""
    raw = json.loads(path.read_text())
    raw["gpus"][gpu_model] = {
        k: figures[k] for k in ("startup_s", "data_prep_s", "stage_s", "token_s", "checkpoint_s")
    }
    raw["measured"] = measured
    path.write_text(json.dumps(raw, indent=2) + "\n")


def figures_for(table: dict[str, Figures], gpu_model: str) -> Figures:
    """The GPU model's own figures, or the `default` ones (the basis says so)."""
    own = table.get(gpu_model)
    if own is not None:
        return own
    fallback = table["default"]
    return replace(fallback, basis=f"no figures for {gpu_model}: {fallback.basis}")


def stage_steps(stage: LmPlan | PostPlan, post_seq_len: int) -> tuple[int, float]:
    """(optimizer steps, FLOPs per parameter of one step) of one stage. A post-training step's
    sequences are the task's: the run's `seq_len` for SFT and DPO pairs, a prompt and its response
    (twice `max_response_tokens`) for RLVR's groups."""
    if isinstance(stage, LmPlan):
        return stage.steps, LM_FLOPS_PER_TOKEN * stage.seq_len * stage.batch_size
    section = stage.section
    if isinstance(section, RlvrStage):  # a step's sequences: every group's samples
        sequences, seq = section.prompts_per_step * section.group_size, 2 * section.max_response_tokens
    else:
        sequences, seq = section.batch_size, post_seq_len
    return section.steps, STEP_FLOPS_PER_TOKEN.get(stage.name, 6.0) * seq * sequences


def saves(run: Curriculum, manifest: Manifest) -> int:
    """Checkpoint saves: every `interval_steps` of each stage, and each stage's last step."""
    interval = max(manifest.checkpoint.interval_steps, 1)
    return sum(stage_steps(s, manifest.target.seq_len)[0] // interval + 1 for s in run.stages)


def phases(
    run: Curriculum, manifest: Manifest, shape: ModelShape, gpus: int, gpu_flops_s: float, f: Figures
) -> Phases:
    """The run's wall seconds by phase, on `gpus` GPUs that reach `gpu_flops_s` (peak x assumed
    MFU) each, with figures `f`."""
    params = count_parameters(shape)
    gpus = max(gpus, 1)
    train_s = 0.0
    for stage in run.stages:
        steps, flops_per_param = stage_steps(stage, manifest.target.seq_len)
        tokens = flops_per_param / LM_FLOPS_PER_TOKEN  # forward-backward token equivalents
        train_s += steps * (tokens * f.token_s + flops_per_param * params / max(gpu_flops_s, 1.0)) / gpus
    return Phases(
        startup_s=f.startup_s,
        data_prep_s=f.data_prep_s if run.data_prep is not None else 0.0,
        train_s=train_s,
        eval_s=f.stage_s * len(run.stages),
        checkpoint_s=f.checkpoint_s * saves(run, manifest),
    )

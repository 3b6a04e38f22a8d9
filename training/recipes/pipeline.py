"""The staged pipeline a run executes: data preparation, the ladder check, pretrain -> midtrain ->
long-context, then SFT / DPO / RLVR as the recipe lists them, each training stage followed by its
eval battery and gate.

Contract with the worker (called from a thread): `run_pipeline(...) -> PipelineResult` whose
`outcome` (an `Outcome`) is succeeded, gate_failed (a gate's numbers are in `summary`; nothing
overrides it) or stopped (should_stop became true; the in-flight checkpoint was committed first). Invalid
manifests raise ValueError before anything trains; other failures raise.

Layout under checkpoint_dir: one directory per stage (`pretrain/`, `sft/`, ...) holding its
checkpoints and, once judged, `GATE.json`; `data_prep/` holds the prepared corpus and provenance;
`ladder/` the proxy runs and the decision. A redelivered run skips every stage with a verdict
(re-reporting it; a failed gate stays failed) and resumes the first one without.

Where the stages train is injected (`Trainers`): in this process by default, or on a gang of ranks
(training/launch/elastic.py), or as this node's replica group of a run on several nodes
(training/launch/multinode.py). Data preparation, the ladder's proxy runs and the eval batteries run
here, once, whatever trains the stages; on several nodes each node prepares its own data and
evaluates its own stages, and node 0 alone runs the ladder's proxies (the others take its decision).

This module is the order of things; each concern has its own: the run's data and token files
(run_data.py), data preparation (data_preparation.py), post-training's held-out splits
(held_out.py), the eval batteries (batteries.py), a gate's record and report (gate_reports.py).
"""

import dataclasses
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from contracts.manifest import DataFormat, DpoStage, Manifest, RlvrStage, SftStage
from contracts.models import BaseModel
from contracts.runs import LogLevel, Outcome
from domain.curriculum import Curriculum, LadderPlan, LmPlan, PostPlan, curriculum_of
from domain.data_refs import is_tenant
from domain.gates import overfitting
from training.engine.checkpoint import write_merged_checkpoint
from training.engine.checkpoint_load import is_hf_model_dir
from training.engine.reporting import Reporter
from training.engine.speed import Speed, fitted
from training.recipes.batteries import Battery, checks
from training.recipes.data_ladder import LadderDecision, run_ladder
from training.recipes.data_preparation import prepare_data
from training.recipes.evals import Check, judge
from training.recipes.gate_reports import Verdict, record_verdict, recorded_verdict, report_gate
from training.recipes.held_out import PostSplits
from training.recipes.posttrain import PostConfig, PostResult
from training.recipes.pretrain import StageConfig, StageResult, lm_stage_config, load_stage_data, train_stage
from training.recipes.rlvr import RlvrConfig, RlvrResult, train_post
from training.recipes.run_data import RunData
from training.weights import lora

MERGED = lora.MERGED_DIR  # a LoRA stage's adapters merged into its base: the next stage's start
TrainLm = Callable[[StageConfig, Reporter, Callable[[], bool]], StageResult]
"""How a next-token stage trains: `train_stage` in this process, or a gang's (training/launch/elastic.py)."""
TrainPost = Callable[[PostConfig, Reporter, Callable[[], bool]], PostResult | RlvrResult]
"""How a post-training stage trains (`cfg` an RlvrConfig for rlvr): `rlvr.train_post` in this
process, or a gang's."""
DecideLadder = Callable[..., LadderDecision | None]
"""How the ladder decides (`ladder.run_ladder`'s arguments): its proxy runs in this process, or, on a
run of several nodes, node 0's decision read by the others (`multinode.NodeShare.ladder`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Trainers:
    """What trains the run's stages: next-token ones (`lm`) and post-training ones (`post`); and
    what decides the ladder (`ladder`)."""

    lm: TrainLm = train_stage
    post: TrainPost = train_post
    ladder: DecideLadder = run_ladder


IN_PROCESS = Trainers()  # one rank: every stage in the calling process


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineResult:
    last_stage: str
    summary: str
    final_loss: float | None
    held_out_loss: float | None
    outcome: Outcome  # required: a result never leaves its outcome to a default


def _steps_of(stage: LmPlan | PostPlan) -> int:
    return stage.steps if isinstance(stage, LmPlan) else stage.section.steps


class _Run:
    """One execution of a plan; holds what stages hand on (the run's data, the last stage's dir)."""

    def __init__(
        self,
        manifest: Manifest,
        plan: Curriculum,
        root: pathlib.Path,
        report: Reporter,
        should_stop: Callable[[], bool],
        threads: int,
        train_lm: TrainLm = train_stage,
        train_post: TrainPost = train_post,
        decide_ladder: DecideLadder = run_ladder,
        *,
        base_dir: pathlib.Path | None = None,
        store_root: pathlib.Path | None = None,
        speed: Speed | None = None,
        data_parallel: int = 1,
    ):
        self.manifest, self.plan, self.root = manifest, plan, root
        self.speed, self.data_parallel = speed or Speed(), data_parallel
        self.report, self.should_stop, self.threads = report, should_stop, threads
        self.train_lm, self.train_post, self.decide_ladder = train_lm, train_post, decide_ladder
        self.data = RunData(manifest, plan, root, base_dir=base_dir, store_root=store_root)
        self.splits = PostSplits(self.data)
        self.battery = Battery(self.data, self.splits)
        # The last trained stage's checkpoint dir; before the first, the base model's HF directory
        # (checkpoint_load.load_weights reads either), or None for a from-scratch run.
        self.previous: str | None = str(base_dir) if base_dir is not None else None
        self.parts: list[str] = []
        self.note = ""  # what the stage that just trained did, for the summary
        self.final_loss: float | None = None
        self.held_out: float | None = None
        self.findings: list[str] = []  # what the stage just judged showed but does not gate

    def log(self, message: str, level: LogLevel = LogLevel.info) -> None:
        self.report.log(message, level)

    def result(self, stage: str, outcome: Outcome, summary: str | None = None) -> PipelineResult:
        text = summary or "; ".join(self.parts) or "nothing to do"
        if outcome is Outcome.stopped:
            text = f"stopped during {stage} (checkpoint committed); " + text
        return PipelineResult(
            last_stage=stage,
            summary=text,
            final_loss=self.final_loss,
            held_out_loss=self.held_out,
            outcome=outcome,
        )

    # --- ladder ----------------------------------------------------------------------------------

    def ladder(self, lad: LadderPlan) -> bool:
        """False if stopped."""
        target = self.manifest.target
        decision = self.decide_ladder(
            lad,
            sources=self.data.sources,
            eval_sources=self.data.eval_sources,
            seed=self.manifest.seed,
            seq_len=target.seq_len,
            batch_size=target.batch_size,
            learning_rate=target.learning_rate,
            directory=self.root / "ladder",
            report=self.report,
            should_stop=self.should_stop,
        )
        if decision is None:
            return False
        verdict = "use" if decision.use else "do not use"
        self.report.eval("ladder", decision.metrics(), decision.use)
        self.log(
            f"ladder: custom data {list(lad.custom)}: held-out loss {decision.reference_loss:.4f} on the reference mix, "
            f"{decision.custom_loss:.4f} with the custom data (delta {decision.reference_loss - decision.custom_loss:+.4f}, "
            f"{decision.steps} proxy steps each); decision: {verdict}"
        )
        self.parts.append(
            f"ladder: {verdict} custom data ({decision.reference_loss:.3f} -> {decision.custom_loss:.3f})"
        )
        if not decision.use:
            self._drop(set(lad.custom))
        return True

    def _drop(self, names: set[str]) -> None:
        stages = []
        for stage in self.plan.stages:
            data = tuple(n for n in stage.data if n not in names)
            if not data:
                raise ValueError(
                    f"The ladder rejected {sorted(names)}, which was all of {stage.name}'s data."
                )
            stages.append(dataclasses.replace(stage, data=data))
        self.plan = dataclasses.replace(self.plan, stages=tuple(stages))

    # --- training stages -------------------------------------------------------------------------

    def lm_stage(self, stage: LmPlan, directory: pathlib.Path) -> tuple[list[Check], bool]:
        """Train a next-token stage; (its battery, stopped)."""
        data = self.data
        train_sources, eval_sources = [data.sources[n] for n in stage.data], data.eval_sources
        if data.tokenized(stage.data):  # a real tokenizer, or JSONL/Parquet text: token files
            train_sources = [data.token_files(stage.name, stage.data)]
            eval_sources = [data.eval_token_files()] if data.eval_sources else []
        cfg = lm_stage_config(
            stage,
            self.manifest,
            directory,
            train_sources=train_sources,
            eval_sources=eval_sources,
            init_from=self.previous,
        )
        cfg = dataclasses.replace(cfg, speed=self.speed_for(cfg.batch_size))
        _, held = load_stage_data(cfg)
        incoming = self.battery.lm_incoming(stage, cfg, held, self.previous)
        result = self.train_lm(cfg, self.report, self.should_stop)
        if result.stopped:
            return [], True
        assert result.model is not None, "a stage that was not stopped returns its model"
        self._noted(stage.name, result.final_step, result.first_loss, result.final_loss)
        self.final_loss = result.final_loss if result.final_loss is not None else self.final_loss
        measured = self.battery.lm_measures(stage, cfg, held, result.model, result.held_out_loss)
        self.findings = [f for f in [overfitting(result.final_loss, result.held_out_loss)] if f]
        return checks(self.plan, stage, measured, incoming), False

    def speed_for(self, global_batch: int) -> Speed:
        """The run's speed for a stage of `global_batch` sequences (DPO: pairs): its micro-batch
        fitted to the stage's per-rank batch."""
        return fitted(self.speed, max(1, global_batch // self.data_parallel))

    def post_stage(self, stage: PostPlan, directory: pathlib.Path) -> tuple[list[Check], bool]:
        """Train a post-training stage; (its battery, stopped)."""
        before = self.battery.incoming_model(
            stage.shape, self.manifest.target.seq_len, stage.rope_base, self.previous
        )
        incoming, reference = self.battery.post_measures(before, stage)
        result = self._train_post(stage, directory)
        if result.stopped:
            return [], True
        self._noted(stage.name, result.final_step, result.first_loss, result.final_loss)
        self.final_loss = result.final_loss if result.final_loss is not None else self.final_loss
        if stage.section.lora is not None and result.model is not None:
            # The stage committed its adapters alone; what follows starts from the merged model.
            write_merged_checkpoint(result.model, stage.section.lora, directory / MERGED, result.final_step)
        measured = self.battery.post_trained(result.model, stage, reference)
        self.findings = []
        if isinstance(stage.section, SftStage):
            self.findings = [f for f in [overfitting(result.final_loss, measured.get("held_out_loss"))] if f]
        return checks(self.plan, stage, measured, incoming), False

    def _train_post(self, stage: PostPlan, directory: pathlib.Path) -> PostResult | RlvrResult:
        """Train SFT, DPO or RLVR, as the stage's manifest section says (without the rows held out
        for its gate, when they come from its own training data)."""
        problems, examples, pairs = self.splits.trained_on(stage)
        section = stage.section
        common = PostConfig(
            stage=stage.name,
            shape=stage.shape,
            rope_base=stage.rope_base,
            problems=problems,
            steps=section.steps,
            batch_size=1,  # each section's own, below
            learning_rate=section.learning_rate,
            seed=self.manifest.seed,
            checkpoint_dir=str(directory),
            checkpoint_interval=self.manifest.checkpoint.interval_steps,
            keep_last=self.manifest.checkpoint.keep_last,
            init_from=self.previous,
            examples=examples,
            pairs=pairs,
            pad_id=self.data.tokenizer.pad_id,
            lora=section.lora,
        )
        match section:
            case SftStage():
                speed = self.speed_for(section.batch_size)
                cfg = dataclasses.replace(common, batch_size=section.batch_size, speed=speed)
                return self.train_post(cfg, self.report, self.should_stop)
            case DpoStage():
                speed = self.speed_for(section.batch_size)
                cfg = dataclasses.replace(
                    common, batch_size=section.batch_size, beta=section.beta, speed=speed
                )
                return self.train_post(cfg, self.report, self.should_stop)
            case RlvrStage():
                return self._train_rlvr(common, section)
        raise ValueError(f"Unknown post-training stage {stage.name!r}.")

    def _train_rlvr(self, common: PostConfig, section: RlvrStage) -> RlvrResult:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(PostConfig)}
        # RLVR's step runs its batch whole: compile and activation checkpointing only.
        fields["speed"] = dataclasses.replace(self.speed, micro_batch=None)
        fields["batch_size"] = section.prompts_per_step * section.group_size
        cfg = RlvrConfig(**fields, rlvr=section, threads=max(1, self.threads // 2))
        result = self.train_post(cfg, self.report, self.should_stop)
        assert isinstance(result, RlvrResult), "an rlvr stage returns an RlvrResult"
        if result.stats:
            first, last = result.stats[0], result.stats[-1]
            self.log(
                f"rlvr reward {first.reward:.3f} -> {last.reward:.3f}, accuracy {first.accuracy:.3f} -> "
                f"{last.accuracy:.3f}; stale rollouts dropped {result.stale_dropped}"
            )
        return result

    def _noted(self, name: str, step: int, first: float | None, final: float | None) -> None:
        if first is None or final is None:  # a redelivered run that had already trained this stage
            self.note = f"{name} finished at step {step} (resumed from its final checkpoint)"
        else:
            self.note = f"{name} finished at step {step}: loss {first:.3f} -> {final:.3f}"

    # --- the whole run ---------------------------------------------------------------------------

    def execute(self) -> PipelineResult:
        if self.plan.data_prep is not None:
            self.report.stage("data_prep")
            self.parts.append(prepare_data(self.plan.data_prep, self.data, self.plan, self.report))
            if self.should_stop():
                return self.result("data_prep", Outcome.stopped)
        ladder = self.plan.ladder
        if ladder is not None:
            if not ladder.custom:
                self.log("ladder skipped: no custom (file:) training data to decide on")
            else:
                self.report.stage("ladder", 2 * ladder.proxy_steps)
                if not self.ladder(ladder):
                    return self.result("ladder", Outcome.stopped)
        last = "data_prep"
        for stage in self.plan.stages:
            last = stage.name
            if self.should_stop():
                return self.result(stage.name, Outcome.stopped)
            verdict = self._verdict(stage)
            if verdict is None:
                return self.result(stage.name, Outcome.stopped)
            line = report_gate(self.report, stage.name, verdict)
            held = next((m.value for m in verdict.metrics if m.name == "held_out_loss"), None)
            self.held_out = held if held is not None else self.held_out
            if not verdict.passed:
                return self.result(stage.name, Outcome.gate_failed, summary=line)
            self.parts.append(f"{self.note or stage.name}, {line.split(': ', 1)[-1]}")
            self.note = ""
            lora_stage = isinstance(stage, PostPlan) and stage.section.lora is not None
            self.previous = str(self.root / stage.name / MERGED if lora_stage else self.root / stage.name)
        return self.result(last, Outcome.succeeded)

    def _verdict(self, stage: LmPlan | PostPlan) -> Verdict | None:
        """The stage's gate: the recorded one of a stage already judged, else train it and judge its
        battery (and record that); None when stopped."""
        directory = self.root / stage.name
        directory.mkdir(parents=True, exist_ok=True)
        steps = _steps_of(stage)
        self.report.stage(stage.name, steps)
        recorded = recorded_verdict(directory)
        if recorded is not None:
            self.log(f"{stage.name} already judged; reporting its recorded gate")
            return recorded
        self.log(f"{stage.name}: {steps} steps")
        if isinstance(stage, LmPlan):
            battery, stopped = self.lm_stage(stage, directory)
        else:
            battery, stopped = self.post_stage(stage, directory)
        if stopped:
            return None
        metrics, passed = judge(battery)
        verdict = Verdict(metrics=metrics, passed=passed, findings=self.findings)
        self.findings = []
        record_verdict(directory, verdict)
        return verdict


def localized(
    manifest: Manifest, plan: Curriculum, local: dict[str, tuple[pathlib.Path, DataFormat]]
) -> tuple[Manifest, Curriculum]:
    """The manifest and plan with each tenant data ref pointing at its checked copy (its format the
    resolved one); a tenant ref without a copy is refused here, so no stage can open a path a
    manifest wrote (the agent copies every one: tests and the bench pass their own files)."""
    data, train, evals = [], dict(plan.train_refs), dict(plan.eval_refs)
    for ref in manifest.data:
        if ref.name in local:
            path, fmt = local[ref.name]
            source = f"file:{path}"
            ref = msgspec.structs.replace(ref, source=source, format=fmt)
            for table in (train, evals):
                if ref.name in table:
                    table[ref.name] = source
        elif is_tenant(ref.source) and not ref.source.startswith("file:"):
            raise ValueError(f"data {ref.name!r} was not copied into the run; nothing trains on it")
        data.append(ref)
    manifest = msgspec.structs.replace(manifest, data=data)
    return manifest, dataclasses.replace(plan, train_refs=train, eval_refs=evals)


def run_pipeline(
    manifest: Manifest,
    checkpoint_dir: pathlib.Path,
    report: Reporter,
    should_stop: Callable[[], bool],
    threads: int,
    trainers: Trainers = IN_PROCESS,
    *,
    plan: Curriculum | None = None,
    base: BaseModel | None = None,
    base_dir: pathlib.Path | None = None,
    store_root: pathlib.Path | None = None,
    local_inputs: dict[str, tuple[pathlib.Path, DataFormat]] | None = None,
    speed: Speed | None = None,
    data_parallel: int = 1,
) -> PipelineResult:
    """`trainers` train the stages: in this process by default; a gang's or a node share's as the
    launcher chose them (training/launch/launcher.py). `base` / `base_dir`: the manifest's base model as the scheduler resolved it, and
    its Hugging Face directory in the model store: the first stage starts from its weights and the
    run tokenizes with its tokenizer. `plan`: the run's stages as the agent planned them (once);
    planned here when not given (tests, the bench). `local_inputs`: the tenant's data refs as the
    agent copied them into the run's directory (services/trainer/inputs.py); every stage reads
    those copies, never a path the manifest wrote. `speed`: compile, activation checkpointing and
    the micro-batch every stage trains with (the plan's; training/engine/speed.py), the micro-batch
    fitted to each stage's batch cut into `data_parallel` slices."""
    torch.set_num_threads(max(1, threads))
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    plan = plan if plan is not None else curriculum_of(manifest, base)  # ValueError, in a sentence
    manifest, plan = localized(manifest, plan, local_inputs or {})
    if base is not None and (base_dir is None or not is_hf_model_dir(base_dir)):
        raise ValueError(f"The base model {base.name} ({base.digest}) is not in this trainer's model store.")
    model = manifest.model.base or (manifest.model.size.value if manifest.model.size else "")
    report.log(f"plan: {' -> '.join(plan.stage_names)} on {model}")
    run = _Run(
        manifest,
        plan,
        checkpoint_dir,
        report,
        should_stop,
        threads,
        trainers.lm,
        trainers.post,
        trainers.ladder,
        base_dir=base_dir if base is not None else None,
        store_root=store_root,
        speed=speed,
        data_parallel=data_parallel,
    )
    return run.execute()

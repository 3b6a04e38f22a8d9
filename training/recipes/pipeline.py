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
"""

import dataclasses
import functools
import itertools
import json
import os
import pathlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from contracts.evals import EvalMetric, ProvenanceStep
from contracts.manifest import (
    DataFormat,
    DataPrepStage,
    DataRef,
    DpoStage,
    LongContextGate,
    Manifest,
    RlvrStage,
    SftStage,
)
from contracts.models import BaseModel, ModelShape
from contracts.runs import LogLevel, Outcome
from domain.curriculum import Curriculum, LadderPlan, LmPlan, PostPlan, curriculum_of
from domain.data_refs import is_tenant
from domain.gates import overfitting, sentence, threshold
from runtime.storage import data_files
from training.data import prep, rows
from training.data.corpora import (
    join_documents,
    load_documents,
    load_eval_suite,
    load_eval_tokens,
    load_text,
    task_problems,
)
from training.data.token_files import iter_source_documents, write_token_files
from training.data.tokenizer import Tokenizer, load_tokenizer
from training.engine.checkpoint import write_merged_checkpoint
from training.engine.checkpoint_load import is_hf_model_dir, load_weights
from training.engine.loop import pick_device
from training.engine.reporting import Reporter
from training.model import Transformer
from training.recipes.data_ladder import LadderDecision, run_ladder
from training.recipes.evals import (
    Check,
    describe,
    hold_out,
    judge,
    needle_accuracy,
    needle_trials,
    preference,
    task_accuracy,
    task_suite,
)
from training.recipes.posttrain import (
    PostConfig,
    PostResult,
    TokenExample,
    TokenPair,
    pair_logprobs,
    response_loss,
    wrong_answer,
)
from training.recipes.pretrain import (
    TOKENS_SOURCE,
    StageConfig,
    StageResult,
    build_model,
    held_out_loss,
    lm_loss,
    lm_stage_config,
    load_stage_data,
    train_stage,
)
from training.recipes.rlvr import RlvrConfig, RlvrResult, train_post
from training.weights import lora

GATE_RECORD = "GATE.json"
MERGED = lora.MERGED_DIR  # a LoRA stage's adapters merged into its base: the next stage's start
PROVENANCE_RECORD = "provenance.json"
EVAL_MAX_BATCHES = 8  # held-out loss of post-training stages: the same windows as the LM stages
TrainLm = Callable[[StageConfig, Reporter, Callable[[], bool]], StageResult]
"""How a next-token stage trains: `train_stage` in this process, or a gang's (training/launch/elastic.py)."""
TrainPost = Callable[[PostConfig, Reporter, Callable[[], bool]], PostResult | RlvrResult]
"""How a post-training stage trains (`cfg` an RlvrConfig for rlvr): `rlvr.train_post` in this
process, or a gang's."""
DecideLadder = Callable[..., LadderDecision | None]
"""How the ladder decides (`ladder.run_ladder`'s arguments): its proxy runs in this process, or, on a
run of several nodes, node 0's decision read by the others (`multinode.NodeShare.ladder`)."""
NEEDLE_ANSWER_ROOM = 6  # five key digits and a spare byte after the needle prompt


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


@dataclass(frozen=True, slots=True)
class _HeldOut:
    """What a post-training stage is judged on, none of it trained on: the SFT eval split
    (`examples`, response tokens learnt) and, for DPO, held-out preference pairs. `split`: held out
    of the stage's own training data (no eval split says otherwise), which then trains without them."""

    examples: list[TokenExample]
    pairs: list[TokenPair]
    split: bool


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What data preparation recorded: the prepared file per ref, and its provenance."""

    files: dict[str, str]
    steps: list[ProvenanceStep]
    input_digest: str
    output_digest: str


def _write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _steps_of(stage: LmPlan | PostPlan) -> int:
    return stage.steps if isinstance(stage, LmPlan) else stage.section.steps


class _Run:
    """One execution of a plan; holds what stages hand on (data sources, the last stage's dir)."""

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
    ):
        self.manifest, self.plan, self.root = manifest, plan, root
        self.base_dir = base_dir  # a base model's HF directory: the first stage starts from it
        self.store_root = store_root  # the model store (tokenizer entries by digest)
        self.report, self.should_stop, self.threads = report, should_stop, threads
        self.train_lm, self.train_post, self.decide_ladder = train_lm, train_post, decide_ladder
        self.sources = dict(plan.train_refs)  # ref name -> what to load: raw source, or the prepared file
        self.refs = {ref.name: ref for ref in manifest.data}
        self.structured = {ref.name for ref in manifest.data if rows.is_structured(ref)}  # JSONL / Parquet
        # Text eval suites (generated, builtin, text files): the held-out text of the LM batteries.
        self.eval_sources = [src for name, src in plan.eval_refs.items() if name not in self.structured]
        # The last trained stage's checkpoint dir; before the first, the base model's HF directory
        # (checkpoint.load_weights reads either), or None for a from-scratch run.
        self.previous: str | None = str(base_dir) if base_dir is not None else None
        self.parts: list[str] = []
        self.note = ""  # what the stage that just trained did, for the summary
        self.final_loss: float | None = None
        self.held_out: float | None = None
        self.findings: list[str] = []  # what the stage just judged showed but does not gate
        self._held: dict[str, _HeldOut] = {}

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

    # --- data preparation ------------------------------------------------------------------------

    def data_prep(self, cfg: DataPrepStage) -> None:
        directory = self.root / "data_prep"
        directory.mkdir(parents=True, exist_ok=True)
        record = directory / PROVENANCE_RECORD
        if record.exists():
            saved = json.loads(record.read_text())
            self.log("data_prep already done; using the prepared corpus")
        else:
            saved = self._prepare(cfg, directory)
            _write_json(record, saved)  # last: the corpus counts only once this exists
        prepared = msgspec.convert(saved, _Prepared)
        self.sources = {name: f"file:{path}" for name, path in prepared.files.items()}
        self.report.provenance(prepared.steps, prepared.input_digest, prepared.output_digest)
        before = prepared.steps[0].before if prepared.steps else 0
        kept = prepared.steps[-1].after if prepared.steps else 0
        self.parts.append(f"data_prep {before} -> {kept} documents")

    def _prepare(self, cfg: DataPrepStage, directory: pathlib.Path) -> dict[str, Any]:
        """Deduplicate and decontaminate the training refs; write one prepared file per ref; the
        record (JSON) of what was done."""
        seed = self.manifest.seed
        table = {
            name: rows.read_rows(self.refs[name]) for name in self.plan.train_refs if name in self.structured
        }
        sources = {
            name: [rows.row_text(r) for r in table[name]] if name in table else load_documents(src, seed=seed)
            for name, src in self.plan.train_refs.items()
        }
        suites = {
            name: self._structured_eval_texts(name)
            if name in self.structured
            else load_eval_suite(src, seed=seed)
            for name, src in self.plan.eval_refs.items()
        }
        suites.update(self._battery_suites())
        prepared = prep.prepare(
            sources,
            suites,
            exact=cfg.exact_dedup,
            near=cfg.near_dedup,
            shingle_words=cfg.shingle_words,
            permutations=cfg.minhash_permutations,
            bands=cfg.minhash_bands,
            jaccard=cfg.near_dup_jaccard,
            ngram=cfg.decontamination_ngram,
        )
        files = {}
        for i, (name, src) in enumerate(self.plan.train_refs.items()):
            if name in table:  # the surviving rows, as JSONL: the stages read them like the original
                path = directory / f"{i:02d}.jsonl"
                rows.write_rows(path, rows.kept_rows(table[name], sources[name], prepared.documents[name]))
            else:
                path = directory / f"{i:02d}.txt"
                path.write_text(join_documents(src, prepared.documents[name]), encoding="utf-8")
            files[name] = str(path)
        return {
            "files": files,
            "input_digest": prepared.input_digest,
            "output_digest": prepared.output_digest,
            "steps": [dataclasses.asdict(s) for s in prepared.steps],
        }

    def _tokenized(self, names: tuple[str, ...]) -> bool:
        """Whether a next-token stage reads token files: anything but the byte tokenizer on raw
        sources (the tiny demo's path, where a source is its bytes)."""
        return self.tokenizer.id != "bytes" or any(n in self.structured for n in names)

    def _token_files(self, key: str, names: tuple[str, ...]) -> str:
        """`names`' documents tokenized once into `<run>/tokens/<key>/` (reused when complete for the
        same tokenizer and inputs): a `tokens:` source the stage memory-maps."""
        fmt = {n: self._format(n) for n in names}
        documents = itertools.chain.from_iterable(
            iter_source_documents(self.sources[n], fmt[n], seed=self.manifest.seed) for n in names
        )
        inputs = {n: self.refs[n].digest or self.sources[n] for n in names}
        directory = self.root / "tokens" / key
        write_token_files(directory, documents, self.tokenizer, sources=inputs)
        return f"{TOKENS_SOURCE}{directory}"

    def _eval_token_files(self) -> str:
        """The text eval suites (the same documents the byte path reads), tokenized once."""
        seed = self.manifest.seed
        names = [n for n in self.plan.eval_refs if n not in self.structured]
        documents = itertools.chain.from_iterable(
            load_eval_suite(self.plan.eval_refs[n], seed=seed) for n in names
        )
        directory = self.root / "tokens" / "eval"
        write_token_files(
            directory, documents, self.tokenizer, sources={n: self.plan.eval_refs[n] for n in names}
        )
        return f"{TOKENS_SOURCE}{directory}"

    def _structured_eval_texts(self, name: str) -> list[str]:
        """An eval ref's split as documents: its first EVAL_ROWS rows' texts."""
        return [rows.row_text(r) for r in rows.read_rows(self.refs[name])[: rows.EVAL_ROWS]]

    def _battery_suites(self) -> dict[str, list[str]]:
        """Eval text the batteries generate themselves (the needle trials), decontaminated against too."""
        suites = {}
        for stage in self.plan.stages:
            if (
                isinstance(stage, LmPlan)
                and stage.name == "long_context"
                and isinstance(stage.gate, LongContextGate)
            ):
                trials = needle_trials(
                    stage.gate.needle_trials, stage.seq_len - NEEDLE_ANSWER_ROOM, self.manifest.seed
                )
                suites["needle-eval"] = [prompt + key for prompt, key in trials]
        return suites

    # --- ladder ----------------------------------------------------------------------------------

    def ladder(self, lad: LadderPlan) -> bool:
        """False if stopped."""
        target = self.manifest.target
        decision = self.decide_ladder(
            lad,
            sources=self.sources,
            eval_sources=self.eval_sources,
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
        train_sources, eval_sources = [self.sources[n] for n in stage.data], self.eval_sources
        if self._tokenized(stage.data):  # a real tokenizer, or JSONL/Parquet text: token files
            train_sources = [self._token_files(stage.name, stage.data)]
            eval_sources = [self._eval_token_files()] if self.eval_sources else []
        cfg = lm_stage_config(
            stage,
            self.manifest,
            directory,
            train_sources=train_sources,
            eval_sources=eval_sources,
            init_from=self.previous,
        )
        _, held = load_stage_data(cfg)
        incoming = self._lm_incoming(stage, cfg, held)
        result = self.train_lm(cfg, self.report, self.should_stop)
        if result.stopped:
            return [], True
        assert result.model is not None, "a stage that was not stopped returns its model"
        self._noted(stage.name, result.final_step, result.first_loss, result.final_loss)
        self.final_loss = result.final_loss if result.final_loss is not None else self.final_loss
        measured = {
            "held_out_loss": result.held_out_loss,
            "task_accuracy": task_accuracy(
                result.model, self._problems(stage.gate.task_samples), self.tokenizer
            ),
        }
        measured |= self._long_context_measures(stage, cfg, held, result.model)
        self.findings = [f for f in [overfitting(result.final_loss, result.held_out_loss)] if f]
        return self._checks(stage, measured, incoming), False

    def _lm_incoming(self, stage: LmPlan, cfg: StageConfig, held: torch.Tensor) -> dict[str, float | None]:
        """The battery's values on the model the stage starts from: the gate's defaults are relative
        to them."""
        device = pick_device(cfg.device)
        incoming: dict[str, float | None] = {}
        before = self._incoming_model(stage.shape, stage.seq_len, stage.rope_base)
        if before is not None:
            incoming["held_out_loss"] = held_out_loss(before, held, cfg, device)
        if stage.short_seq_len is not None and self.previous is not None:
            incoming["short_context_loss"] = self._short_loss_before(
                cfg, stage.shape, stage.short_seq_len, self.previous
            )
        return incoming

    def _long_context_measures(
        self, stage: LmPlan, cfg: StageConfig, held: torch.Tensor, model: Transformer
    ) -> dict[str, float | None]:
        """Short-context loss and needle retrieval of a long-context stage; nothing for the others."""
        if stage.short_seq_len is None or not isinstance(stage.gate, LongContextGate):
            return {}
        trials = needle_trials(
            stage.gate.needle_trials, stage.seq_len - NEEDLE_ANSWER_ROOM, self.manifest.seed
        )
        return {
            "short_context_loss": held_out_loss(
                model, held, cfg, pick_device(cfg.device), seq_len=stage.short_seq_len
            ),
            "needle_accuracy": needle_accuracy(model, trials),
        }

    def _incoming_model(self, shape: ModelShape, seq_len: int, rope_base: float | None) -> Transformer | None:
        """The model a stage starts from: the previous stage's weights, or a fresh initialisation
        (seeded like the run) for the first stage; None when the previous weights cannot load."""
        if self.previous is None:
            torch.manual_seed(self.manifest.seed)
        model = build_model(shape, seq_len=seq_len, rope_base=rope_base, device=pick_device())
        if self.previous is not None and load_weights(self.previous, model) is None:
            return None
        return model

    def _checks(
        self, stage: LmPlan | PostPlan, measured: dict[str, float | None], incoming: dict[str, float | None]
    ) -> list[Check]:
        """The battery's measurements against the stage's gate: every rule of the gate is judged
        (its threshold relative to the incoming model, tightened by the manifest); what the gate
        does not cover is reported with no threshold."""
        rules = {r.metric: r for r in self.plan.rules(stage)}
        before = self.plan.incoming_label(stage)
        checks = []
        for name, value in measured.items():
            rule = rules.get(name)
            bound = threshold(rule, incoming.get(name)) if rule is not None else None
            words = (
                ""
                if value is None
                else sentence(
                    rule,
                    value,
                    bound,
                    incoming.get(name),
                    incoming_label=before,
                    stage=stage.name,
                    metric=name,
                )
            )
            if rule is None:
                checks.append(Check(name=name, value=value, sentence=words))
            else:
                checks.append(Check(name=name, value=value, threshold=bound, op=rule.op, sentence=words))
        return checks

    def _short_loss_before(
        self, cfg: StageConfig, shape: ModelShape, short_seq_len: int, previous: str
    ) -> float | None:
        """Short-context held-out loss of the incoming model (previous stage's weights, RoPE base)."""
        device = pick_device(cfg.device)
        incoming = build_model(shape, seq_len=short_seq_len, rope_base=None, device=device)
        if load_weights(previous, incoming) is None:
            return None
        _, held = load_stage_data(cfg)
        return held_out_loss(incoming, held, cfg, device, seq_len=short_seq_len)

    def post_stage(self, stage: PostPlan, directory: pathlib.Path) -> tuple[list[Check], bool]:
        incoming, reference = self._post_measures(
            self._incoming_model(stage.shape, self.manifest.target.seq_len, stage.rope_base), stage
        )
        result = self._train_post(stage, directory)
        if result.stopped:
            return [], True
        self._noted(stage.name, result.final_step, result.first_loss, result.final_loss)
        self.final_loss = result.final_loss if result.final_loss is not None else self.final_loss
        if stage.section.lora is not None and result.model is not None:
            # The stage committed its adapters alone; what follows starts from the merged model.
            write_merged_checkpoint(result.model, stage.section.lora, directory / MERGED, result.final_step)
        measured, policy = self._post_measures(result.model, stage)
        if isinstance(stage.section, DpoStage) and policy is not None and reference is not None:
            accuracy, margin = preference(policy, reference, stage.section.beta)
            measured = {"preference_accuracy": accuracy, "reward_margin": margin} | measured
        self.findings = []
        if isinstance(stage.section, SftStage):
            self.findings = [f for f in [overfitting(result.final_loss, measured.get("held_out_loss"))] if f]
        return self._checks(stage, measured, incoming), False

    def _train_post(self, stage: PostPlan, directory: pathlib.Path) -> PostResult | RlvrResult:
        """Train SFT, DPO or RLVR, as the stage's manifest section says (without the rows held out
        for its gate, when they come from its own training data)."""
        seed = self.manifest.seed
        problems, examples, pairs = self._post_data(stage)
        if self._held_out(stage).split:
            problems, examples, pairs = hold_out(problems)[0], hold_out(examples)[0], hold_out(pairs)[0]
        section = stage.section
        common = PostConfig(
            stage=stage.name,
            shape=stage.shape,
            rope_base=stage.rope_base,
            problems=problems,
            steps=section.steps,
            batch_size=1,  # each section's own, below
            learning_rate=section.learning_rate,
            seed=seed,
            checkpoint_dir=str(directory),
            checkpoint_interval=self.manifest.checkpoint.interval_steps,
            keep_last=self.manifest.checkpoint.keep_last,
            init_from=self.previous,
            examples=examples,
            pairs=pairs,
            pad_id=self.tokenizer.pad_id,
            lora=section.lora,
        )
        match section:
            case SftStage():
                cfg = dataclasses.replace(common, batch_size=section.batch_size)
                return self.train_post(cfg, self.report, self.should_stop)
            case DpoStage():
                cfg = dataclasses.replace(common, batch_size=section.batch_size, beta=section.beta)
                return self.train_post(cfg, self.report, self.should_stop)
            case RlvrStage():
                return self._train_rlvr(common, section)
        raise ValueError(f"Unknown post-training stage {stage.name!r}.")

    def _post_data(
        self, stage: PostPlan
    ) -> tuple[list[tuple[str, str]], list[TokenExample], list[TokenPair]]:
        """A post-training stage's training data, all of it: task problems (the byte path), token
        examples (SFT) or token pairs (DPO)."""
        seed = self.manifest.seed
        structured = [name for name in stage.data if name in self.structured]
        problems = [
            p
            for name in stage.data
            if name not in self.structured
            for p in task_problems(load_text(self.sources[name], seed=seed))
        ]
        examples: list[TokenExample] = []
        pairs: list[TokenPair] = []
        if problems and self.tokenizer.id != "bytes":  # task lines through the run's real tokenizer
            examples, pairs = self._task_tokens(stage, problems)
            problems = []
        if structured:
            table = [r for name in structured for r in self._rows(name)]
            if isinstance(stage.section, SftStage):
                examples = rows.sft_examples(self.tokenizer, table)
            elif isinstance(stage.section, DpoStage):
                pairs = rows.dpo_pairs(self.tokenizer, table)
            else:
                raise ValueError(f"{stage.name} does not train on JSONL or Parquet rows yet.")
        return problems, examples, pairs

    def _held_out(self, stage: PostPlan) -> _HeldOut:
        """The stage's held-out data: the eval refs' (a chat eval split or the verifiable eval
        suites as SFT examples; preference rows as pairs), else a split of the stage's own
        training data (SFT: examples; DPO: pairs, drawn like its training pairs)."""
        if stage.name in self._held:
            return self._held[stage.name]
        chat_eval = [name for name in self.plan.eval_refs if name in self.structured]
        table = [r for name in chat_eval for r in self._rows(name)[: rows.EVAL_ROWS]]
        tasks = self._problems(stage.gate.task_samples)
        examples = rows.sft_examples(self.tokenizer, [r for r in table if "messages" in r])
        if not examples and tasks:
            examples = self._task_tokens(stage, tasks, sft=True)[0]
        pairs: list[TokenPair] = []
        split = False
        is_dpo = isinstance(stage.section, DpoStage)
        if is_dpo:
            pairs = rows.dpo_pairs(self.tokenizer, [r for r in table if "chosen" in r])
        if (isinstance(stage.section, SftStage) and not examples) or (is_dpo and not pairs):
            problems, own_examples, own_pairs = self._post_data(stage)
            held_problems = hold_out(problems)[1]
            if isinstance(stage.section, SftStage):
                examples = self._task_tokens(stage, held_problems, sft=True)[0] + hold_out(own_examples)[1]
            else:
                pairs = self._task_tokens(stage, held_problems, sft=False)[1] + hold_out(own_pairs)[1]
            split = True
        if is_dpo and not examples:  # the SFT objective on the held-out pairs' chosen answers
            examples = [(p + c, [0] * len(p) + [1] * len(c)) for p, c, _ in pairs]
        held = _HeldOut(examples=examples, pairs=pairs, split=split)
        self._held[stage.name] = held
        return held

    def _train_rlvr(self, common: PostConfig, section: RlvrStage) -> RlvrResult:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(PostConfig)}
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

    def _post_measures(
        self, model: Transformer | None, stage: PostPlan
    ) -> tuple[dict[str, float | None], torch.Tensor | None]:
        """Held-out loss on the SFT eval split, loss on the eval text, task accuracy, and (DPO) the
        held-out pairs' summed log-probabilities: measured on the incoming model and again on the
        trained one, with the same examples, windows and problems."""
        if model is None:
            return {}, None
        held_out = self._held_out(stage)
        general = None
        if self.eval_sources:
            target = self.manifest.target
            tokens = load_eval_tokens(self.eval_sources, seed=self.manifest.seed)
            general = lm_loss(
                model,
                tokens,
                seq_len=target.seq_len,
                batch_size=target.batch_size,
                max_batches=EVAL_MAX_BATCHES,
                device=pick_device(),
            )
        pad = self.tokenizer.pad_id
        measured = {
            # the SFT objective (the response tokens) on examples the stage never trained on
            "held_out_loss": response_loss(model, held_out.examples, pad) if held_out.examples else None,
            "task_accuracy": task_accuracy(model, self._problems(stage.gate.task_samples), self.tokenizer),
        }
        if general is not None:
            measured["general_held_out_loss"] = general  # next-token loss on the eval text: reported
        sums = pair_logprobs(model, held_out.pairs, pad) if held_out.pairs else None
        return measured, sums

    def _task_tokens(
        self, stage: PostPlan, problems: list[tuple[str, str]], *, sft: bool | None = None
    ) -> tuple[list[TokenExample], list[TokenPair]]:
        """Verifiable tasks as the run's tokenizer encodes them: SFT examples (the answer and its
        newline learnt), or DPO pairs (the right answer against a nearby wrong one, drawn once per
        task from the run's seed). `sft`: which (default: the stage's kind)."""
        tok = self.tokenizer
        if sft if sft is not None else isinstance(stage.section, SftStage):
            out = []
            for prompt, answer in problems:
                p, a = tok.encode(prompt), tok.encode(answer + "\n")
                out.append((p + a, [0] * len(p) + [1] * len(a)))
            return out, []
        rng = random.Random(f"{stage.name}:{self.manifest.seed}:pairs")
        pairs = [
            (tok.encode(p), tok.encode(a + "\n"), tok.encode(wrong_answer(a, rng) + "\n"))
            for p, a in problems
        ]
        return [], pairs

    def _format(self, name: str) -> DataFormat:
        """The format of what a ref's stages read now: the prepared file's own (data prep writes a
        structured ref's surviving rows as JSONL, whatever it came in: issue 39, a Parquet corpus
        was then opened as Parquet), else the ref's."""
        source = self.sources.get(name, self.refs[name].source)
        if source != self.refs[name].source:
            return data_files.file_format(DataRef(name=name, source=source))
        return data_files.file_format(self.refs[name])

    def _rows(self, name: str) -> list[rows.Row]:
        """A JSONL / Parquet ref's rows: the prepared file's once data prep ran, else the original."""
        source = self.sources.get(name, self.refs[name].source)
        return rows.read_rows(self.refs[name], source=source)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer: the manifest's, else the base model's, else bytes."""
        return load_tokenizer(self.manifest.model.tokenizer, self.base_dir, self.store_root)

    def _noted(self, name: str, step: int, first: float | None, final: float | None) -> None:
        if first is None or final is None:  # a redelivered run that had already trained this stage
            self.note = f"{name} finished at step {step} (resumed from its final checkpoint)"
        else:
            self.note = f"{name} finished at step {step}: loss {first:.3f} -> {final:.3f}"

    def _problems(self, limit: int) -> list[tuple[str, str]]:
        return task_suite(self.eval_sources, seed=self.manifest.seed, limit=limit)

    # --- the whole run ---------------------------------------------------------------------------

    def execute(self) -> PipelineResult:
        if self.plan.data_prep is not None:
            self.report.stage("data_prep")
            self.data_prep(self.plan.data_prep)
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
            metrics, passed, findings = verdict
            line = self._report_gate(stage.name, metrics, passed, findings)
            if not passed:
                return self.result(stage.name, Outcome.gate_failed, summary=line)
            self.parts.append(f"{self.note or stage.name}, {line.split(': ', 1)[-1]}")
            self.note = ""
            lora_stage = isinstance(stage, PostPlan) and stage.section.lora is not None
            self.previous = str(self.root / stage.name / MERGED if lora_stage else self.root / stage.name)
        return self.result(last, Outcome.succeeded)

    def _verdict(self, stage: LmPlan | PostPlan) -> tuple[list[EvalMetric], bool, list[str]] | None:
        """The stage's gate: the recorded one of a stage already judged, else train it and judge its
        battery (and record that); None when stopped."""
        directory = self.root / stage.name
        directory.mkdir(parents=True, exist_ok=True)
        steps = _steps_of(stage)
        self.report.stage(stage.name, steps)
        record = directory / GATE_RECORD
        if record.exists():
            saved = json.loads(record.read_text())
            self.log(f"{stage.name} already judged; reporting its recorded gate")
            findings = [str(f) for f in saved.get("findings", [])]
            return msgspec.convert(saved["metrics"], list[EvalMetric]), bool(saved["passed"]), findings
        self.log(f"{stage.name}: {steps} steps")
        if isinstance(stage, LmPlan):
            checks, stopped = self.lm_stage(stage, directory)
        else:
            checks, stopped = self.post_stage(stage, directory)
        if stopped:
            return None
        metrics, passed = judge(checks)
        findings = self.findings
        self.findings = []
        _write_json(record, {"metrics": msgspec.to_builtins(metrics), "passed": passed, "findings": findings})
        return metrics, passed, findings

    def _report_gate(self, stage: str, metrics: list[EvalMetric], passed: bool, findings: list[str]) -> str:
        """The eval event and its one-line summary (logged as an error when the gate failed), each
        metric's sentence, and the findings (as warnings)."""
        self.report.eval(stage, metrics, passed, findings)
        held = next((m.value for m in metrics if m.name == "held_out_loss"), None)
        self.held_out = held if held is not None else self.held_out
        line = describe(stage, metrics)
        self.log(line, LogLevel.info if passed else LogLevel.error)
        for m in metrics:
            if m.sentence:
                self.log(f"{stage} gate: {m.sentence}", LogLevel.info if m.passed else LogLevel.error)
        for finding in findings:
            self.log(f"{stage}: {finding}", LogLevel.warning)
        return line


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
) -> PipelineResult:
    """`trainers` train the stages: in this process by default; a gang's or a node share's as the
    launcher chose them (training/launch/launcher.py). `base` / `base_dir`: the manifest's base model as the scheduler resolved it, and
    its Hugging Face directory in the model store: the first stage starts from its weights and the
    run tokenizes with its tokenizer. `plan`: the run's stages as the agent planned them (once);
    planned here when not given (tests, the bench). `local_inputs`: the tenant's data refs as the
    agent copied them into the run's directory (services/trainer/inputs.py); every stage reads
    those copies, never a path the manifest wrote."""
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
    )
    return run.execute()

"""The curriculum: which stages a manifest runs, in what order, on which data, for how many steps,
with which gate. A pure function of the manifest (`curriculum_of`): the one validation, used twice.
(Not to be confused with `contracts.plans.Plan`, the `plan` verb's answer: the resources and the
cost, which `services/scheduler/planning.plan` prices from a curriculum.) The
scheduler's plan gate calls it before anything is reserved (`manifest_invalid` with the sentence),
and the trainer calls it again as its own guard, so a manifest the plan accepts always runs.

Order is fixed: data_prep -> ladder -> pretrain -> midtrain -> long_context -> the post-training
recipe in the order listed. Token budget: `target.tokens` is the whole pre-training budget D, as
the planner prices it; midtrain and long_context take their `tokens` out of it and pretrain trains
on the rest. The ladder's two proxy runs are bounded to `max_budget_fraction` of the pre-training
steps. Post-training is sized in steps.

Data: next-token stages read any training ref (text files as documents, JSONL/Parquet files by
their `text` column); a post-training stage reads the generated verifiable tasks or JSONL/Parquet
files (sft: `messages`, dpo: `prompt`/`chosen`/`rejected`, rlvr: `prompt`/`answer` + a verifier).
Formats are decided from the manifest alone (`DataRef.format`, else the suffix): the columns
themselves are the scheduler's plan-time check (services/scheduler/inputs.py), not this function's.
"""

import hashlib
from dataclasses import dataclass

import msgspec

from contracts.manifest import (
    DataFormat,
    DataPrepStage,
    DataRole,
    DpoStage,
    Gate,
    LongContextGate,
    Manifest,
    RlvrStage,
    SftStage,
)
from contracts.models import MODEL_SHAPES, BaseModel, ModelShape
from domain import gates
from domain.data_refs import SourceKind, is_tenant, kind_of
from domain.data_schemas import ROW_FORMATS, file_format, reads_rows

POST_STAGES = ("sft", "dpo", "rlvr")
TASK_SOURCES = (
    "generated:arithmetic",
    "generated:small_arithmetic",
    "generated:reverse",
)  # sources with verifiable answers
WARMUP_FRACTION = 0.05  # of a stage's steps; 1-2% is enough for long runs, tiny runs need a few steps
ANNEAL_LR_FRACTION = 0.1  # midtrain/long-context default LR: where pretrain's cosine ended
PROXY_SIZE = {"tiny": "tiny"}  # the ladder's proxy model; every other size uses the "150M" ladder


@dataclass(frozen=True, slots=True, kw_only=True)
class LmPlan:
    """A next-token stage: pretrain, midtrain or long_context."""

    name: str
    steps: int
    data: tuple[str, ...]  # training ref names
    seq_len: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    decay: str  # "cosine" or "linear"
    min_lr_ratio: float
    shape: ModelShape  # max_seq_len grown to seq_len for long context
    rope_base: float | None
    gate: Gate | LongContextGate
    short_seq_len: int | None = None  # long_context: the length short-context loss is measured at


@dataclass(frozen=True, slots=True, kw_only=True)
class PostPlan:
    name: str  # "sft", "dpo" or "rlvr"
    data: tuple[str, ...]  # generated task ref names
    shape: ModelShape
    rope_base: float | None
    section: SftStage | DpoStage | RlvrStage
    gate: Gate


@dataclass(frozen=True, slots=True, kw_only=True)
class LadderPlan:
    proxy_steps: int
    max_loss_regression: float
    proxy_shape: ModelShape
    reference: tuple[str, ...]  # non-file training refs (the reference mix)
    custom: tuple[
        str, ...
    ]  # the tenant's own training refs (upload:, s3://, file:); empty: the ladder is skipped


@dataclass(frozen=True, slots=True, kw_only=True)
class Curriculum:
    """The stages a manifest runs (`curriculum_of`), with what they read and how they are judged."""

    train_refs: dict[str, str]  # name -> source, in manifest order
    eval_refs: dict[str, str]
    data_prep: DataPrepStage | None
    ladder: LadderPlan | None
    stages: tuple[LmPlan | PostPlan, ...]
    shape: ModelShape | None = None  # the model the run starts from (the base model's, or the size's)
    base: BaseModel | None = None  # the base model it fine-tunes; None: from scratch
    row_refs: frozenset[str] = frozenset()  # training refs read as JSONL / Parquet rows
    chat_evals: tuple[str, ...] = ()  # eval refs read as rows (a chat eval split)
    size: str | None = None  # the from-scratch model size; None for a base model's run

    def incoming_label(self, stage: "LmPlan | PostPlan") -> str:
        """What `stage` starts from, in words: "the pretrain model", "the base model", "the
        untrained model"; the gate's sentences name it."""
        names = [s.name for s in self.stages]
        i = names.index(stage.name) if stage.name in names else 0
        if i > 0:
            return f"the {names[i - 1]} model"
        return "the base model" if self.base is not None else "the untrained model"

    def rules(self, stage: "LmPlan | PostPlan") -> list[gates.Rule]:
        """The gate `stage` is judged on: the backend's battery, tightened by the manifest."""
        has_tasks = any(src in TASK_SOURCES for src in self.eval_refs.values())
        chat_eval = (
            bool(self.chat_evals) and isinstance(stage, PostPlan) and bool(set(stage.data) & self.row_refs)
        )
        return gates.rules(
            stage.name,
            stage.gate,
            has_tasks=has_tasks,
            has_held_out=bool(self.eval_refs),
            chat_eval=chat_eval,
            size=self.size,
        )

    @property
    def stage_names(self) -> list[str]:
        pre = [
            name for name, on in (("data_prep", self.data_prep), ("ladder", self.ladder)) if on is not None
        ]
        return pre + [s.name for s in self.stages]


def _steps(tokens: int, seq_len: int, batch_size: int) -> int:
    return max(1, tokens // (seq_len * batch_size))


def _warmup(steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * steps))


def _names(stage: str, requested: list[str], available: dict[str, str]) -> tuple[str, ...]:
    unknown = [n for n in requested if n not in available]
    if unknown:
        raise ValueError(f"Stage {stage} names data {unknown} that the manifest has no training ref for.")
    return tuple(requested or available)


def _check_gate(stage: str, gate: Gate | LongContextGate, *, has_tasks: bool, has_held_out: bool) -> None:
    gates.refuse_loosening(stage, gate)
    if gate.min_task_accuracy is not None and not has_tasks:
        raise ValueError(
            f"Stage {stage} gates on task accuracy, but no eval ref is a verifiable task "
            f"({' or '.join(TASK_SOURCES)})."
        )
    if gate.max_held_out_loss is not None and not has_held_out:
        raise ValueError(f"Stage {stage} gates on held-out loss, but the manifest has no eval ref.")


@dataclass(frozen=True, slots=True)
class _Refs:
    """The manifest's data refs by role (name -> source, in manifest order)."""

    train: dict[str, str]
    evals: dict[str, str]
    rows: frozenset[str] = frozenset()  # training refs that are JSONL/Parquet files (read by column)

    @property
    def has_tasks(self) -> bool:
        return any(src in TASK_SOURCES for src in self.evals.values())


def model_shape(manifest: Manifest, base: BaseModel | None = None) -> ModelShape:
    """The shape a run starts from: the size table's for a from-scratch run, the base model's (as
    the model store resolved it) for a fine-tune; ValueError when neither or both are named, or the
    named base was not resolved."""
    spec = manifest.model
    if (spec.size is None) == (spec.base is None):
        raise ValueError(
            "model: name either a size (a from-scratch run: tiny, 150M, 1B, 8B, 70B) or a base model "
            "(`ecc ito models` lists them), not both and not neither."
        )
    if spec.size is not None:
        return MODEL_SHAPES[spec.size.value]
    if base is None or base.name != spec.base:
        raise ValueError(f"model.base {spec.base!r} was not resolved from the model store.")
    return base.shape


def curriculum_of(manifest: Manifest, base: BaseModel | None = None) -> Curriculum:
    """The stages `manifest` runs, or ValueError with what to change. Checks run in a fixed order
    (refs, pre-training stages in run order, the recipe, the ladder, data prep), so a manifest with
    several faults is always told about the same one first. `base` is the manifest's base model as
    the model store resolved it (None for a from-scratch run)."""
    refs = _refs(manifest)
    base_shape = model_shape(manifest, base)
    lm = _lm_plans(manifest, refs, base_shape)
    last = lm[-1] if lm else None
    shape = last.shape if last is not None and last.name == "long_context" else base_shape
    rope_base = last.rope_base if last is not None and last.name == "long_context" else None
    plans: list[LmPlan | PostPlan] = [*lm, *_post_plans(manifest, refs, shape, rope_base)]
    ladder = _ladder_plan(manifest, refs, lm)
    data_prep = _data_prep(manifest, refs.evals)
    if not plans:
        raise ValueError(
            "The manifest trains nothing: no pre-training stage and an empty post-training recipe."
        )
    return Curriculum(
        train_refs=refs.train,
        eval_refs=refs.evals,
        data_prep=data_prep,
        ladder=ladder,
        stages=tuple(plans),
        shape=base_shape,
        base=base,
        row_refs=frozenset(r.name for r in manifest.data if r.role is DataRole.train and reads_rows(r)),
        chat_evals=tuple(r.name for r in manifest.data if r.role is DataRole.eval and reads_rows(r)),
        size=manifest.model.size.value if manifest.model.size is not None and base is None else None,
    )


def curriculum_digest(curriculum: Curriculum) -> str:
    """The SHA-256 of `curriculum` in msgspec's deterministic JSON (sets and keys sorted): what the
    scheduler signs into the work item with the cost it priced on it."""
    return hashlib.sha256(msgspec.json.encode(curriculum, order="deterministic")).hexdigest()


class CurriculumMismatch(ValueError):
    """The trainer plans a run's stages otherwise than the scheduler priced and signed them."""


def bound_curriculum(manifest: Manifest, base: BaseModel | None, signed_digest: str) -> Curriculum:
    """The run's curriculum, as the trainer plans it from the signed manifest, provided it is the one
    the scheduler priced (`signed_digest`, from the signed work item; empty on items signed before it
    was carried): CurriculumMismatch otherwise (a scheduler and a trainer of different versions), so a
    run trains the stages its person confirmed the cost of, or none. ValueError as `curriculum_of`."""
    curriculum = curriculum_of(manifest, base)
    if signed_digest and curriculum_digest(curriculum) != signed_digest:
        raise CurriculumMismatch(
            "this trainer plans the run's stages otherwise than the scheduler priced them (the two run "
            "different versions); nothing trained: retry once both run the same version"
        )
    return curriculum


def _refs(manifest: Manifest) -> _Refs:
    names = [ref.name for ref in manifest.data]
    if len(set(names)) != len(names):
        raise ValueError("Data ref names must be unique: stages refer to data by name.")
    for i, ref in enumerate(manifest.data):
        if file_format(ref) in ROW_FORMATS and not is_tenant(ref.source):
            raise ValueError(
                f"data[{i}].format is {file_format(ref).value}, which only your own data has (an "
                f"upload:, s3:// or file: source; source {ref.source!r})."
            )
        if kind_of(ref.source) is SourceKind.upload and ref.format is DataFormat.text:
            raise ValueError(
                f"data[{i}].format is text; an upload is JSONL or Parquet (leave format out: "
                "its record says which)."
            )
    train = {ref.name: ref.source for ref in manifest.data if ref.role is DataRole.train}
    evals = {ref.name: ref.source for ref in manifest.data if ref.role is DataRole.eval}
    rows = frozenset(ref.name for ref in manifest.data if ref.role is DataRole.train and reads_rows(ref))
    if not train:
        raise ValueError("The manifest names no training data.")
    return _Refs(train, evals, rows)


def _lm_plans(manifest: Manifest, refs: _Refs, base_shape: ModelShape) -> list[LmPlan]:
    """pretrain, midtrain and long_context, each where the manifest has it, in that order."""
    plans: list[LmPlan] = []
    if (pre := _pretrain_plan(manifest, refs, base_shape)) is not None:
        plans.append(pre)
    if (mid := _midtrain_plan(manifest, refs, base_shape)) is not None:
        plans.append(mid)
    if (lc := _long_context_plan(manifest, refs, base_shape, plans)) is not None:
        plans.append(lc)
    return plans


def _pretrain_plan(manifest: Manifest, refs: _Refs, base_shape: ModelShape) -> LmPlan | None:
    target, stages = manifest.target, manifest.stages
    if stages.pretrain is None:
        return None
    carved = (stages.midtrain.tokens if stages.midtrain else 0) + (
        stages.long_context.tokens if stages.long_context else 0
    )
    pretrain_tokens = target.tokens - carved
    if pretrain_tokens < 1:
        raise ValueError(
            f"midtrain and long_context take {carved} tokens, all of target.tokens ({target.tokens}); "
            "raise target.tokens, which is the whole pre-training budget."
        )
    steps = _steps(pretrain_tokens, target.seq_len, target.batch_size)
    _check_gate("pretrain", stages.pretrain.gate, has_tasks=refs.has_tasks, has_held_out=True)
    return LmPlan(
        name="pretrain",
        steps=steps,
        data=_names("pretrain", stages.pretrain.data, refs.train),
        seq_len=target.seq_len,
        batch_size=target.batch_size,
        learning_rate=target.learning_rate,
        warmup_steps=_warmup(steps),
        decay="cosine",
        min_lr_ratio=0.1,
        shape=base_shape,
        rope_base=None,
        gate=stages.pretrain.gate,
    )


def _midtrain_plan(manifest: Manifest, refs: _Refs, base_shape: ModelShape) -> LmPlan | None:
    target, mid = manifest.target, manifest.stages.midtrain
    if mid is None:
        return None
    seq_len = mid.seq_len or target.seq_len
    if seq_len > base_shape.max_seq_len:
        raise ValueError(
            f"midtrain seq_len {seq_len} exceeds the model's {base_shape.max_seq_len}; "
            "longer sequences are the long_context stage's."
        )
    steps = _steps(mid.tokens, seq_len, target.batch_size)
    _check_gate("midtrain", mid.gate, has_tasks=refs.has_tasks, has_held_out=True)
    return LmPlan(
        name="midtrain",
        steps=steps,
        data=_names("midtrain", mid.data, refs.train),
        seq_len=seq_len,
        batch_size=target.batch_size,
        learning_rate=mid.learning_rate or target.learning_rate * ANNEAL_LR_FRACTION,
        warmup_steps=_warmup(steps),
        decay="linear",
        min_lr_ratio=0.0,
        shape=base_shape,
        rope_base=None,
        gate=mid.gate,
    )


def _long_context_plan(
    manifest: Manifest, refs: _Refs, base_shape: ModelShape, before: list[LmPlan]
) -> LmPlan | None:
    """Longer sequences than anything trained `before`, on a grown model with a higher RoPE base."""
    target, lc = manifest.target, manifest.stages.long_context
    if lc is None:
        return None
    short = max([target.seq_len] + [p.seq_len for p in before])
    if lc.seq_len <= short:
        raise ValueError(
            f"long_context seq_len {lc.seq_len} must be longer than the {short} tokens trained before it."
        )
    if lc.rope_base <= base_shape.rope_base:
        raise ValueError(
            f"long_context rope_base {lc.rope_base:g} must be above the model's {base_shape.rope_base:g}."
        )
    batch_size = lc.batch_size or target.batch_size
    steps = _steps(lc.tokens, lc.seq_len, batch_size)
    _check_gate("long_context", lc.gate, has_tasks=refs.has_tasks, has_held_out=True)
    return LmPlan(
        name="long_context",
        steps=steps,
        data=_names("long_context", lc.data, refs.train),
        seq_len=lc.seq_len,
        batch_size=batch_size,
        learning_rate=lc.learning_rate or target.learning_rate * ANNEAL_LR_FRACTION,
        warmup_steps=_warmup(steps),
        decay="linear",
        min_lr_ratio=0.0,
        shape=msgspec.structs.replace(base_shape, max_seq_len=max(base_shape.max_seq_len, lc.seq_len)),
        rope_base=lc.rope_base,
        gate=lc.gate,
        short_seq_len=short,
    )


def _post_plans(
    manifest: Manifest, refs: _Refs, shape: ModelShape, rope_base: float | None
) -> list[PostPlan]:
    """The post-training recipe in the order listed, each on verifiable task data or on JSONL/Parquet
    files (`[]`: every training ref a post-training stage can read)."""
    recipe = manifest.post_training.recipe
    unknown = [r for r in recipe if r not in POST_STAGES]
    if unknown or len(set(recipe)) != len(recipe):
        raise ValueError(
            f"post_training.recipe lists {recipe}; use each of {', '.join(POST_STAGES)} at most once."
        )
    readable = {n: src for n, src in refs.train.items() if src in TASK_SOURCES or n in refs.rows}
    plans = []
    for name in recipe:
        section: SftStage | DpoStage | RlvrStage = getattr(manifest.post_training, name)
        data = _names(name, section.data, readable if not section.data else refs.train)
        if not data or any(n not in readable for n in data):
            raise ValueError(
                f"{name} trains on verifiable tasks or on JSONL/Parquet files: name training refs "
                f"with source {' or '.join(TASK_SOURCES)}, or your own data in jsonl or parquet (upload:, s3://, file:)."
            )
        if name == "rlvr" and (any(n in refs.rows for n in data) or not _byte_tokens(manifest)):
            raise ValueError(
                "rlvr trains on the generated task refs with the byte tokenizer only, for now: "
                "JSONL/Parquet prompt/answer rows and a base model's tokenizer are not trained by rlvr yet."
            )
        _check_gate(name, section.gate, has_tasks=refs.has_tasks, has_held_out=bool(refs.evals))
        plans.append(
            PostPlan(
                name=name, data=data, shape=shape, rope_base=rope_base, section=section, gate=section.gate
            )
        )
    return plans


def _byte_tokens(manifest: Manifest) -> bool:
    """Whether the run tokenizes as bytes: a from-scratch run with no tokenizer named, or `bytes`."""
    return manifest.model.base is None and manifest.model.tokenizer in (None, "bytes")


def _ladder_plan(manifest: Manifest, refs: _Refs, lm: list[LmPlan]) -> LadderPlan | None:
    """Two proxy runs (reference mix vs with the tenant's own refs), bounded to the budget fraction."""
    lad = manifest.stages.ladder
    if lad is None:
        return None
    custom = tuple(n for n, src in refs.train.items() if is_tenant(src))
    reference = tuple(n for n in refs.train if n not in custom)
    budget_steps = sum(p.steps for p in lm)
    bound = int(lad.max_budget_fraction * budget_steps) // 2  # two proxy runs share the fraction
    if custom and bound < 1:
        raise ValueError(
            f"The ladder's budget ({lad.max_budget_fraction:g} of {budget_steps} pre-training steps) "
            "allows no proxy step; raise max_budget_fraction or target.tokens."
        )
    return LadderPlan(
        proxy_steps=min(lad.proxy_steps, max(1, bound)),
        max_loss_regression=lad.max_loss_regression,
        proxy_shape=MODEL_SHAPES[
            PROXY_SIZE.get(manifest.model.size.value if manifest.model.size else "", "150M")
        ],
        reference=reference,
        custom=custom,
    )


def _data_prep(manifest: Manifest, evals: dict[str, str]) -> DataPrepStage | None:
    """Declared means done: whenever a training ref declares decontamination, or the manifest has
    eval refs to keep out of the training data, data prep runs (with the defaults unless the
    manifest configures it). A declaration this backend cannot honour is refused here."""
    declared = [
        (i, ref)
        for i, ref in enumerate(manifest.data)
        if ref.role is DataRole.train and ref.decontamination is not None
    ]
    prep = manifest.stages.data_prep
    if prep is None and (declared or evals):
        prep = DataPrepStage()
    if prep is None:
        return None
    if prep.minhash_permutations % prep.minhash_bands:
        raise ValueError(
            f"data_prep: {prep.minhash_permutations} MinHash permutations do not split into "
            f"{prep.minhash_bands} equal bands."
        )
    method = f"{prep.decontamination_ngram}-gram"
    for i, ref in declared:
        deco = ref.decontamination
        assert deco is not None  # `declared` holds only refs with a declaration
        if deco.method != method:
            raise ValueError(
                f"data[{i}].decontamination.method is {deco.method!r}, which this backend cannot "
                f"honour: data prep decontaminates by {method} overlap (stages.data_prep."
                "decontamination_ngram sets n)."
            )
        unknown = [name for name in deco.against if name not in evals]
        if unknown:
            raise ValueError(
                f"data[{i}].decontamination.against names {unknown}, which are not eval refs of this "
                "manifest: data prep can only decontaminate against eval data it has."
            )
    return prep

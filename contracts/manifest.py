"""The reviewed training manifest: what a person asked to train, bound by its SHA-256 digest.

Decoded strictly from the exact bytes that were hashed; unknown fields are rejected.

Schema evolution: every field added after the first release has a default, so a manifest written
before it still decodes to the same run. `stages` and the per-recipe sections of `post_training`
were added by the staged trainer; without them a run is pretrain (plus the recipe) as before.
"""

import enum
from typing import Annotated, Literal

import msgspec

from contracts.base import Contract
from contracts.booking import Fabric

Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
OpenFraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
Temperature = Annotated[float, msgspec.Meta(gt=0, le=10)]
Count = Annotated[int, msgspec.Meta(ge=1, le=100_000)]
Usd = Annotated[float, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
RefNames = Annotated[list[Name], msgspec.Meta(max_length=64)]  # names of the manifest's data refs
# Bounds on the work one manifest can cause (issue 39: 100,000 empty data entries in ~300 KB took
# 11-27 s to refuse): a manifest is read, checked and planned on every plan, confirm and train.
MAX_DATA_REFS = 256  # data refs in one manifest; real ones name a handful of sources
MAX_LIST = 64  # any other list of names in a manifest (suites checked against, recipe stages)


class ModelSize(enum.StrEnum):
    tiny = "tiny"  # tests and demos on CPU
    m150 = "150M"
    b1 = "1B"
    b8 = "8B"
    b70 = "70B"


class ModelSpec(Contract, frozen=True, kw_only=True):
    """Either a size from the table (a from-scratch run) or a base model from the model store.

    A base model is named by `base` and pinned by `revision`, its content digest ("sha256:<hex>",
    as `ecc ito models` lists it): a store whose copy does not have that digest refuses the run.
    For a from-scratch run `revision` is a free label."""

    size: ModelSize | None = None  # exactly one of size and base
    revision: str
    base: Name | None = None  # a model store name (`ecc ito models`)
    # "bytes" (UTF-8 bytes, 256 tokens: the tiny demo's), or "sha256:<hex>" of a tokenizer.json in
    # the model store. None: the base model's own tokenizer, or bytes for a from-scratch tiny run.
    tokenizer: str | None = None


class Decontamination(Contract, frozen=True, kw_only=True):
    """Where the reference's decontamination was established, and against what."""

    method: str  # e.g. "13-gram"
    against: Annotated[list[str], msgspec.Meta(max_length=MAX_LIST)] = []  # eval suite names checked against
    provenance: str  # who/what vouched for it, e.g. "ito-training data-prep" or a report digest


class DataRole(enum.StrEnum):
    train = "train"
    eval = "eval"


class DataFormat(enum.StrEnum):
    text = "text"  # UTF-8 text, documents separated by blank lines
    jsonl = "jsonl"  # one JSON object per line, read with pyarrow
    parquet = "parquet"


class DataRef(Contract, frozen=True, kw_only=True):
    """A data source. JSONL and Parquet files are read by column, with the schemas people already
    use: `text` (next-token stages), `messages` (SFT: a list of {role, content}), `prompt` /
    `chosen` / `rejected` (DPO), `prompt` + `answer` with a named `verifier` (RLVR)."""

    name: str
    # "builtin:pydoc_topics", "generated:arithmetic"; your own data: "upload:file-<id>" (or
    # "upload:sha256:<hex>"), "s3://bucket/key" with `connection`, or "file:/abs/path" under your
    # account's file root where the operator configured one (domain/data_refs.py)
    source: str
    role: DataRole = DataRole.train
    decontamination: Decontamination | None = None
    format: DataFormat | None = None  # None: from the file's suffix (.jsonl, .parquet), else text
    digest: str | None = None  # "sha256:<hex>" of the file's bytes: required for jsonl and parquet
    # RLVR rows: exact, number, math, choice or regex (training/data/verifiers.py)
    verifier: str | None = None
    # An s3:// source's named connection (`ecc ito connections`): the credential stays the backend's.
    connection: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


class Target(Contract, frozen=True, kw_only=True):
    """How much to train: tokens D and the shape of a step."""

    tokens: Positive
    seq_len: Positive = 64
    batch_size: Positive = 16
    learning_rate: PositiveFloat = 3e-3
    # PaLM's z-loss: adds z_loss * mean((log Z)^2) to the next-token loss of pretrain, midtrain and
    # long_context, which keeps the softmax normaliser near 1 in long bf16 runs; PaLM used 1e-4.
    # Post-training losses do not use it. Held-out loss is reported without it. 0 = off.
    z_loss: NonNegativeFloat = 0.0


class Gate(Contract, frozen=True, kw_only=True):
    """Thresholds on a stage's fixed eval battery (held-out loss on the eval suites, exact-match
    accuracy on the verifiable eval suites). None: measured and reported, not gated. A failed gate
    ends the run in `gate_failed`; nothing overrides it."""

    max_held_out_loss: PositiveFloat | None = None  # passes when held-out loss <= this (nats/byte)
    min_task_accuracy: Fraction | None = None  # passes when verifiable-task accuracy >= this
    task_samples: Count = 64  # problems of the eval suites decoded greedily; more = steadier, slower


class LongContextGate(Contract, frozen=True, kw_only=True):
    """The long-context battery: the common two, short-context loss recovered and needle retrieval."""

    max_held_out_loss: PositiveFloat | None = None  # at the stage's long seq_len
    min_task_accuracy: Fraction | None = None
    task_samples: Count = 64
    # Short-context held-out loss after the stage may exceed the incoming model's by at most this.
    max_short_loss_increase: NonNegativeFloat | None = 0.25
    min_needle_accuracy: Fraction | None = None  # synthetic key retrieval at random depths
    needle_trials: Count = 32


class DataPrepStage(Contract, frozen=True, kw_only=True):
    """Exact dedup, near-duplicate removal (MinHash-LSH) and decontamination of every training ref."""

    exact_dedup: bool = True
    near_dedup: bool = True
    near_dup_jaccard: OpenFraction = 0.8  # documents at or above this estimated Jaccard are duplicates
    minhash_permutations: Annotated[int, msgspec.Meta(ge=8, le=1024)] = 112
    minhash_bands: Annotated[int, msgspec.Meta(ge=1, le=1024)] = (
        14  # 14 bands x 8 rows: candidates from J ~0.72
    )
    shingle_words: Annotated[int, msgspec.Meta(ge=1, le=32)] = 5
    decontamination_ngram: Annotated[int, msgspec.Meta(ge=4, le=64)] = 13


class LadderStage(Contract, frozen=True, kw_only=True):
    """The pre-check for custom data (your own: upload:, s3://, file:): two short proxy runs, reference mix vs reference mix
    plus the custom data, compared on the run's held-out eval; the custom data is used only if it
    does not make held-out loss worse by more than `max_loss_regression`."""

    proxy_steps: Positive = 50
    max_budget_fraction: OpenFraction = 0.05  # both proxy runs together, of the pre-training steps
    max_loss_regression: NonNegativeFloat = 0.0


class PretrainStage(Contract, frozen=True, kw_only=True):
    """Trains on `target.tokens` less what midtrain and long_context take out of it."""

    data: RefNames = []  # names of training refs; [] = every training ref
    gate: Gate = Gate()


class MidtrainStage(Contract, frozen=True, kw_only=True):
    """A higher-quality mix with the learning rate annealed linearly to zero."""

    tokens: Positive  # taken out of target.tokens
    data: RefNames = []
    learning_rate: PositiveFloat | None = None  # None: target.learning_rate x 0.1 (where pretrain ended)
    seq_len: Positive | None = None  # None: target.seq_len
    gate: Gate = Gate()


class LongContextStage(Contract, frozen=True, kw_only=True):
    """Longer sequences with a raised RoPE base; the model's max_seq_len grows to seq_len."""

    tokens: Positive  # taken out of target.tokens
    seq_len: Positive  # must be longer than target.seq_len
    rope_base: PositiveFloat = 500_000.0  # the Llama-3 value; the base scales with the target length
    batch_size: Positive | None = None  # None: target.batch_size
    learning_rate: PositiveFloat | None = None  # None: target.learning_rate x 0.1
    data: RefNames = []
    gate: LongContextGate = LongContextGate()


class Stages(Contract, frozen=True, kw_only=True):
    """The pre-training curriculum. Stages run in this fixed order; null (or absent) skips one.
    Post-training follows, as `post_training.recipe` lists it."""

    data_prep: DataPrepStage | None = None
    ladder: LadderStage | None = None
    pretrain: PretrainStage | None = PretrainStage()
    midtrain: MidtrainStage | None = None
    long_context: LongContextStage | None = None


class Lora(Contract, frozen=True, kw_only=True):
    """Low-rank adapters (Hu et al.): the base stays frozen and only A and B train; checkpoints hold
    the adapters alone; the export is a merged model or a PEFT adapter (`--format peft`)."""

    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    alpha: PositiveFloat = 16.0  # the update is scaled by alpha / rank
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    # Hugging Face module names; the MLP's are gate_proj, up_proj and down_proj.
    target_modules: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=16)] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


class SftStage(Contract, frozen=True, kw_only=True):
    """Supervised fine-tuning; loss on response tokens only. On the verifiable tasks, or on chat
    JSONL/Parquet (`messages`) rendered with the tokenizer's chat template, loss on the assistant's
    tokens only."""

    steps: Positive = 100
    batch_size: Positive = 32
    learning_rate: PositiveFloat = 1e-3  # tiny models; ~1e-5 for 1B+
    data: RefNames = []  # names of generated task refs; [] = every generated training ref
    gate: Gate = Gate()
    lora: Lora | None = None  # None: full fine-tuning


class DpoStage(Contract, frozen=True, kw_only=True):
    """Direct preference optimisation (sigmoid loss) against the frozen incoming model."""

    steps: Positive = 50
    batch_size: Positive = 16
    learning_rate: PositiveFloat = 1e-4
    beta: PositiveFloat = 0.1  # Rafailov et al.; higher keeps the policy closer to the reference
    data: RefNames = []
    gate: Gate = Gate()
    lora: Lora | None = None  # None: full fine-tuning


class RlvrStage(Contract, frozen=True, kw_only=True):
    """GRPO on verifiable rewards with the four DAPO changes (clip-higher, dynamic sampling,
    token-level loss, overlong shaping); rollouts come from a separate worker process."""

    steps: Positive = 20
    prompts_per_step: Positive = 8  # groups kept per step after dynamic sampling
    group_size: Annotated[int, msgspec.Meta(ge=2, le=1024)] = 8
    learning_rate: PositiveFloat = 2e-4
    eps_low: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2  # ratio clipped below at 1 - eps_low
    eps_high: Annotated[float, msgspec.Meta(gt=0)] = 0.28  # ... and above at 1 + eps_high (clip-higher)
    max_response_tokens: Positive = 16  # L_max: a response that has not ended by then scores -1
    overlong_buffer_tokens: Positive = 4  # L_cache: linear penalty over the last L_cache tokens
    max_staleness: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1  # k: older rollouts are dropped
    temperature: Temperature = 1.0
    max_sampling_rounds: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4  # dynamic-sampling refills per step
    data: RefNames = []
    gate: Gate = Gate()
    lora: Lora | None = None  # None: full fine-tuning


class PostTraining(Contract, frozen=True, kw_only=True):
    recipe: Annotated[
        list[str], msgspec.Meta(max_length=MAX_LIST)
    ] = []  # ordered subset of "sft", "dpo", "rlvr"
    sft: SftStage = SftStage()
    dpo: DpoStage = DpoStage()
    rlvr: RlvrStage = RlvrStage()


class CheckpointPolicy(Contract, frozen=True, kw_only=True):
    interval_steps: Positive = 50
    keep_last: Positive = 2
    storage: str = "local"  # "local" (the service's data dir) or an absolute path
    # A run longer than the booking's remaining window is refused (booking_window_exceeded) unless
    # this is true and a checkpoint commits inside the window: it then continues from its last
    # checkpoint on a later booking, and the plan says so.
    resumable_across_bookings: bool = False


class Resources(Contract, frozen=True, kw_only=True):
    """What the run asks of the booking; checked against the booking by the server."""

    nodes: Positive = 1
    gpus_per_node: Positive = 1
    region: str | None = None
    fabric: Fabric | None = None
    # Insist on a layout: the planner otherwise takes the cheapest communication that fits (DDP for
    # a model that fits one GPU). "fsdp2" shards even a small model, e.g. to try the sharded path.
    strategy: Literal["ddp", "fsdp2", "hsdp", "fsdp2+tp"] | None = None


class Manifest(Contract, frozen=True, kw_only=True):
    schema_version: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    name: Name
    model: ModelSpec
    data: Annotated[list[DataRef], msgspec.Meta(max_length=MAX_DATA_REFS)]
    target: Target
    post_training: PostTraining = msgspec.field(default_factory=PostTraining)
    checkpoint: CheckpointPolicy = msgspec.field(default_factory=CheckpointPolicy)
    resources: Resources = msgspec.field(default_factory=Resources)
    budget_cap_usd: Usd
    max_incremental_cost_usd: Usd = 0.0
    seed: int = 0
    stages: Stages = Stages()  # absent: pretrain only, then the post-training recipe

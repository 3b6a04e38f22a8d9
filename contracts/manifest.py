"""The reviewed training manifest: what a person asked to train, bound by its SHA-256 digest.

Decoded strictly from the exact bytes that were hashed; unknown fields are rejected.
"""

import enum
from typing import Annotated

import msgspec

from contracts.base import Contract
from contracts.booking import Fabric

Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Usd = Annotated[float, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ModelSize(enum.StrEnum):
    tiny = "tiny"  # tests and demos on CPU
    m150 = "150M"
    b1 = "1B"
    b8 = "8B"
    b70 = "70B"


class ModelSpec(Contract, kw_only=True):
    size: ModelSize
    revision: str


class Decontamination(Contract, kw_only=True):
    """Where the reference's decontamination was established, and against what."""

    method: str  # e.g. "13-gram"
    against: list[str] = []  # eval suite names checked against
    provenance: str  # who/what vouched for it, e.g. "ito-training data-prep" or a report digest


class DataRole(enum.StrEnum):
    train = "train"
    eval = "eval"


class DataRef(Contract, kw_only=True):
    name: str
    source: str  # "builtin:pydoc_topics", "generated:arithmetic", "file:/abs/path"
    role: DataRole = DataRole.train
    decontamination: Decontamination | None = None


class Target(Contract, kw_only=True):
    """How much to train: tokens D and the shape of a step."""

    tokens: Positive
    seq_len: Positive = 64
    batch_size: Positive = 16
    learning_rate: PositiveFloat = 3e-3


class PostTraining(Contract, kw_only=True):
    recipe: list[str] = []  # ordered subset of "sft", "dpo", "rlvr"


class CheckpointPolicy(Contract, kw_only=True):
    interval_steps: Positive = 50
    keep_last: Positive = 2
    storage: str = "local"  # "local" (the service's data dir) or an absolute path


class Resources(Contract, kw_only=True):
    """What the run asks of the booking; checked against the booking by the server."""

    nodes: Positive = 1
    gpus_per_node: Positive = 1
    region: str | None = None
    fabric: Fabric | None = None


class Manifest(Contract, kw_only=True):
    schema_version: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    name: Name
    model: ModelSpec
    data: list[DataRef]
    target: Target
    post_training: PostTraining = msgspec.field(default_factory=PostTraining)
    checkpoint: CheckpointPolicy = msgspec.field(default_factory=CheckpointPolicy)
    resources: Resources = msgspec.field(default_factory=Resources)
    budget_cap_usd: Usd
    max_incremental_cost_usd: Usd = 0.0
    seed: int = 0

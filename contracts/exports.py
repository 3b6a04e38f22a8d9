"""A run's trained model going out: exports of a committed checkpoint (a Hugging Face directory or a
LoRA adapter), their download in bounded chunks, and samples generated from it; with the orders the
scheduler hands the trainer for each (the trainer holds the checkpoints). What an export's files may
be, both ends check with contracts/export_files.py.
"""

import enum
from typing import Annotated

import msgspec

from contracts.api import Credential
from contracts.base import Contract, Internal
from contracts.evals import StageGate
from contracts.models import BaseModel

DOWNLOAD_CHUNK_MAX = 512 * 1024  # bytes per download chunk: well under NATS's 1 MiB payload once base64


class ExportFormat(enum.StrEnum):
    hf = "hf"  # a Hugging Face directory: safetensors, config.json, tokenizer files, model card
    peft = "peft"  # a LoRA stage's adapter alone: adapter_config.json + adapter_model.safetensors


class ExportRequest(Contract, frozen=True, kw_only=True):
    """Export a run's committed checkpoint (the last trained stage's unless `stage` names one).
    Idempotent: asking again answers the same export (pending until it is written)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    stage: str | None = None
    format: ExportFormat = ExportFormat.hf


class ExportFile(Internal, frozen=True, kw_only=True):
    path: str  # relative to the export's directory
    bytes: int
    sha256: str


class ExportView(Internal, frozen=True, kw_only=True):
    run_id: str
    stage: str
    format: ExportFormat
    state: str  # "pending", "ready" or "failed"
    export_id: str = ""  # "<stage>-<format>", what download names
    digest: str = ""  # "sha256:<hex>" over the files' sha256 lines, once ready
    files: list[ExportFile] = []
    bytes: int = 0
    step: int = 0  # the checkpoint step exported
    message: str | None = None


class DownloadRequest(Contract, frozen=True, kw_only=True):
    """One bounded chunk of one file of a ready export (resume by asking from an offset)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    export_id: str
    path: str
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    length: Annotated[int, msgspec.Meta(ge=1, le=DOWNLOAD_CHUNK_MAX)] = DOWNLOAD_CHUNK_MAX


class DownloadChunk(Internal, frozen=True, kw_only=True):
    run_id: str
    export_id: str
    path: str
    offset: int
    data: bytes
    size: int  # the whole file's size
    sha256: str  # the whole file's digest, to check once every chunk is in


class SampleRequest(Contract, frozen=True, kw_only=True):
    """Generate from a run's committed checkpoint (`ecc ito sample RUN --prompt ...`)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=8192)]
    stage: str | None = None
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=512)] = 64
    temperature: Annotated[float, msgspec.Meta(ge=0, le=10)] = 0.0  # 0: greedy
    seed: int = 0
    chat: bool = False  # render the prompt as one user message with the tokenizer's chat template


class SampleResult(Internal, frozen=True, kw_only=True):
    run_id: str
    stage: str
    step: int
    text: str  # the completion alone
    tokens: int
    truncated: bool = False  # the trainer's deadline stopped it early: `text` is the tokens so far


class ExportOrder(Internal, frozen=True, kw_only=True):
    """scheduler -> trainer: export (or report) a run's checkpoint (-> ExportView)."""

    account: str
    run_id: str
    stage: str | None
    format: ExportFormat
    manifest_digest: str
    storage: str = "local"
    # What the trainer needs to rebuild the stage's model and write its card (the scheduler's
    # stored work item and run view): the reviewed manifest, the resolved base model, the gates.
    manifest_text: str = ""
    base: BaseModel | None = None
    gates: list[StageGate] = []
    checkpoint_dir: str = ""  # informational: the trainer derives the directory from its own root


class DownloadOrder(Internal, frozen=True, kw_only=True):
    """scheduler -> trainer: one chunk of an export's file (-> DownloadChunk)."""

    account: str
    run_id: str
    export_id: str
    path: str
    offset: int
    length: int
    storage: str = "local"


class SampleOrder(Internal, frozen=True, kw_only=True):
    """scheduler -> trainer: generate from a committed checkpoint (-> SampleResult)."""

    account: str
    run_id: str
    request: SampleRequest
    storage: str = "local"
    manifest_text: str = ""  # the reviewed manifest: the stage's shape and tokenizer
    base: BaseModel | None = None  # the resolved base model (its tokenizer is in the model store)
    checkpoint_dir: str = ""  # informational: the trainer derives the directory from its own root

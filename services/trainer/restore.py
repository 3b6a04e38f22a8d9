"""A run's stage as a model again: which committed checkpoint a stage's export or sample reads,
the model built to its shape with those weights in it, and the run's tokenizer.

Shared by exports (services/trainer/exports.py) and sampling (services/trainer/sampling.py). The
stage's shape and RoPE base come from the plan (`curriculum_of(manifest, base)`, the one validation),
its weights from the stage's last committed checkpoint (a directory without its COMMITTED marker is
never read). A LoRA stage's checkpoint holds its adapters only: the model it adapts is the incoming
one (the previous stage's committed weights, or the base model from the model store), the adapters
are applied to it and then loaded. The model store is the settings' (`Settings.model_store`),
handed in as `store_root`.

The other helpers' modules (hf_load, lora, tokenizer, model_store) are imported where they are
used, so that a trainer without one of them still exports and samples what it can, and says
plainly what it cannot.
"""

import importlib
import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from contracts.errors import ErrorCode
from contracts.manifest import Lora, Manifest
from contracts.models import BaseModel
from domain.curriculum import Curriculum, LmPlan, PostPlan, curriculum_of
from runtime.messaging.codec import Refusal
from runtime.storage.checkpoint_paths import inside, run_dir, storage_root
from training.engine.checkpoint_dir import CheckpointInfo, list_checkpoints
from training.engine.checkpoint_load import load_weights
from training.model import Transformer
from training.recipes.pretrain import build_model

BYTES = "bytes"
CPU = torch.device("cpu")


class Unavailable(Exception):
    """A part this trainer does not have (a module not installed, a model store entry missing):
    the message says which, in a sentence safe to show."""


def optional(module: str, what: str) -> Any:
    """Another helper's module, or Unavailable saying what this trainer cannot do without it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unavailable(f"this trainer {what} ({module} is not installed)") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSource:
    """Where one stage's weights are, and what it takes to build its model."""

    run_id: str
    manifest: Manifest
    base: BaseModel | None
    plan: Curriculum
    stage: LmPlan | PostPlan
    checkpoint: CheckpointInfo  # the stage's last committed checkpoint, as located
    stage_dir: pathlib.Path
    incoming_dir: pathlib.Path | None  # the previous stage with a committed checkpoint, if any

    @property
    def lora(self) -> Lora | None:
        section = getattr(self.stage, "section", None)
        return getattr(section, "lora", None)


def owned_run_dir(local_root: pathlib.Path, storage: str, account: str, run_id: str) -> pathlib.Path:
    """The run's directory, derived from our own root (never taken from a message), refused when
    any link makes it another's; `export_not_found` when the run never wrote one."""
    root = storage_root(local_root, storage)
    path = run_dir(local_root, storage, account, run_id)
    if (
        not root.is_absolute()
        or "/" in account
        or "/" in run_id
        or account in ("", ".", "..")
        or run_id in ("", ".", "..")
        or path.is_symlink()
        or path.parent.is_symlink()
    ):
        raise Refusal(ErrorCode.forbidden, "the run's directory is not this run's")
    if not path.is_dir():
        raise Refusal(ErrorCode.export_not_found, "the run has no checkpoints (none yet, or cleaned up)")
    if not inside(root, path):
        raise Refusal(ErrorCode.forbidden, "the run's directory is not this run's")
    return path


def locate(
    run_dir: pathlib.Path, run_id: str, manifest: Manifest, base: BaseModel | None, stage: str | None
) -> StageSource:
    """The stage to read (`stage`, or the last stage with a committed checkpoint) and its last
    committed checkpoint; `export_not_found` when there is none."""
    try:
        plan = curriculum_of(manifest, base)
    except ValueError as exc:  # a manifest the plan accepted always plans again; say so if not
        raise Refusal(ErrorCode.export_not_found, f"the run's manifest no longer plans: {exc}") from None
    committed = {s.name: list_checkpoints(run_dir / s.name) for s in plan.stages}
    if stage is not None:
        if stage not in committed:
            listed = ", ".join(committed) or "none"
            raise Refusal(
                ErrorCode.export_not_found, f"the run has no stage {stage!r} (its stages: {listed})"
            )
        chosen = stage
    else:
        with_checkpoint = [name for name, found in committed.items() if found]
        if not with_checkpoint:
            raise Refusal(ErrorCode.export_not_found, "the run has no committed checkpoint yet")
        chosen = with_checkpoint[-1]
    if not committed[chosen]:
        raise Refusal(ErrorCode.export_not_found, f"stage {chosen} has no committed checkpoint")
    names = [s.name for s in plan.stages]
    earlier = [n for n in names[: names.index(chosen)] if committed[n]]
    return StageSource(
        run_id=run_id,
        manifest=manifest,
        base=base,
        plan=plan,
        stage=plan.stages[names.index(chosen)],
        checkpoint=committed[chosen][-1],
        stage_dir=run_dir / chosen,
        incoming_dir=_whole_weights(run_dir / earlier[-1]) if earlier else None,
    )


def store_dir(store_root: pathlib.Path, digest: str) -> pathlib.Path:
    """The model store's directory of an entry (a base model or a tokenizer), by digest."""
    store = optional("runtime.storage.model_store", "has no model store").ModelStore(store_root)
    path = pathlib.Path(store.path(digest))
    if not path.is_dir():
        raise Unavailable(f"the model store has no entry {digest}")
    return path


def _whole_weights(stage_dir: pathlib.Path) -> pathlib.Path:
    """Where a stage's whole model is: a LoRA stage's merged checkpoint (its own holds adapters
    alone), else the stage's own checkpoints."""
    merged = stage_dir / "merged"  # training/weights/lora.py MERGED_DIR
    return merged if list_checkpoints(merged) else stage_dir


def _load_incoming(model: torch.nn.Module, src: StageSource, store_root: pathlib.Path) -> None:
    """The weights a LoRA stage adapted: the previous stage's, or the base model's."""
    if src.incoming_dir is not None:
        load_weights(src.incoming_dir, model)
        return
    if src.base is None:
        return  # a from-scratch run's first stage starts from its seeded initialisation
    hf_load = optional("training.weights.hf_load", "cannot read Hugging Face weights")
    hf_load.load_hf_weights(model, store_dir(store_root, src.base.digest))


def restore_model(src: StageSource, store_root: pathlib.Path) -> tuple[Transformer, CheckpointInfo]:
    """The stage's model on the CPU in eval mode, float32, with its last committed weights (LoRA
    adapters applied and loaded over the incoming model), and the checkpoint really loaded."""
    stage = src.stage
    shape = stage.shape
    seq_len = max(shape.max_seq_len, src.manifest.target.seq_len)
    torch.manual_seed(src.manifest.seed)  # LoRA's A matrices are seeded as in training; B loads anyway
    model = build_model(shape, seq_len=seq_len, rope_base=stage.rope_base, device=CPU)
    adapters_only: dict[str, Any] = {}
    if src.lora is not None:
        lora_mod = optional("training.weights.lora", "has no LoRA support")
        _load_incoming(model, src, store_root)
        lora_mod.apply_lora(model, src.lora)
        adapters_only["model_keys"] = lora_mod.is_adapter_key  # the stage's checkpoint holds only these
    info = load_weights(src.stage_dir, model, **adapters_only)
    if info is None:  # pruned between locate and load: the run was cleaned up meanwhile
        raise Refusal(ErrorCode.export_not_found, f"stage {stage.name} has no committed checkpoint")
    model.eval()
    return model, info


# --- tokenizers ---


class ByteCodec:
    """UTF-8 bytes, as the tiny demo trains: the fallback when the tokenizer module is not
    installed, encoding as its ByteTokenizer does (eos is byte 10, the newline that ends a task
    answer); no chat rendering."""

    eos_id: int | None = 10

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def tokenizer_spec(src: StageSource) -> str | None:
    """The manifest's tokenizer ("bytes", a store digest), or None: the base model's own."""
    spec = src.manifest.model.tokenizer
    if spec is None and src.base is None:
        return BYTES
    return spec


def load_run_tokenizer(src: StageSource, store_root: pathlib.Path) -> Any:
    """The run's tokenizer (training.data.tokenizer.load_tokenizer); bytes without the module."""
    spec = tokenizer_spec(src)
    try:
        tok = optional("training.data.tokenizer", "has no tokenizers")
    except Unavailable:
        if spec == BYTES:
            return ByteCodec()
        raise
    model_dir = store_dir(store_root, src.base.digest) if src.base is not None and spec is None else None
    return tok.load_tokenizer(spec, model_dir, store_root)


def tokenizer_files(src: StageSource, store_root: pathlib.Path) -> dict[str, bytes]:
    """The tokenizer files an export carries: the base model's, the store's tokenizer, or the
    byte tokenizer's (a tokenizer.json that transformers loads and that encodes as bytes)."""
    tok = optional("training.data.tokenizer", "cannot write tokenizer files")
    spec = tokenizer_spec(src)
    if spec == BYTES:
        return dict(tok.byte_tokenizer_files())
    if (
        spec is not None
    ):  # a tokenizer entry of the store: `<store>/tokenizers/<hex>/` (load_tokenizer's rule)
        return dict(tok.tokenizer_files(store_root / "tokenizers" / spec.removeprefix("sha256:")))
    if src.base is None:
        raise Unavailable("the run names no tokenizer")
    return dict(tok.tokenizer_files(store_dir(store_root, src.base.digest)))


def eos_id_of(tokenizer: Any) -> int | None:
    for name in ("eos_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return None


Loader = Callable[[StageSource, pathlib.Path], tuple[Transformer, CheckpointInfo]]
"""How a stage's model is restored from the model store's root (`restore_model`; tests inject their own)."""

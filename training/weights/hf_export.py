"""A trained model as a Hugging Face directory that `transformers.AutoModelForCausalLM
.from_pretrained` loads with the trainer's logits: safetensors weights (one file, or shards with
`model.safetensors.index.json` as transformers writes them), `config.json`, `generation_config.json`,
the tokenizer files, and a README.md model card that says where the model came from (run, manifest
digest, stage and step, base model, data digests, gate verdicts).

Every file is written 0600 into a fresh temporary directory (0700), then renamed into place: a
reader never sees a half-written file, and a failed export leaves nothing behind. When the
target directory does not exist yet it appears whole, in one rename.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from contracts.exports import ExportFile
from contracts.models import ModelShape
from domain.model_shapes import FAMILIES, count_parameters, family_of, hf_config_from_shape
from training.weights.hf_adapter import hf_tensor_shapes, to_hf

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB"); lower for slow links
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
CARD_FILE = "README.md"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HASH_CHUNK = 1 << 20


@dataclass
class ModelCard:
    """What the model card (README.md) says about the exported model."""

    run_id: str
    manifest_digest: str
    stage: str
    step: int
    base_model: str | None = None  # the model store's name; None: trained from scratch
    base_digest: str | None = None
    data: dict[str, str] = field(default_factory=dict)  # data ref name -> digest (or source)
    gates: list[tuple[str, bool, str]] = field(default_factory=list)  # (stage, passed, one-line verdict)


def _reserved(name: str) -> bool:
    return name in (CONFIG_FILE, GENERATION_FILE, CARD_FILE, INDEX_FILE) or (
        name.startswith("model") and name.endswith(".safetensors")
    )


def _check_tokenizer_names(files: Mapping[str, bytes]) -> None:
    for name in files:
        if not name or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
            raise ValueError(f"The tokenizer file name {name!r} is not a plain file name.")
        if _reserved(name):
            raise ValueError(f"The tokenizer file {name} would overwrite the export's own {name}.")


def hf_state_for_export(state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """`state` (our names, full tensors) in Hugging Face's names, checked against the shape: every
    tensor there and of its shape, ValueError (a sentence naming the tensor) otherwise."""
    hf = to_hf(state, shape)
    expected = hf_tensor_shapes(shape)
    for name, want in expected.items():
        if name not in hf:
            raise ValueError(f"The state to export has no tensor for {name}.")
        t = hf[name]
        if isinstance(t, DTensor) or t.is_meta:
            raise ValueError(
                f"The state's {name} is a {type(t).__name__}; export full tensors "
                "(get_model_state_dict(..., full_state_dict=True) under FSDP2)."
            )
        if tuple(t.shape) != want:
            raise ValueError(
                f"The state's {name} has shape {list(t.shape)}, but the shape needs {list(want)}."
            )
    return hf


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `max_shard_bytes` (a tensor larger than
    that gets a shard of its own), as huggingface_hub's split_torch_state_dict_into_shards does."""
    if max_shard_bytes < 1:
        raise ValueError("max_shard_bytes needs to be at least 1 byte.")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def _private_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _export_tensor(t: torch.Tensor, dtype: torch.dtype, seen: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor of `dtype` with storage of its own (safetensors refuses two
    names on one storage, e.g. an embedding tied by the caller but exported untied)."""
    out = t.detach().to("cpu", dtype).contiguous()
    storage = out.untyped_storage()
    if storage.data_ptr() in seen or storage.nbytes() != out.numel() * out.element_size():
        out = out.clone()
    seen.add(out.untyped_storage().data_ptr())
    return out


def _write_weights(
    hf: dict[str, torch.Tensor], tmp: Path, dtype: torch.dtype, max_shard_bytes: int, parameters: int
) -> None:
    element = torch.empty((), dtype=dtype).element_size()
    sizes = {name: t.numel() * element for name, t in hf.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        seen: set[int] = set()
        tensors = {name: _export_tensor(hf[name], dtype, seen) for name in shard}  # one shard in memory
        save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
        os.chmod(tmp / file_name, 0o600)
        weight_map |= dict.fromkeys(shard, file_name)
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": parameters, "total_size": sum(sizes.values())},
            "weight_map": weight_map,
        }
        _private_file(tmp / INDEX_FILE, _json_bytes(index))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def model_card_text(card: ModelCard | None, shape: ModelShape, family: str, dtype: torch.dtype) -> str:
    """README.md: YAML front matter (library_name, base_model when known, tags) and provenance."""
    front = ["---", "library_name: transformers"]
    if card is not None and card.base_model:
        front.append(f"base_model: {json.dumps(card.base_model)}")  # a JSON string is a YAML string
    front += ["tags:", "- ito-training", "---", ""]
    params = count_parameters(shape)
    arch = f"{FAMILIES[family]}, {params:,} parameters, {DTYPE_NAMES[dtype]} weights"
    if card is None:
        return "\n".join([*front, "# Model trained with ito-training", "", f"- Architecture: {arch}", ""])
    lines = [
        f"# {_one_line(card.run_id)}: {_one_line(card.stage)} at step {card.step}",
        "",
        "Trained with ito-training. Load it with `transformers.AutoModelForCausalLM.from_pretrained`.",
        "",
        f"- Run: `{_one_line(card.run_id)}`",
        f"- Manifest digest: `{_one_line(card.manifest_digest)}`",
        f"- Stage: {_one_line(card.stage)}, step {card.step}",
    ]
    if card.base_model:
        digest = f" (`{_one_line(card.base_digest)}`)" if card.base_digest else ""
        lines.append(f"- Base model: {_one_line(card.base_model)}{digest}")
    else:
        lines.append("- Base model: none (trained from scratch)")
    lines += [f"- Architecture: {arch}", "", "## Data", ""]
    lines += [f"- {_one_line(name)}: `{_one_line(ref)}`" for name, ref in sorted(card.data.items())] or [
        "- none"
    ]
    lines += ["", "## Gates", ""]
    lines += [
        f"- {_one_line(stage)}: {'passed' if passed else 'failed'}: {_one_line(verdict)}"
        for stage, passed, verdict in card.gates
    ] or ["- none"]
    return "\n".join([*front, *lines, ""])


def _describe(directory: Path, name: str) -> ExportFile:
    h = hashlib.sha256()
    size = 0
    with open(directory / name, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())  # on disk before it is renamed into place
    return ExportFile(path=name, bytes=size, sha256=h.hexdigest())


def _move_into_place(tmp: Path, out_dir: Path, names: list[str]) -> None:
    if not out_dir.exists():
        os.rename(tmp, out_dir)  # the whole directory at once
        return
    for name in names:
        os.replace(tmp / name, out_dir / name)  # each file at once (the caller's record commits the set)
    tmp.rmdir()


def write_hf_export(
    state: Mapping[str, torch.Tensor],
    shape: ModelShape,
    out_dir: Path,
    *,
    family: str | None = None,
    tokenizer_files: Mapping[str, bytes] = {},  # read only, never mutated: the shared default is safe
    card: ModelCard | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    eos_token_id: int | None = None,
) -> list[ExportFile]:
    """Write `state` (our names, full CPU tensors) as a Hugging Face directory `out_dir` of
    `family` (None: `family_of(shape)`, the family that reproduces the shape). Returns every file
    written, with its size and SHA-256 (hex), sorted by path. Files already in `out_dir` under
    other names are left alone; files of the same names are replaced."""
    out_dir = Path(out_dir)
    family = family or family_of(shape)
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; the trainer exports {', '.join(FAMILIES)}.")
    if family != family_of(shape):
        raise ValueError(
            f"A {family} model cannot reproduce this shape (QK-norm {shape.qk_norm}, attention biases "
            f"{shape.attention_bias}); it exports as {family_of(shape)}."
        )
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"Exports are written in float32, bfloat16 or float16, not {dtype}.")
    _check_tokenizer_names(tokenizer_files)
    hf = hf_state_for_export(state, shape)
    config = hf_config_from_shape(shape, family=family, eos_token_id=eos_token_id)
    config |= {"torch_dtype": DTYPE_NAMES[dtype], "dtype": DTYPE_NAMES[dtype]}
    generation: dict[str, Any] = {"_from_model_config": True}
    if eos_token_id is not None:
        generation["eos_token_id"] = eos_token_id

    parent = out_dir if out_dir.exists() else out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=parent))  # 0700
    try:
        _write_weights(hf, tmp, dtype, max_shard_bytes, count_parameters(shape))
        _private_file(tmp / CONFIG_FILE, _json_bytes(config))
        _private_file(tmp / GENERATION_FILE, _json_bytes(generation))
        for name, data in tokenizer_files.items():
            _private_file(tmp / name, bytes(data))
        _private_file(tmp / CARD_FILE, model_card_text(card, shape, family, dtype).encode())
        names = sorted(p.name for p in tmp.iterdir())
        files = [_describe(tmp, name) for name in names]
        _move_into_place(tmp, out_dir, names)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files

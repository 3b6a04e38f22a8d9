"""Loading a Hugging Face checkpoint (safetensors, one file or shards with an index) into the
trainer's Transformer, in place.

Two ways, never a full copy of the model on every rank:
- a plain model (one process, or every rank holding the whole model): the tensors are read one at
  a time with `safetensors.safe_open` and copied into the parameters, so the peak beyond the model
  itself is one tensor;
- a model already parallelized (FSDP2 `fully_shard` on a mesh, or tensor parallel: its parameters
  are DTensors): `dcp.load` with DCP's `HuggingFaceStorageReader` on the state dict in Hugging
  Face's names, as torchtitan loads HF weights, so each rank reads only the slices its shards hold.

Before a byte of weights is read, the checkpoint's headers are checked against the model's shape:
a missing tensor, one of the wrong shape, one the model has no place for, or a non-float dtype is
refused with a ValueError sentence naming the tensor. Half-precision checkpoints (bf16, fp16) load
into fp32 parameters (the copy converts).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open
from torch import nn

from contracts.models import ModelShape
from training.weights.hf_adapter import from_hf, hf_tensor_shapes, our_name, to_hf

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names; quantized checkpoints are refused


@dataclass(frozen=True, slots=True)
class StoredTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", ...


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: the index's shards, or the one file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{INDEX_FILE} in {model_dir} is not a safetensors index ({e}).") from None
        files = [model_dir / n for n in names]
        for f in files:
            if f.parent != model_dir or not f.is_file():
                raise ValueError(f"{INDEX_FILE} in {model_dir} names a shard that is not there: {f.name}.")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}.")


def read_headers(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor's file, shape and dtype, from the safetensors headers only (no weights read)."""
    stored: dict[str, StoredTensor] = {}
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                if name in stored:
                    raise ValueError(f"The checkpoint's tensor {name} is stored twice ({file.name}).")
                stored[name] = StoredTensor(file, tuple(part.get_shape()), part.get_dtype())
    return stored


def check_checkpoint(stored: dict[str, StoredTensor], shape: ModelShape) -> None:
    """Raise ValueError (a sentence naming the tensor) unless the checkpoint holds exactly the
    tensors a model of `shape` needs, each of its shape and of a floating-point dtype."""
    expected = hf_tensor_shapes(shape)
    for name, info in stored.items():
        if our_name(name, shape) is None:  # ignorable (RoPE table, a tied model's lm_head); raises if foreign
            continue
        want = expected[name]
        if info.shape != want:
            raise ValueError(
                f"The checkpoint's tensor {name} has shape {list(info.shape)}, but the model its "
                f"config.json describes needs {list(want)}."
            )
        if info.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"The checkpoint's tensor {name} is stored as {info.dtype}; the trainer loads "
                "floating-point weights only (F32, F16, BF16), not quantized ones."
            )
    missing = [n for n in expected if n not in stored]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"The checkpoint has no tensor {missing[0]}{more}, which the model needs.")


def model_shape(model: nn.Module) -> ModelShape:
    """The shape whose checkpoint `model` loads: its own, with the embeddings tied as built."""
    shape = getattr(model, "shape", None)
    if not isinstance(shape, ModelShape):
        raise TypeError(f"load_hf_weights needs the trainer's Transformer, not {type(model).__name__}.")
    tied = bool(getattr(model, "tie_embeddings", shape.tie_embeddings))
    return msgspec.structs.replace(shape, tie_embeddings=tied)


def is_parallelized(state: dict[str, torch.Tensor]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in state.values())


@torch.no_grad()
def load_hf_weights(model: nn.Module, model_dir: Path) -> None:
    """Load the Hugging Face checkpoint in `model_dir` into `model` (the trainer's Transformer,
    plain or parallelized, on its device), in place. Collective when parallelized: every rank
    calls it. ValueError (nothing loaded) for a checkpoint that does not fit the model's shape."""
    model_dir = Path(model_dir)
    shape = model_shape(model)
    stored = read_headers(model_dir)
    check_checkpoint(stored, shape)
    state = model.state_dict()
    hf_state = to_hf(state, shape)  # the model's own tensors under HF names: loading fills them
    if is_parallelized(state):
        _load_sharded(model, hf_state, model_dir, shape, stored)
    else:
        _load_plain(hf_state, stored)


def _load_plain(hf_state: dict[str, torch.Tensor], stored: dict[str, StoredTensor]) -> None:
    by_file: dict[Path, list[str]] = {}
    for name in hf_state:
        by_file.setdefault(stored[name].file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                hf_state[name].copy_(f.get_tensor(name))  # one tensor in memory at a time


def _load_sharded(
    model: nn.Module,
    hf_state: dict[str, torch.Tensor],
    model_dir: Path,
    shape: ModelShape,
    stored: dict[str, StoredTensor],
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    # The reader takes every *.safetensors in the directory: a stray one (a consolidated copy
    # beside the shards) would be read as more chunks of the same tensors.
    used = {info.file.name for info in stored.values()}
    stray = sorted(p.name for p in model_dir.glob("*.safetensors") if p.name not in used)
    if stray:
        raise ValueError(f"{model_dir} holds safetensors files its index does not name: {', '.join(stray)}.")
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(model_dir)))
    # dcp.load filled the tensors in place; loading them back is torchtitan's way of making sure
    # every parameter (DTensor or plain) took them, and it checks that none was left out.
    model.load_state_dict(from_hf(hf_state, shape))

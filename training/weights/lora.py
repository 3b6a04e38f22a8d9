"""Low-rank adapters (LoRA, Hu et al. 2021) on our Transformer, with exactly peft's math, so an
adapter trained here loads into `peft` and a merged model is the same function as base + adapter.

`apply_lora` swaps each targeted projection (Hugging Face names: q_proj ... down_proj) for a
`LoraLinear` and freezes everything else. A `LoraLinear` *is* an `nn.Linear` that owns the base
weight itself: `blocks.{i}.attn.wq.weight` keeps its name, so the base weights load, shard and
checkpoint under the names they always had, and code that reads `wq.weight` still finds it. The
adapter adds two children, `lora_A` (rank x in, kaiming-uniform a=sqrt(5), as nn.Linear and peft
initialise it) and `lora_B` (out x rank, zeros: the adapted model starts as the base), and the
forward is peft's `base(x) + lora_B(lora_A(dropout(x))) * alpha / rank`.

Order under FSDP2: build the plain model, `apply_lora`, then `distributed.parallelize` (what
`pretrain.build_model(..., lora=)` does); the frozen base shards like any parameter, and since only
the adapters get gradients, FSDP's reduce-scatter moves only theirs. Tensor parallelism is refused
(`check_parallel`): its plans split each projection's own parameters and have no rule for an
adapter inside it. The base is then loaded into the sharded model: from a whole-model checkpoint
with `load_weights(..., model_keys=is_base_key)`, from a Hugging Face directory inside
`plain_linears` (the loader sees the plain model's names; `load_weights` does this itself).

Checkpoints of a LoRA stage hold only the adapters: `is_adapter_key` is the filter to give
`checkpoint.Checkpointer(model_keys=...)` / `load_latest(model_keys=...)`; the optimizer is made
over `trainable_parameters` alone, so its state is the adapters' too. The frozen base comes from
where the stage started (the previous stage's checkpoint or a base model), loaded with the
complement filter (`is_base_key`).

DPO's reference under LoRA is the same model with its adapters switched off (`adapters_disabled`,
or `BaseModelView` where a module is wanted), as peft's `disable_adapter()` does: the frozen base is
exactly the incoming model, so no second copy of the weights is kept. RLVR's rollout worker runs a
plain model: it is sent `merge_state_dict` of the policy's gathered state.

Exports: `merge_lora` (a plain model) or `merge_state_dict` (a full state dict, e.g. gathered from
FSDP shards) fold B @ A * scale into the base weights and give the original names back;
`write_peft_adapter` writes `adapter_config.json` and `adapter_model.safetensors` with peft's names.
"""

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.distributed.tensor import DTensor

from contracts.exports import ExportFile
from contracts.manifest import Lora
from runtime.storage.data_files import sha256_file
from training.model import Transformer, copy_whole

# Hugging Face projection names (what a manifest's target_modules and peft speak) -> ours, in the block.
HF_TARGETS: Final[dict[str, str]] = {
    "q_proj": "attn.wq",
    "k_proj": "attn.wk",
    "v_proj": "attn.wv",
    "o_proj": "attn.wo",
    "gate_proj": "mlp.w_gate",
    "up_proj": "mlp.w_up",
    "down_proj": "mlp.w_down",
}
_HF_PARENT: Final = {"attn": "self_attn", "mlp": "mlp"}
ADAPTER_CONFIG: Final = "adapter_config.json"
ADAPTER_WEIGHTS: Final = "adapter_model.safetensors"
FILE_MODE: Final = 0o600  # exports are the account's own: never readable by other users of the host
_ADAPTER_KEY = re.compile(r"\.lora_[AB]\.weight$")
_OUR_KEY = re.compile(r"^blocks\.(\d+)\.(attn|mlp)\.(\w+)\.(lora_[AB])\.weight$")


class LoraLinear(nn.Linear):
    """An `nn.Linear` holding the base weight (and bias) it replaces, frozen, plus a trainable
    low-rank update: y = x W^T + b + lora_B(lora_A(dropout(x))) * alpha / rank (peft's Linear)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)  # not nn.Linear's: the base's own weight is kept, not a new one
        self.in_features, self.out_features = base.in_features, base.out_features
        assert isinstance(base.weight, nn.Parameter), "a linear layer's weight is a Parameter"
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias if isinstance(base.bias, nn.Parameter) else None)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **like)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **like)
        self.lora_dropout: nn.Module = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        self.rank = rank
        self.scaling = alpha / rank  # peft's default (not rsLoRA's alpha / sqrt(rank))
        self.adapter_enabled = True
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # peft's init_lora_weights=True: A as nn.Linear's default, B zero (the update starts at 0).
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def reset_parameters(self) -> None:
        # nn.Linear's would re-draw the pretrained base weight; only the adapter is ever reset.
        self.reset_lora_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return result
        update = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return result + update * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """B @ A * scale, the update to the base weight (peft's get_delta_weight), in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def check_targets(target_modules: list[str]) -> list[str]:
    """Our module paths in a block ("attn.wq", ...) for Hugging Face target names; ValueError in a
    sentence naming the valid ones for any other."""
    unknown = [name for name in target_modules if name not in HF_TARGETS]
    if unknown:
        raise ValueError(
            f"LoRA cannot target {', '.join(repr(n) for n in unknown)}: the target modules are "
            f"{', '.join(HF_TARGETS)}."
        )
    return [HF_TARGETS[name] for name in dict.fromkeys(target_modules)]


def check_parallel(tp: int) -> None:
    """LoRA trains single, DDP, FSDP2 and HSDP; tensor parallelism is refused in a sentence."""
    if tp > 1:
        raise ValueError(
            "LoRA does not run with tensor parallelism (tp > 1): its plans split each projection's "
            "own weight and have no rule for the adapter inside it; use fsdp2 or hsdp."
        )


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.get_submodule("blocks").children())


def apply_lora(model: nn.Module, cfg: Lora) -> nn.Module:
    """Freeze every parameter of `model` (our Transformer, not yet parallelized) and put a trainable
    adapter on each target projection of every block, in place; returns the model. The adapters'
    A matrices are drawn from the global RNG: seed it alike on every rank first."""
    paths = check_targets(list(cfg.target_modules))
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("This model has LoRA adapters already; apply_lora once per model.")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("Apply LoRA before the model is parallelized (fully_shard), not after.")
    model.requires_grad_(False)
    for block in _blocks(model):
        for path in paths:
            parent_name, name = path.split(".")
            parent = block.get_submodule(parent_name)
            base = getattr(parent, name)
            if not isinstance(base, nn.Linear):
                raise ValueError(f"{path} is a {type(base).__name__}, not a linear layer LoRA can adapt.")
            setattr(parent, name, LoraLinear(base, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout))
    return model


@torch.no_grad()
def reset_adapters(model: nn.Module) -> None:
    """Initialise every adapter of a materialized model as `reset_lora_parameters` does (A from the
    global RNG as nn.Linear's default, B zero), each A drawn whole on its device and, when sharded,
    sliced to this rank's shard: the same adapters on any number of ranks."""
    for _, layer in lora_layers(model):
        a = layer.lora_A.weight
        full = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        copy_whole(a, full)
        layer.lora_B.weight.zero_()


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: the adapters' under LoRA, all of them otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


def is_adapter_key(key: str) -> bool:
    """Whether a model state-dict key is an adapter weight (what a LoRA checkpoint holds)."""
    return _ADAPTER_KEY.search(key) is not None


def is_base_key(key: str) -> bool:
    return not is_adapter_key(key)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole CPU copy (gathered from every rank for a DTensor: collective, every rank calls it)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True).contiguous()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights by our names ("blocks.0.attn.wq.lora_A.weight"), as whole CPU tensors.
    Under FSDP2 every rank calls it (the gather is collective)."""
    state = {}
    for name, layer in lora_layers(model):
        state[f"{name}.lora_A.weight"] = _full(layer.lora_A.weight)
        state[f"{name}.lora_B.weight"] = _full(layer.lora_B.weight)
    if not state:
        raise ValueError("This model has no LoRA adapters.")
    return state


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors (as `adapter_state_dict` gives them) into the model's adapters, in
    place; each rank keeps its own shard under FSDP2. The keys must be exactly the model's adapters."""
    params = {
        f"{name}.{part}.weight": getattr(layer, part).weight
        for name, layer in lora_layers(model)
        for part in ("lora_A", "lora_B")
    }
    if set(state) != set(params):
        missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
        raise ValueError(
            f"The adapter state does not fit this model: missing {missing[:4]}, unexpected {extra[:4]}."
        )
    for key, param in params.items():
        value = state[key]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{key} has shape {tuple(value.shape)}, the model's is {tuple(param.shape)}.")
        if isinstance(param, DTensor):
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(
                value.to(param.device, param.dtype), param.device_mesh, param.placements
            )
            param.to_local().copy_(value.to_local())
        else:
            param.copy_(value)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, `model` computes its frozen base alone (peft's `disable_adapter()`)."""
    layers = [layer for _, layer in lora_layers(model)]
    before = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield model
    finally:
        for layer, enabled in zip(layers, before, strict=True):
            layer.adapter_enabled = enabled


def _plain(layer: LoraLinear) -> nn.Linear:
    """An nn.Linear holding `layer`'s own base weight and bias (the same Parameters)."""
    plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    plain.weight = layer.weight
    plain.bias = layer.bias
    return plain


@contextmanager
def plain_linears(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, every adapted projection is a plain `nn.Linear` holding the very same base weight
    (the same Parameter, sharded or not): the model looks like one without LoRA to code that walks
    its state dict by name, such as a loader of Hugging Face weights, which fills the base in place.
    The adapters are back on exit. A no-op for a model without adapters."""
    swapped = []
    for name, layer in list(lora_layers(model)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _plain(layer))
        swapped.append((parent, child, layer))
    try:
        yield model
    finally:
        for parent, child, layer in swapped:
            setattr(parent, child, layer)


class BaseModelView(nn.Module):
    """The frozen base of a LoRA model, as a module of its own for code that wants a reference
    model (DPO's): forwards run the same (possibly sharded) model with its adapters off and no
    gradients. Holds the model outside its own parameters, so it adds nothing to any state dict."""

    _model: Transformer

    def __init__(self, model: Transformer):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: no second copy in state dicts
        self.shape = model.shape

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), adapters_disabled(self._model):
            return self._model(*args, **kwargs)


# ---- merging ----------------------------------------------------------------------------------------


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into its base weight (W += B @ A * scale, as peft's merge_and_unload) and put
    plain `nn.Linear`s back, in place: a plain Transformer whose state_dict has the original names,
    every parameter trainable again. Whole (not sharded) models only: for FSDP2, gather the full
    state dict and use `merge_state_dict`."""
    for name, layer in list(lora_layers(model)):
        if isinstance(layer.weight, DTensor):
            raise ValueError("merge_lora needs a whole model; merge a gathered state with merge_state_dict.")
        layer.weight.add_(layer.delta_weight().to(layer.weight.dtype))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _plain(layer))
    model.requires_grad_(True)
    return model


def merge_state_dict(state: Mapping[str, torch.Tensor], cfg: Lora) -> dict[str, torch.Tensor]:
    """A full model state dict with adapter keys -> the merged state under the original names (the
    adapters folded into their base weights, in the base's dtype). Pure: `state` is not changed."""
    scaling = cfg.alpha / cfg.rank
    merged = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in state:
        if key.endswith(".lora_A.weight"):
            prefix = key.removesuffix(".lora_A.weight")
            base = merged[f"{prefix}.weight"]
            a, b = state[key].float(), state[f"{prefix}.lora_B.weight"].float()
            merged[f"{prefix}.weight"] = (base.float() + (b @ a) * scaling).to(base.dtype)
    return merged


MERGED_DIR = "merged"
"""Beside a LoRA stage's own (adapter-only) checkpoints: its adapters merged into its base, as a
whole-model checkpoint; what the next stage starts from and what a restore of it reads."""


# ---- the PEFT-format export -------------------------------------------------------------------------


def peft_key(key: str) -> str:
    """Our adapter key -> peft's saved name: blocks.3.attn.wq.lora_A.weight ->
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight."""
    m = _OUR_KEY.match(key)
    ours_to_hf = {ours: hf for hf, ours in HF_TARGETS.items()}
    if m is None or f"{m[2]}.{m[3]}" not in ours_to_hf:
        raise ValueError(f"{key} is not an adapter weight of our model.")
    hf = ours_to_hf[f"{m[2]}.{m[3]}"]
    return f"base_model.model.model.layers.{m[1]}.{_HF_PARENT[m[2]]}.{hf}.{m[4]}.weight"


def adapter_config(cfg: Lora, *, base_model: str) -> dict:
    """adapter_config.json as peft's LoraConfig writes it (the fields it reads; defaults elsewhere)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(dict.fromkeys(cfg.target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, FILE_MODE)  # an existing file keeps its old mode through O_CREAT


def write_peft_adapter_state(
    state: Mapping[str, torch.Tensor], cfg: Lora, out_dir: Path, *, base_model: str
) -> list[ExportFile]:
    """Write adapter_config.json and adapter_model.safetensors (peft's names) for an adapter state
    by our names (`adapter_state_dict`) into `out_dir`; the files, sorted by path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(k): v.detach().to("cpu").contiguous() for k, v in state.items()}
    _write_private(out_dir / ADAPTER_WEIGHTS, safetensors_bytes(tensors, metadata={"format": "pt"}))
    config = json.dumps(adapter_config(cfg, base_model=base_model), indent=2, sort_keys=True) + "\n"
    _write_private(out_dir / ADAPTER_CONFIG, config.encode())
    return [
        ExportFile(path=name, bytes=(out_dir / name).stat().st_size, sha256=sha256_file(out_dir / name))
        for name in sorted((ADAPTER_CONFIG, ADAPTER_WEIGHTS))
    ]


def write_peft_adapter(model: nn.Module, cfg: Lora, out_dir: Path, *, base_model: str) -> list[ExportFile]:
    """The model's adapters as a PEFT adapter directory that `peft.PeftModel.from_pretrained` loads
    onto the Hugging Face base `base_model`. Under FSDP2 every rank must call `adapter_state_dict`
    (collective); write with `write_peft_adapter_state` on rank 0 alone."""
    return write_peft_adapter_state(adapter_state_dict(model), cfg, out_dir, base_model=base_model)

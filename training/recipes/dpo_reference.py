"""DPO's frozen reference model: built from the seed and the incoming weights exactly as the policy
starts, never trained, sharded like the policy (FSDP2 where the policy replicates whole) and held in
bf16 on cuda (half the memory of the fp32 copy every GPU used to hold; float32 on CPU, where the tests
compare exact numbers). training/recipes/posttrain.py's `train_dpo` builds it; its log-probs are
read in chunks there (`ReferenceLogprobs`)."""

from typing import Protocol

import torch

from contracts.models import ModelShape
from training.engine.checkpoint_load import load_weights
from training.engine.distributed import ParallelDims
from training.model import Transformer
from training.recipes.pretrain import build_model


class ReferenceSource(Protocol):
    """What the reference is built from: a post-training stage's config (posttrain.PostConfig)."""

    shape: ModelShape
    rope_base: float | None
    seed: int
    init_from: str | None


def reference_dtype(device_type: str) -> torch.dtype:
    """DPO's frozen reference is only read: bf16 on cuda (half the memory, and the forward computes
    in bf16 under autocast anyway); float32 on CPU, where the tests compare exact numbers."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def reference_dims(dims: ParallelDims) -> ParallelDims:
    """The reference's parallel dims: the policy's; under DDP (whole replicas), FSDP2 over the same
    ranks, since a reference has no gradients to all-reduce and each rank then holds a shard."""
    if dims.strategy == "ddp":
        return ParallelDims(strategy="fsdp2", dp_shard=dims.world_size)
    return dims


def frozen_reference(
    cfg: ReferenceSource, dims: ParallelDims, seq_len: int, device: torch.device
) -> Transformer:
    """DPO's reference: built the same way whether the stage starts or resumes (the seed's init, then
    the incoming weights), frozen; sharded like the policy (FSDP2 per block, no optimizer) and cast
    to `reference_dtype` (the RoPE tables stay float32)."""
    torch.manual_seed(cfg.seed)
    reference = build_model(
        cfg.shape,
        seq_len=seq_len,
        rope_base=cfg.rope_base,
        device=device,
        parallel=reference_dims(dims),
    )
    if cfg.init_from is not None:
        load_weights(cfg.init_from, reference)
    reference.cast_parameters(reference_dtype(device.type))
    reference.eval().requires_grad_(False)
    return reference

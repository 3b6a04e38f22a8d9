"""What one GPU holds while it trains, from measured figures, and the micro-batch that fits: pure.

The figures are bench/memory_model.py's (`memory_calibration.json` beside this module, read once
by `load`): per device kind and dtype, the activations backward keeps per token per layer as
coefficients of the model's widths under each activation-checkpointing policy, what the head and its
loss add per token per vocabulary entry, and the state per parameter. On a GPU the planner assumes
the trainer's CUDA defaults: bf16 compute, compiled blocks ("cuda-bf16").

One GPU's bytes at a micro-batch of `m` sequences of `T` tokens (tokens = m x T):
- state: weights and Adam's moments (always held) and gradients, sharded by FSDP and TP, plus
  the block FSDP holds unsharded while it runs (stated, not measured);
- activations: n_layer x (bytes per token per layer under the policy) x tokens / TP, plus one
  block's full activations while backward recomputes it (full checkpointing), times the compiled
  ratio for compiled blocks;
- logits: bytes per token per vocabulary entry x vocabulary x tokens (not sharded: the trainer
  has no loss-parallel head);
- total: weights and moments + max(gradients, activations + logits), since backward frees the
  activations as it writes the gradients. Against the CPU step's measured peak (2 cores, fp32,
  tiny and a d256 4-layer shape, micro-batches 1-8): 0.95-0.99x without checkpointing, 0.88-0.98x
  selective, 0.88-1.23x full (over for many sequences: the recompute and the logits do not peak
  together).

`pick` chooses the policy ("none" first, then "selective", then "full": recomputing costs compute)
and within it the largest micro-batch dividing the per-rank batch that fits the GPU's memory less
`MARGIN`; gradient accumulation makes up the rest of the batch. Nothing fitting even at
micro-batch 1 under full checkpointing is a refusal sentence that names the figures.
"""

import json
import pathlib
from dataclasses import dataclass

from contracts.models import ModelShape
from contracts.plans import MemoryPlan
from domain.model_shapes import head_dim

CALIBRATION_PATH = pathlib.Path(__file__).with_name("memory_calibration.json")
POLICIES = ("none", "selective", "full")  # cheapest compute first
MARGIN = 0.10  # of the GPU's memory left free: the caching allocator, NCCL buffers, fragmentation
# FSDP's unsharded copies of a block while it runs: this block's bf16 weights and the next one's
# (prefetched), and this block's gradient in fp32 before its reduce-scatter. Stated, not measured.
FSDP_GATHER_BYTES_PER_LAYER_PARAM = 2.0 + 2.0 + 4.0
GPU_KIND = "cuda-bf16"  # the trainer's CUDA defaults: bf16 autocast, compiled blocks


@dataclass(frozen=True, slots=True)
class Calibration:
    kind: str  # "cpu-fp32", "cuda-bf16"
    basis: str  # what the figures come from, as the plan prints it
    activations: dict[str, dict[str, float]]  # policy -> width -> bytes per token per layer per unit
    logits_per_vocab: float  # bytes per token per vocabulary entry
    state_per_param: dict[str, float]  # weights, grads, moments
    compiled_ratio: float  # compiled blocks' activations over eager ones


@dataclass(frozen=True, slots=True)
class State:
    """One GPU's share of the training state: what stays all step, and the gradients."""

    held: float  # weights and optimizer moments
    grads: float


@dataclass(frozen=True, slots=True)
class Fit:
    micro_batch_size: int
    grad_accumulation: int
    activation_checkpointing: str
    memory: MemoryPlan


def load(path: pathlib.Path = CALIBRATION_PATH) -> dict[str, Calibration]:
    raw = json.loads(path.read_text())
    stamp = f"{raw.get('measured', '?')} on {raw.get('machine', '?')}"
    return {
        kind: Calibration(
            kind=kind,
            basis=f"{kind}: {v['basis']} ({stamp})",
            activations=v["activations"],
            logits_per_vocab=v["logits_per_vocab"],
            state_per_param=v["state_per_param"],
            compiled_ratio=v["compiled_ratio"],
        )
        for kind, v in raw["kinds"].items()
    }


def layer_bytes(cal: Calibration, shape: ModelShape, policy: str) -> float:
    """Bytes backward keeps per token per layer under `policy` (eager)."""
    c, hd = cal.activations[policy], head_dim(shape)
    return (
        c["d_model"] * shape.d_model
        + c["d_ff"] * shape.d_ff
        + c["q_dim"] * shape.n_head * hd
        + c["kv_dim"] * shape.n_kv_head * hd
    )


def activation_bytes(
    cal: Calibration, shape: ModelShape, policy: str, tokens: int, *, tp: int = 1, compiled: bool = False
) -> float:
    """One micro-batch's kept activations; under full checkpointing, plus the one block backward
    recomputes at a time (under selective, the blocks above a recomputed one are freed by then)."""
    per_token = shape.n_layer * layer_bytes(cal, shape, policy)
    if policy == "full":
        per_token += layer_bytes(cal, shape, "none")
    return per_token * tokens * (cal.compiled_ratio if compiled else 1.0) / tp


def logits_bytes(cal: Calibration, shape: ModelShape, tokens: int) -> float:
    return cal.logits_per_vocab * shape.vocab_size * tokens


def state(
    cal: Calibration, trainable: int, frozen: int = 0, *, frozen_bytes: float = 2.0, shard: int = 1
) -> State:
    """One GPU's state: trainable parameters with their gradients and moments, frozen ones (a LoRA
    stage's base, bf16) as weights alone, over `shard` GPUs (FSDP x TP)."""
    per = cal.state_per_param
    held = trainable * (per["weights"] + per["moments"]) + frozen * frozen_bytes
    return State(held=held / shard, grads=trainable * per["grads"] / shard)


def worst_state(
    cal: Calibration, stages: list[tuple[int, int]], frozen_bytes: float, shard: int, gathered: float = 0.0
) -> State:
    """The most demanding stage's state of (trained, frozen) parameters per stage, plus `gathered`
    bytes FSDP holds unsharded (`gathered_bytes`)."""
    states = [state(cal, t, f, frozen_bytes=frozen_bytes, shard=shard) for t, f in stages]
    worst = max(states, key=lambda s: s.held + s.grads)
    return State(held=worst.held + gathered, grads=worst.grads)


def gathered_bytes(shape: ModelShape, params: int, *, shard: int, tp: int = 1) -> float:
    """What FSDP gathers while a block runs (FSDP_GATHER_BYTES_PER_LAYER_PARAM per parameter of one
    block, TP-sharded); nothing unsharded (shard 1)."""
    if shard <= 1:
        return 0.0
    heads = shape.vocab_size * shape.d_model * (1 if shape.tie_embeddings else 2) + shape.d_model
    return (params - heads) / shape.n_layer * FSDP_GATHER_BYTES_PER_LAYER_PARAM / tp


def estimate(
    cal: Calibration,
    shape: ModelShape,
    st: State,
    *,
    micro_batch: int,
    seq_len: int,
    policy: str,
    gpu_bytes: float,
    margin: float = MARGIN,
    tp: int = 1,
    compiled: bool = False,
) -> MemoryPlan:
    tokens = micro_batch * seq_len
    act = activation_bytes(cal, shape, policy, tokens, tp=tp, compiled=compiled)
    logits = logits_bytes(cal, shape, tokens)
    return MemoryPlan(
        state_bytes=st.held + st.grads,
        activation_bytes=act,
        logits_bytes=logits,
        total_bytes=st.held + max(st.grads, act + logits),
        usable_bytes=gpu_bytes * (1.0 - margin),
        margin=margin,
        basis=cal.basis + (", compiled blocks" if compiled else ", eager blocks"),
    )


# Sequences per rank in one forward: past this a GPU gains nothing, and the search for a micro-batch
# stays bounded in work whatever batch_size a manifest asks for (it has no upper bound).
MAX_MICRO_BATCH = 1024


def divisors(n: int, at_most: int = MAX_MICRO_BATCH) -> list[int]:
    """n's divisors up to `at_most`, largest first."""
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def pick(
    cal: Calibration,
    shape: ModelShape,
    st: State,
    *,
    per_rank_batch: int,
    seq_len: int,
    gpu_bytes: float,
    margin: float = MARGIN,
    tp: int = 1,
    compiled: bool = False,
) -> Fit | str:
    """The cheapest policy, and within it the largest micro-batch, that fits; else why not."""
    kw = dict(seq_len=seq_len, gpu_bytes=gpu_bytes, margin=margin, tp=tp, compiled=compiled)
    for policy in POLICIES:
        for micro in divisors(max(per_rank_batch, 1)):
            mem = estimate(cal, shape, st, micro_batch=micro, policy=policy, **kw)  # type: ignore[arg-type]
            if mem.total_bytes <= mem.usable_bytes:
                return Fit(micro, max(per_rank_batch, 1) // micro, policy, mem)
    least = estimate(cal, shape, st, micro_batch=1, policy="full", **kw)  # type: ignore[arg-type]
    return refusal(least, gpu_bytes)


def layout_fit(
    cal: Calibration,
    shape: ModelShape,
    stages: list[tuple[int, int]],
    frozen_bytes: float,
    *,
    ranks: int,
    batch_size: int,
    seq_len: int,
    gpu_bytes: float,
    shard: int,
    tp: int,
) -> Fit | str:
    """`pick` for one layout of the trainer's CUDA defaults (compiled blocks): the state of the most
    demanding stage's (trained, frozen) parameters over shard x TP, and the global batch of
    `batch_size` sequences over `ranks` data-parallel ranks (rounded up, as the trainer splits it)."""
    params = max(t + f for t, f in stages)
    st = worst_state(cal, stages, frozen_bytes, shard * tp, gathered_bytes(shape, params, shard=shard, tp=tp))
    per_rank = -(-batch_size // ranks)
    return pick(
        cal, shape, st, per_rank_batch=per_rank, seq_len=seq_len, gpu_bytes=gpu_bytes, tp=tp, compiled=True
    )


def refusal(m: MemoryPlan, gpu_bytes: float) -> str:
    """The sentence a plan that fits nowhere prints: the smallest estimate, by part, against the GPU."""
    return (
        f"even at micro-batch 1 with full activation checkpointing one GPU needs ~{m.total_bytes / 1e9:.1f} GB "
        f"(state {m.state_bytes / 1e9:.1f} GB, activations {m.activation_bytes / 1e9:.1f} GB, "
        f"logits {m.logits_bytes / 1e9:.1f} GB); {gpu_bytes / 1e9:.0f} GB less a {m.margin:.0%} margin "
        f"leaves {m.usable_bytes / 1e9:.1f} GB"
    )


def sentence(fit: Fit) -> str:
    """The memory figures the `parallelism` check prints beside the layout."""
    m = fit.memory
    return (
        f"~{m.total_bytes / 1e9:.2f} GB per GPU of {m.usable_bytes / 1e9:.1f} GB usable "
        f"(state {m.state_bytes / 1e9:.2f}, activations {m.activation_bytes / 1e9:.2f}, "
        f"logits {m.logits_bytes / 1e9:.2f} GB), micro-batch {fit.micro_batch_size} x "
        f"{fit.grad_accumulation} accumulation, activation checkpointing {fit.activation_checkpointing}"
    )

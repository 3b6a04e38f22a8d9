"""How fast a stage's step runs, with the same numbers: per-block `torch.compile`, activation
checkpointing and gradient accumulation over micro-batches. The plan picks them (its micro-batch and
activation checkpointing, from the memory model; the operator's compile switch), a stage's config
carries them as `Speed`, and `distributed.parallelize` applies them in torchtitan's order: tensor
parallel, activation checkpointing, compile, then FSDP2.

Both wrappings leave the model's state-dict keys as they were, so checkpoints, DCP save/load and
the Hugging Face export read the same names with them on or off: a checkpointed block is torch's
`CheckpointWrapper`, whose state-dict hooks drop its `_checkpoint_wrapped_module.` prefix, and a
compiled block is compiled in place (`nn.Module.compile`, as torchtitan does today), with no
`_orig_mod.` wrapper at all.
"""

from dataclasses import dataclass, replace

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from contracts.plans import Plan

AC_POLICIES = ("none", "selective", "full")
SELECTIVE_EVERY = 2  # torchtitan's per-layer selective AC ("2"): every other block recomputes


@dataclass(frozen=True, slots=True, kw_only=True)
class Speed:
    compile: bool | None = None
    """Compile each block with `torch.compile(fullgraph=True)`; None: on for cuda, off on CPU (where
    a compile costs more seconds than a short stage saves)."""
    activation_checkpointing: str = "none"
    """"none", "selective" (every other block recomputes its forward in backward) or "full" (every
    block): less activation memory for about a third more compute at "full"."""
    micro_batch: int | None = None
    """Sequences per data-parallel rank per forward and backward (DPO: pairs); the per-rank batch is
    run as per_rank_batch / micro_batch of them before one optimizer step. None: the whole per-rank
    batch at once. Lower it when a step runs out of memory."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in AC_POLICIES:
            raise ValueError(
                f"Activation checkpointing needs to be one of {', '.join(AC_POLICIES)}, "
                f"not {self.activation_checkpointing!r}."
            )
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError("A micro-batch needs to be at least 1 sequence.")


def speed_for_plan(plan: Plan, *, compile: bool | None = None) -> Speed:
    """A run's speed from its plan (micro-batch and activation checkpointing, which the memory model
    picked; a micro-batch of 0 is an older plan's: the whole per-rank batch) and the operator's
    compile switch (None: auto)."""
    return Speed(
        compile=compile,
        activation_checkpointing=plan.activation_checkpointing,
        micro_batch=plan.micro_batch_size or None,
    )


def data_parallel_of(plan: Plan, global_batch: int) -> int:
    """The slices the plan cuts the manifest's global batch into: micro-batch x accumulation x
    data-parallel ranks is that batch (the plan's own sum); 1 for a plan without a micro-batch."""
    per_rank = plan.micro_batch_size * max(1, plan.grad_accumulation)
    return max(1, global_batch // per_rank) if per_rank else 1


def fitted(speed: Speed, per_rank_batch: int) -> Speed:
    """`speed` for a stage whose rank holds `per_rank_batch` sequences: its micro-batch lowered to
    the largest divisor of that batch it does not exceed (a post-training stage has a batch of its
    own, which the plan's micro-batch, sized for the next-token stages, need not divide; never
    larger, so it still fits the memory the plan measured)."""
    if speed.micro_batch is None or per_rank_batch % speed.micro_batch == 0:
        return speed
    micro = max(d for d in range(1, min(speed.micro_batch, per_rank_batch) + 1) if per_rank_batch % d == 0)
    return replace(speed, micro_batch=micro)


def compiles(speed: Speed, device_type: str) -> bool:
    """Whether blocks are compiled on `device_type`: the stage's choice, else on for cuda alone."""
    return speed.compile if speed.compile is not None else device_type == "cuda"


def micro_steps(per_rank_batch: int, speed: Speed) -> int:
    """How many micro-batches one optimizer step runs on a rank holding `per_rank_batch` sequences;
    ValueError when the micro-batch does not divide it."""
    micro = speed.micro_batch or per_rank_batch
    if per_rank_batch % micro:
        raise ValueError(
            f"A micro-batch of {micro} sequences does not divide the per-rank batch of "
            f"{per_rank_batch}; pick a divisor of it."
        )
    return per_rank_batch // micro


def apply_activation_checkpointing(model: nn.Module, policy: str) -> None:
    """Wrap the model's blocks with torch's `checkpoint_wrapper`, each in its place in
    `model.blocks`: "full" every block, "selective" every other one (torchtitan's per-layer
    selective policy; not its per-op one), "none" none."""
    if policy not in AC_POLICIES:
        raise ValueError(f"Activation checkpointing needs to be one of {', '.join(AC_POLICIES)}.")
    if policy == "none":
        return
    blocks = model.get_submodule("blocks")
    every = 1 if policy == "full" else SELECTIVE_EVERY
    for index, (name, block) in enumerate(list(blocks.named_children())):
        if index % every == 0:
            # preserve_rng_state: the recomputed forward draws what the first one drew (no dropout
            # today; kept so that one added later recomputes the same mask).
            blocks.register_module(name, checkpoint_wrapper(block, preserve_rng_state=True))


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place with `fullgraph=True`, as torchtitan does: the blocks repeat, so
    one compiled graph serves them all, and the whole model never has to trace as one graph. The
    embedding, final norm and head stay eager."""
    for block in model.get_submodule("blocks").children():
        block.compile(fullgraph=True)


def is_compiled(block: nn.Module) -> bool:
    """Whether `block` runs compiled (`nn.Module.compile` sets its compiled call)."""
    return getattr(block, "_compiled_call_impl", None) is not None


def apply_speed(model: nn.Module, speed: Speed, device_type: str) -> None:
    """Activation checkpointing, then compile: the part of `distributed.parallelize` between tensor
    parallel and FSDP2."""
    apply_activation_checkpointing(model, speed.activation_checkpointing)
    if compiles(speed, device_type):
        apply_compile(model)

"""The trainer's own step beside a reference loop of the same shape, on the same data: the two sides
that `bench/gpu.py` (on a GPU) and `bench/trainer_steps.py` (the CPU rows of `make bench`) time.

- The trainer's side is `training.recipes.pretrain.train_stage` itself: `build_model`, the
  trainer's optimizer and schedule, `run_loop`, and the real data path (a `BatchIterator` over the
  stage's tokens, each batch pinned and copied host -> device by `_lm_step`), with whatever speed
  switches the stage config carries (`training.engine.speed.Speed` when it exists: compile on cuda).
  Steps are timed from the loop's metrics events. The stage is stopped after the timed steps with
  `save_on_stop=False`, so no checkpoint and no held-out pass fall in or after the window.
- The reference side is written here as torchtitan writes its loop, self-contained (its own model
  module, nothing from training/model.py): per-block `torch.compile`, fused AdamW, SDPA with
  `enable_gqa` (no K/V copies), bf16 autocast on cuda, fp32 cross-entropy over the logits, gradient
  clipping at 1.0, a no-op schedule; the same batches from the same `BatchIterator`, and the same
  initial weights (the trainer's, loaded by name), so both sides' first losses must agree.

Times are end-of-step timestamps; a side's step durations are their differences after the warm-up.
"""

import contextlib
import dataclasses
import itertools
import math
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from contracts.models import MODEL_SHAPES, ModelShape
from domain.model_shapes import head_dim

# The size table's shapes, and "small" (d256, 4 layers, GQA 8:2: the small CPU shape, with
# grouped K/V so that SDPA's enable_gqa and the trainer's K/V copies both show).
SHAPES: dict[str, ModelShape] = {
    **MODEL_SHAPES,
    "small": ModelShape(
        n_layer=4, d_model=256, n_head=8, n_kv_head=2, d_ff=704, vocab_size=256, max_seq_len=256
    ),
}
BENCH_SOURCE = "builtin:pydoc_topics"  # in the repository: no network; the ids fit every vocabulary
LEARNING_RATE = 3e-4


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    shape: str
    batch_size: int
    seq_len: int
    steps: int
    """Timed steps."""
    warmup: int
    """Steps before the timed window (compilation, allocator, autotuning)."""
    device: str
    compile: bool | None = None
    """Both sides: None is the trainer's default (on for cuda, off on the CPU)."""

    @property
    def compiled(self) -> bool:
        return self.device == "cuda" if self.compile is None else self.compile


@dataclass(slots=True, kw_only=True)
class Timing:
    times: list[float] = dataclasses.field(default_factory=list)
    """End-of-step timestamps (perf_counter), one per step."""
    losses: list[float] = dataclasses.field(default_factory=list)
    peak_allocated: int | None = None
    peak_reserved: int | None = None
    speed: str = ""
    """What the side ran with, in words (the trainer's Speed, or why there is none)."""

    def step_times(self, warmup: int) -> list[float]:
        window = self.times[max(warmup - 1, 0) :]
        return [b - a for a, b in itertools.pairwise(window)]


def speed_class() -> type | None:
    """`training.engine.speed.Speed` when the trainer has it (helper "speed" adds it), else None."""
    try:
        from training.engine.speed import Speed  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    return Speed


# --- the trainer's side -------------------------------------------------------------------------


def stage_config(run: Run, directory: str):
    """The stage the trainer's side runs: one step more than the bench times, stopped before it."""
    from training.recipes.pretrain import StageConfig

    total = run.warmup + run.steps
    extra: dict = {}
    speed = speed_class()
    if speed is not None and "speed" in {f.name for f in dataclasses.fields(StageConfig)}:
        extra["speed"] = speed(compile=run.compile)
    return StageConfig(
        stage="bench",
        shape=SHAPES[run.shape],
        train_sources=[BENCH_SOURCE],
        seq_len=run.seq_len,
        batch_size=run.batch_size,
        learning_rate=LEARNING_RATE,
        steps=total + 1,
        checkpoint_dir=directory,
        checkpoint_interval=total + 1,  # never inside the window; the stop below comes first
        save_on_stop=False,
        eval_max_batches=1,
        device=run.device,
        **extra,
    )


def trainer_side(run: Run) -> Timing:
    from contracts.runs import Metrics, RunEvent
    from training.engine.reporting import Reporter
    from training.recipes.pretrain import train_stage

    timing = Timing()
    total = run.warmup + run.steps

    def sink(event: RunEvent) -> None:
        if isinstance(event, Metrics):
            timing.times.append(time.perf_counter())
            timing.losses.append(event.loss)

    calls = 0

    def should_stop() -> bool:  # asked before every step: stop once `total` have run
        nonlocal calls
        calls += 1
        return calls > total

    _reset_peaks(run.device)
    with tempfile.TemporaryDirectory(prefix="ito-bench-trainer-") as directory:
        cfg = stage_config(run, directory)
        timing.speed = repr(getattr(cfg, "speed", None) or "no training.engine.speed: eager")
        train_stage(cfg, Reporter(sink), should_stop)
    timing.peak_allocated, timing.peak_reserved = _peaks(run.device)
    return timing


# --- the reference side -------------------------------------------------------------------------


class ReferenceAttention(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        hd, bias = head_dim(shape), shape.attention_bias
        self.n_head, self.n_kv_head, self.head_dim = shape.n_head, shape.n_kv_head, hd
        self.wq = nn.Linear(shape.d_model, shape.n_head * hd, bias=bias)
        self.wk = nn.Linear(shape.d_model, shape.n_kv_head * hd, bias=bias)
        self.wv = nn.Linear(shape.d_model, shape.n_kv_head * hd, bias=bias)
        self.wo = nn.Linear(shape.n_head * hd, shape.d_model, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=shape.norm_eps) if shape.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=shape.norm_eps) if shape.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # enable_gqa: SDPA reads each K/V head for its group of query heads; no repeated copies.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class ReferenceMLP(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w_gate = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w_up = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w_down = nn.Linear(shape.d_ff, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class ReferenceBlock(nn.Module):
    """A pre-norm Llama block as torchtitan writes it; parameter names as training/model.py's, so
    the trainer's weights load into it."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attn_norm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.attn = ReferenceAttention(shape)
        self.mlp_norm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.mlp = ReferenceMLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class ReferenceModel(nn.Module):
    rope_cos: torch.Tensor  # buffers, declared for the type checker
    rope_sin: torch.Tensor

    def __init__(self, shape: ModelShape, max_seq_len: int):
        super().__init__()
        if shape.rope_scaling is not None:
            raise ValueError("The reference loop has plain RoPE only; this shape scales it.")
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(ReferenceBlock(shape) for _ in range(shape.n_layer))
        self.norm = nn.RMSNorm(shape.d_model, eps=shape.norm_eps)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if shape.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        hd = head_dim(shape)
        inv_freq = 1.0 / (shape.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def reference_model(run: Run, device: torch.device) -> ReferenceModel:
    """The reference model with the trainer's initial weights (same seed, built as the trainer
    builds it, on the host), on `device`, its blocks compiled when the run compiles."""
    from training.recipes.pretrain import build_model

    shape = SHAPES[run.shape]
    torch.manual_seed(0)  # StageConfig.seed's default: the trainer's side starts from these weights
    weights = build_model(shape, seq_len=shape.max_seq_len, device=torch.device("cpu")).state_dict()
    model = ReferenceModel(shape, max(run.seq_len, shape.max_seq_len))
    model.load_state_dict(weights, strict=True)
    del weights
    model.to(device)
    if run.compiled:
        for block in model.blocks:
            block.compile()  # per block, as torchtitan: identical blocks share one graph
    return model


def reference_side(run: Run) -> Timing:
    from training.data.corpora import BatchIterator
    from training.recipes.pretrain import load_stage_data

    device = torch.device(run.device)
    cuda = device.type == "cuda"
    _reset_peaks(run.device)
    cfg = stage_config(run, "/nonexistent")  # the same data and batches as the trainer's side
    tokens, _ = load_stage_data(cfg)
    batches = BatchIterator(tokens, seq_len=run.seq_len, batch_size=run.batch_size, seed=cfg.seed)  # type: ignore[arg-type]
    model = reference_model(run, device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.95),
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    timing = Timing(speed=f"per-block compile {run.compiled}, fused AdamW, SDPA enable_gqa, autocast {cuda}")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    losses: list[torch.Tensor] = []
    for _ in range(run.warmup + run.steps):
        x, y = next(batches)
        if cuda:
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with autocast:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if cuda:  # torchtitan reads its loss only at log steps; the window starts on a drained queue
            if len(losses) == run.warmup:
                torch.cuda.synchronize()
        else:
            losses[-1].item()  # on the CPU the step is done here; reading costs nothing
        timing.times.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
        timing.times[-1] = time.perf_counter()  # the window ends when the device is done
    timing.losses = torch.stack(losses).float().tolist()
    timing.peak_allocated, timing.peak_reserved = _peaks(run.device)
    return timing


def _reset_peaks(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> tuple[int | None, int | None]:
    if device != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def window(timing: Timing, warmup: int, steps: int) -> float:
    """Mean step time over the timed window: from the end of the last warm-up step to the end of
    the last step (on cuda the trainer reads each step a step late; the window's length holds)."""
    if len(timing.times) < warmup + steps or steps < 1:
        return math.nan
    start = timing.times[warmup - 1] if warmup else timing.times[0]
    n = steps if warmup else steps - 1
    return (timing.times[warmup + steps - 1] - start) / max(n, 1)

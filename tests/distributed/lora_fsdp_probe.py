"""Run by test_lora_fsdp.py, in one process or under torchrun (FSDP2 over every rank): LoRA applied
to the tiny model before `parallelize`, one AdamW step on this rank's slice of a global batch, then
an adapter-only checkpoint saved and loaded into a fresh model. Rank 0 writes the adapters after
the step (`<out>/adapters.safetensors`), the reloaded ones (`reloaded.safetensors`) and the facts
it saw (`rank<r>.json` on every rank)."""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from contracts.manifest import Lora
from contracts.models import ModelShape
from domain.model_shapes import hf_config_from_shape
from training.engine import distributed
from training.engine.checkpoint import Checkpointer, write_merged_checkpoint
from training.engine.checkpoint_load import load_latest, load_weights
from training.engine.distributed import ParallelDims, batch_rows
from training.model import Transformer
from training.weights import lora

SHAPE = ModelShape(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=97, max_seq_len=32)
CFG = Lora(
    rank=4,
    alpha=8.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)
BATCH = 4


def build(adapter_seed: int) -> Transformer:
    """The same base on every rank (seed 0), adapters drawn from `adapter_seed`, then sharded."""
    torch.manual_seed(0)
    model = Transformer(SHAPE)
    torch.manual_seed(adapter_seed)
    lora.apply_lora(model, CFG)
    dims = ParallelDims.for_world(distributed.world_size())
    return distributed.parallelize(model, dims, distributed.build_mesh(dims, "cpu"))


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def hf_base_loads_under_the_adapters(out: Path, base: dict[str, torch.Tensor]) -> bool | None:
    """A LoRA stage starting from a base model: the adapters on and the model sharded first, then
    the Hugging Face files loaded (each rank its shards). None until the hfmodel helper's loader
    (training.weights.hf_load) is there."""
    if importlib.util.find_spec("training.weights.hf_load") is None:
        return None
    from training.weights.hf_adapter import to_hf

    hf_dir = out / "hf-base"
    if distributed.is_rank0():
        torch.manual_seed(3)
        source = Transformer(SHAPE)
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(hf_config_from_shape(SHAPE)))
        save_file(
            {k: v.contiguous() for k, v in to_hf(source.state_dict(), SHAPE).items()},
            hf_dir / "model.safetensors",
        )
        torch.save(source.state_dict(), out / "hf-source.pt")
    distributed.barrier()
    model = build(adapter_seed=1)
    adapters = lora.adapter_state_dict(model)
    load_weights(hf_dir, model, model_keys=lora.is_base_key)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    source_state = torch.load(out / "hf-source.pt")
    base_ok = all(torch.equal(whole[k], v) for k, v in source_state.items())
    adapters_ok = all(torch.equal(lora.adapter_state_dict(model)[k], v) for k, v in adapters.items())
    changed = any(not torch.equal(source_state[k], v) for k, v in base.items() if k in source_state)
    return base_ok and adapters_ok and changed


def main(out: Path) -> None:
    distributed.init("cpu")
    rank, world = distributed.rank(), distributed.world_size()
    model = build(adapter_seed=1)
    sharded = all(isinstance(p, DTensor) for p in model.parameters()) if world > 1 else None
    base_before = {n: local(p) for n, p in model.named_parameters() if not lora.is_adapter_key(n)}
    opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, SHAPE.vocab_size, (BATCH, 12), generator=gen)
    rows = batch_rows(BATCH, rank, world)
    _, loss = model(idx[rows], idx[rows])
    assert loss is not None
    loss.backward()
    frozen_grads = [
        n for n, p in model.named_parameters() if not lora.is_adapter_key(n) and p.grad is not None
    ]
    adapter_grads = [n for n, p in model.named_parameters() if lora.is_adapter_key(n) and p.grad is not None]
    opt.step()
    base_unchanged = all(
        torch.equal(local(p), base_before[n]) for n, p in model.named_parameters() if n in base_before
    )
    trained = lora.adapter_state_dict(model)  # collective: every rank
    # The merged export of a sharded model: the whole state gathered (to rank 0), then merged.
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # The DPO reference under LoRA: the same sharded model with its adapters off is the base.
    torch.manual_seed(0)
    plain = Transformer(SHAPE)
    probe = torch.randint(0, SHAPE.vocab_size, (2, 10), generator=gen)
    with torch.no_grad():
        reference = lora.BaseModelView(model)(probe)[0]
        adapted = model(probe)[0]
        reference_diff = float((reference - plain(probe)[0]).abs().max())
        adapted_diff = float((adapted - plain(probe)[0]).abs().max())

    write_merged_checkpoint(model, CFG, out / "merged-ckpt", step=1)
    merged_plain = Transformer(SHAPE)
    load_weights(out / "merged-ckpt", merged_plain)  # every rank, whole: the next stage's start
    with torch.no_grad():
        merged_diff = float((merged_plain(probe)[0] - adapted).abs().max())

    ckpt = Checkpointer(out / "ckpt", model_keys=lora.is_adapter_key)
    ckpt.save(1, model, opt)
    outcomes = ckpt.wait()
    ckpt.close()

    fresh = build(adapter_seed=5)
    fresh_opt = torch.optim.AdamW(lora.trainable_parameters(fresh), lr=1e-2)
    differs_before = any(
        not torch.equal(v, trained[k]) for k, v in lora.adapter_state_dict(fresh).items() if "lora_A" in k
    )
    resumed = load_latest(out / "ckpt", fresh, fresh_opt, model_keys=lora.is_adapter_key)
    reloaded = lora.adapter_state_dict(fresh)
    fresh_base_equal = all(
        torch.equal(local(p), base_before[n]) for n, p in fresh.named_parameters() if n in base_before
    )
    # load_adapter_state on a sharded model: each rank keeps its own shard of the whole tensors.
    third = build(adapter_seed=9)
    lora.load_adapter_state(third, trained)
    pushed = lora.adapter_state_dict(third)

    facts = {
        "world": world,
        "sharded": sharded,
        "frozen_grads": frozen_grads,
        "adapter_grads": len(adapter_grads),
        "base_unchanged": base_unchanged,
        "reference_diff": reference_diff,
        "adapted_diff": adapted_diff,
        "merged_diff": merged_diff,
        "committed": [getattr(o, "step", None) for o in outcomes],
        "differs_before": differs_before,
        "resumed_step": resumed.step if resumed else None,
        "fresh_base_equal": fresh_base_equal,
        "pushed_equal": all(torch.equal(pushed[k], v) for k, v in trained.items()),
        "optimizer_steps": [int(s["step"]) for s in fresh_opt.state_dict()["state"].values()][:1],
        "hf_base": hf_base_loads_under_the_adapters(out, {n: local(p) for n, p in model.named_parameters()}),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    if distributed.is_rank0():
        save_file(trained, out / "adapters.safetensors")
        save_file(reloaded, out / "reloaded.safetensors")
        save_file(lora.merge_state_dict(whole, CFG), out / "merged.safetensors")
        lora.write_peft_adapter_state(trained, CFG, out / "peft", base_model="tiny")
    distributed.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

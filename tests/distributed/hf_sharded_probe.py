"""Run under torchrun by test_hf_sharded_load.py: every rank loads one Hugging Face checkpoint into
a sharded Transformer and writes, to `<out>/rank<r>.json` and `<out>/logits<r>.pt`, whether each of
its local shards equals its slice of the checkpoint's tensor, and the full logits on the test's
tokens (`<out>/tokens.pt`).

"manual": built on the meta device, `fully_shard` on every block and the root over a 1-D mesh,
`materialize` (to_empty), `load_hf_weights`: the steps a caller takes. Any other strategy goes
through `pretrain.build_model(..., init_from_hf=...)` with that plan's dims."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from domain.model_shapes import shape_from_hf_config
from training.engine import distributed
from training.engine.distributed import ParallelDims
from training.model import Transformer
from training.recipes.pretrain import build_model
from training.weights.hf_adapter import hf_name
from training.weights.hf_load import checkpoint_files, load_hf_weights


def expected_local(full: torch.Tensor, p: DTensor) -> torch.Tensor:
    """The slice of `full` that rank's shard of `p` holds (1-D mesh: Shard(d) is torch.chunk's)."""
    (placement,) = p.placements
    if isinstance(placement, Replicate):
        return full
    assert isinstance(placement, Shard), placement
    coordinate = p.device_mesh.get_local_rank()
    return torch.chunk(full, p.device_mesh.size(), dim=placement.dim)[coordinate]


def main(model_dir: str, out: str, strategy: str, degrees: str) -> None:
    device = distributed.init("cpu")
    rank, world = distributed.rank(), distributed.world_size()
    directory = Path(model_dir)
    shape = shape_from_hf_config(json.loads((directory / "config.json").read_text())).shape
    if strategy == "manual":
        with torch.device("meta"):
            model = Transformer(shape)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.materialize(device)
        load_hf_weights(model, directory)
    else:
        dims = ParallelDims.from_plan(strategy, json.loads(degrees))
        model = build_model(
            shape, seq_len=shape.max_seq_len, device=device, parallel=dims, init_from_hf=directory
        )
    full: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(directory):  # the reference: small here, read whole by the probe only
        full |= load_file(f)
    report: dict = {"sharded": [], "plain": [], "mismatch": [], "local": 0, "whole": 0}
    for name, p in model.state_dict().items():
        reference = full[hf_name(name, shape) or "model.embed_tokens.weight"]
        if isinstance(p, DTensor):
            local, want = p.to_local(), expected_local(reference, p)
            report["sharded"].append(name)
        else:
            local, want = p, reference
            report["plain"].append(name)
        report["local"] += local.numel()
        report["whole"] += reference.numel()
        if not torch.equal(local, want):
            report["mismatch"].append(name)
    report["tied"] = model.lm_head.weight is model.tok_emb.weight
    tokens = torch.load(Path(out) / "tokens.pt")
    model.eval()
    with torch.no_grad():
        logits = model(tokens)[0]
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    torch.save(logits, Path(out) / f"logits{rank}.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    distributed.barrier()  # leave together: a rank tearing gloo down under a peer's last op aborts it
    distributed.close()
    # Everything this probe reports is written. Past this line only the interpreter's own teardown
    # runs, and there a rank sometimes aborted in C++ ("terminate called without an active
    # exception", no Python frame; about 1 run in 8 on 2 loaded cores, both strategies, with the
    # model freed before the group or not). A bare process group with the same imports never did
    # (0 in 40), nor has launch.rank in the gang tests; the cause is not found, and this test is about
    # what the ranks loaded, so the probe leaves without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])

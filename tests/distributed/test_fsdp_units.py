"""The process group's and FSDP2's choices as tables: NCCL's environment, the group's backend and
device, the mixed-precision policy (forward inputs never cast), and the FSDP units torchtitan cuts
(tied embeddings in one unit with the head); the units applied in a 1-rank gloo world train as the
plain model does."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from contracts.models import MODEL_SHAPES
from training.engine import distributed
from training.engine.distributed import FsdpUnit, fsdp_units, group_options, mixed_precision, nccl_env
from training.model import Transformer

pytestmark = pytest.mark.distributed

NCCL = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


@pytest.mark.parametrize(
    ("device_type", "environ", "to_set"),
    [
        ("cuda", {}, NCCL),
        ("cuda", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, {k: v for k, v in NCCL.items() if "TRACE" not in k}),
        ("cpu", {}, {}),
    ],
)
def test_nccl_env_sets_torchtitans_defaults_on_cuda_unless_the_operator_did(device_type, environ, to_set):
    assert nccl_env(device_type, environ) == to_set


@pytest.mark.parametrize(
    ("device", "options"),
    [
        (torch.device("cuda", 3), {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 3)}),
        (torch.device("cpu"), {"backend": "gloo"}),
    ],
)
def test_the_process_group_names_the_ranks_gpu_on_cuda(device, options):
    assert group_options(device) == options


@pytest.mark.parametrize(
    ("device_type", "param_dtype", "reduce_dtype"),
    [("cuda", torch.bfloat16, torch.float32), ("cpu", None, None)],
)
def test_fsdp_never_casts_forward_inputs(device_type, param_dtype, reduce_dtype):
    policy = mixed_precision(device_type)
    assert policy.cast_forward_inputs is False  # the RoPE tables stay fp32, as in one process
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)


def test_fsdp_units_are_torchtitans_embedding_blocks_head_then_root():
    model = Transformer(MODEL_SHAPES["tiny"], tie_embeddings=False)
    blocks = [FsdpUnit((f"blocks.{i}",), True) for i in range(MODEL_SHAPES["tiny"].n_layer)]
    assert fsdp_units(model) == [
        FsdpUnit(("tok_emb",), True),
        *blocks,
        FsdpUnit(("norm", "lm_head"), False),  # the last unit stays gathered for the backward
        FsdpUnit(("",), True),
    ]


def test_tied_embeddings_share_one_unit_with_the_head():
    model = Transformer(MODEL_SHAPES["tiny"], tie_embeddings=True)
    units = fsdp_units(model)
    [shared] = [u for u in units if "lm_head" in u.modules]
    assert "tok_emb" in shared.modules
    assert not any(u.modules == ("tok_emb",) for u in units)


@pytest.fixture
def one_rank_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True])
def test_the_units_shard_and_train_as_the_plain_model(one_rank_world, tied):
    torch.manual_seed(0)
    plain = Transformer(MODEL_SHAPES["tiny"], tie_embeddings=tied)
    sharded = copy.deepcopy(plain)
    distributed._apply_fsdp(sharded, one_rank_world, "cpu")
    for unit in fsdp_units(sharded):
        for name in unit.modules:
            assert isinstance(sharded.get_submodule(name), FSDPModule), name
    x = torch.randint(0, MODEL_SHAPES["tiny"].vocab_size, (2, 16))
    _, want = plain(x, x)
    _, got = sharded(x, x)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, msg=name)


def reference_clip(grads, max_norm):
    """The clip as it was: each gradient's norm made whole on its own, then a host-read coefficient."""
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g)
        squares.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0).item())
    return total


@pytest.fixture
def tp_mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    finally:
        dist.destroy_process_group()


def test_clipping_under_tp_takes_one_collective_per_mesh_and_the_old_norm(tp_mesh, monkeypatch):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    raw = [torch.randn(8, 4) * 3, torch.randn(4) * 3, torch.randn(6, 2) * 3, torch.randn(5) * 3]
    raw += [torch.randn(3) * 3, torch.randn(2) * 3]
    partial = [Replicate(), Partial()]  # a TP-replicated norm weight's gradient, its sum pending
    placements = [
        [Shard(0), Shard(1)],
        [Replicate(), Replicate()],
        [Shard(0), Replicate()],
        None,
        partial,
        partial,
    ]

    def grads():
        out = []
        for t, p in zip(raw, placements, strict=True):
            param = torch.nn.Parameter(torch.zeros_like(t))
            if p is partial:
                param.grad = DTensor.from_local(t.clone(), tp_mesh, p)
            else:
                param.grad = t.clone() if p is None else distribute_tensor(t.clone(), tp_mesh, p)
            out.append(param)
        return out

    old, new = grads(), grads()
    want = reference_clip([p.grad for p in old], 1.0)
    whole = []
    real = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **k: whole.append(1) or real(self, **k))
    got = distributed.clip_grad_norm(new, 1.0, tp=True)
    assert len(whole) == 2  # one mesh and one pending layout (it was one per DTensor gradient: 5)
    torch.testing.assert_close(got, want)
    for p, q in zip(old, new, strict=True):
        a = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        b = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize(("kinds", "fused"), [("pp", True), ("dd", True), ("dp", False), ("", True)])
def test_adamw_runs_fused_unless_sharded_and_plain_parameters_mix(tp_mesh, kinds, fused):
    from torch.distributed.tensor import Replicate, distribute_tensor

    params = [
        torch.nn.Parameter(
            distribute_tensor(torch.ones(2), tp_mesh, [Replicate(), Replicate()])
            if kind == "d"
            else torch.ones(2)
        )
        for kind in kinds
    ]
    assert distributed.adamw_fused(params) is fused

"""The pure parts of the distributed core, as tables: a plan's strategy and degrees to mesh dims,
the plans refused (and what the refusal says), each data-parallel rank's rows of a batch."""

import re

import msgspec
import pytest
import torch

from contracts.models import MODEL_SHAPES
from training.data.corpora import BatchIterator, load_tokens
from training.engine.distributed import ParallelDims, ParallelismError, batch_rows
from training.engine.reporting import Recorder, rank0_only

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("strategy", "degrees", "world", "mesh", "dp"),
    [
        ("single", {}, 1, ((), ()), 1),
        ("single", {"dp_replicate": 1}, 1, ((), ()), 1),  # the planner's own "single"
        ("ddp", {"dp_replicate": 8}, 8, ((8,), ("dp_replicate",)), 8),
        ("fsdp2", {"dp_shard": 4}, 4, ((4,), ("dp_shard",)), 4),
        ("fsdp2", {"dp_replicate": 1, "dp_shard": 8}, 8, ((8,), ("dp_shard",)), 8),  # one node
        ("hsdp", {"dp_replicate": 2, "dp_shard": 8}, 16, ((2, 8), ("dp_replicate", "dp_shard")), 16),
        ("fsdp2+tp", {"dp_shard": 4, "tp": 2}, 8, ((4, 2), ("dp_shard", "tp")), 4),
        ("fsdp2+tp", {"dp_shard": 1, "tp": 2}, 2, ((2,), ("tp",)), 1),
    ],
)
def test_mesh_from_a_plans_degrees(strategy, degrees, world, mesh, dp):
    dims = ParallelDims.from_plan(strategy, degrees)
    assert dims.world_size == world
    assert dims.mesh_dims() == mesh
    assert dims.dp_degree == dp
    dims.check_world(world)


@pytest.mark.parametrize(
    ("strategy", "degrees", "says"),
    [
        ("pipeline", {}, "does not know the strategy 'pipeline'"),
        ("fsdp2", {"cp": 2}, "degrees the trainer does not know: cp"),
        ("fsdp2", {"dp_shard": 0}, "dp_shard needs to be at least 1"),
        ("single", {"dp_shard": 2}, "single does not go with the degrees {'dp_shard': 2}"),
        ("ddp", {"dp_replicate": 2, "dp_shard": 2}, "ddp does not go with"),
        ("fsdp2", {"dp_replicate": 2, "dp_shard": 2}, "fsdp2 does not go with"),
        ("hsdp", {"dp_shard": 4}, "needs dp_replicate and dp_shard both above 1"),
        ("fsdp2+tp", {"dp_shard": 4}, "needs tp above 1"),
        ("fsdp2+tp", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "fsdp2+tp does not go with"),
    ],
)
def test_a_plan_that_contradicts_itself_is_refused(strategy, degrees, says):
    with pytest.raises(ParallelismError, match=re.escape(says)):
        ParallelDims.from_plan(strategy, degrees)


@pytest.mark.parametrize(
    ("strategy", "degrees", "world", "says"),
    [
        ("fsdp2", {"dp_shard": 4}, 2, "The plan fsdp2 {'dp_shard': 4} needs 4 ranks, but 2 were started."),
        ("ddp", {"dp_replicate": 2}, 1, "The plan ddp {'dp_replicate': 2} needs 2 ranks, but 1 was started."),
        ("single", {}, 2, "The plan single {} needs 1 rank, but 2 were started."),
        ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, 8, "needs 4 ranks, but 8 were started"),
    ],
)
def test_a_plan_the_started_ranks_cannot_realise_is_refused(strategy, degrees, world, says):
    dims = ParallelDims.from_plan(strategy, degrees)
    with pytest.raises(ParallelismError) as refused:
        dims.check_world(world)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("tp", "shape", "says"),
    [
        (2, dict(n_head=4, n_kv_head=4, d_ff=352), None),
        (4, dict(n_head=4, n_kv_head=2, d_ff=352), "tp 4 does not divide the model's n_kv_head 2"),
        (8, dict(n_head=4, n_kv_head=4, d_ff=352), "tp 8 does not divide the model's n_head 4"),
        (2, dict(n_head=4, n_kv_head=4, d_ff=351), "tp 2 does not divide the model's d_ff 351"),
    ],
)
def test_tensor_parallel_degree_must_divide_heads_and_width(tp, shape, says):
    dims = ParallelDims(strategy="fsdp2+tp", tp=tp)
    model_shape = msgspec.structs.replace(MODEL_SHAPES["tiny"], **shape)
    if says is None:
        dims.check_model(model_shape)
    else:
        with pytest.raises(ParallelismError, match=says):
            dims.check_model(model_shape)


def test_no_plan_means_one_process_or_fsdp2_over_every_rank():
    assert ParallelDims.for_world(1) == ParallelDims()
    assert ParallelDims.for_world(4) == ParallelDims(strategy="fsdp2", dp_shard=4)


@pytest.mark.parametrize(
    ("batch", "dp_rank", "dp", "rows"),
    [
        (8, 0, 1, slice(0, 8)),
        (8, 0, 2, slice(0, 4)),
        (8, 1, 2, slice(4, 8)),
        (8, 3, 4, slice(6, 8)),
        (6, 2, 3, slice(4, 6)),
    ],
)
def test_each_data_parallel_rank_gets_its_rows(batch, dp_rank, dp, rows):
    assert batch_rows(batch, dp_rank, dp) == rows


@pytest.mark.parametrize(("batch", "dp_rank", "dp"), [(8, 0, 3), (8, 2, 2), (8, -1, 2)])
def test_a_batch_that_does_not_split_is_refused(batch, dp_rank, dp):
    with pytest.raises(ParallelismError):
        batch_rows(batch, dp_rank, dp)
    if batch % dp:
        with pytest.raises(ParallelismError, match=f"global batch of {batch} does not split evenly"):
            ParallelDims(strategy="ddp", dp_replicate=dp).check_batch(batch)


@pytest.mark.parametrize(
    ("strategy", "degrees", "dp_ranks"),
    [
        ("ddp", {"dp_replicate": 2}, [0, 1]),
        ("fsdp2+tp", {"dp_shard": 2, "tp": 2}, [0, 0, 1, 1]),  # tp neighbours read the same slice
        ("hsdp", {"dp_replicate": 2, "dp_shard": 2}, [0, 1, 2, 3]),
        ("fsdp2+tp", {"dp_shard": 1, "tp": 2}, [0, 0]),
    ],
)
def test_the_slices_of_all_ranks_make_up_the_global_batch(strategy, degrees, dp_ranks):
    dims = ParallelDims.from_plan(strategy, degrees)
    assert [dims.dp_rank(r) for r in range(dims.world_size)] == dp_ranks
    tokens = load_tokens(["generated:arithmetic"], seed=0)
    whole_x, whole_y = BatchIterator(tokens, seq_len=16, batch_size=8, seed=3).batch_at(5)
    parts = {}
    for r in range(dims.world_size):
        rows = batch_rows(8, dims.dp_rank(r), dims.dp_degree)
        parts[dims.dp_rank(r)] = BatchIterator(tokens, seq_len=16, batch_size=8, seed=3, rows=rows).batch_at(
            5
        )
    assert torch.equal(torch.cat([parts[d][0] for d in sorted(parts)]), whole_x)
    assert torch.equal(torch.cat([parts[d][1] for d in sorted(parts)]), whole_y)


def test_only_rank0_reports():
    rank0, rank1 = Recorder(), Recorder()
    rank0_only(rank0, rank=0).log("hello")
    rank0_only(rank1, rank=1).log("hello")
    assert len(rank0.events) == 1
    assert rank1.events == []

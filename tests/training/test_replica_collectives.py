"""A replica group's collectives as pure choices, tables and counts: the process group per device,
the Manager's timeout sized by the gradient bytes, gradients averaged in buckets (one all-reduce per
bucket, the same averages as one per parameter), and a step's progress line without a host copy of
the model unless a test asks for it."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torchft import ProcessGroupGloo, ProcessGroupNCCL

from contracts.models import MODEL_SHAPES
from training.engine import fault_tolerance
from training.engine.fault_tolerance import (
    SLOW_BANDWIDTH_BYTES_S,
    TIMEOUT_S,
    ReplicaGroup,
    average_in_buckets,
    collective_timeout_s,
    gradient_buckets,
    replica_pg_kind,
    replica_process_group,
)
from training.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize(("device_type", "kind"), [("cuda", ProcessGroupNCCL), ("cpu", ProcessGroupGloo)])
def test_the_replica_process_group_is_nccl_on_cuda_and_gloo_on_cpu(device_type, kind):
    assert replica_pg_kind(device_type) is kind


def test_the_cpu_replica_process_group_is_built_with_the_timeout():
    assert isinstance(replica_process_group("cpu", timedelta(seconds=5)), ProcessGroupGloo)


def test_a_replica_group_on_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match="Replica groups run on cuda or cpu, not mps"):
        replica_process_group("mps", timedelta(seconds=5))


@pytest.mark.parametrize(
    ("gradient_bytes", "timeout_s"),
    [
        (0, TIMEOUT_S),  # no bytes: the least
        (10**6, 2 * 10**6 / SLOW_BANDWIDTH_BYTES_S + TIMEOUT_S),
        (4 * 10**9, 8 + TIMEOUT_S),  # a 1B model's fp32 gradients: 8 s on the wire
        (140 * 10**9, 280 + TIMEOUT_S),  # a 35B model's: minutes, not TIMEOUT_S
    ],
)
def test_the_collective_timeout_grows_with_the_gradient_bytes(gradient_bytes, timeout_s):
    assert collective_timeout_s(gradient_bytes) == pytest.approx(timeout_s)
    assert collective_timeout_s(gradient_bytes) >= TIMEOUT_S


def test_the_collective_timeout_is_never_under_the_least():
    assert collective_timeout_s(0, least_s=30.0, slack_s=1.0) == 30.0


MB = 2**20


@pytest.mark.parametrize(
    ("sizes", "dtypes", "bucket_bytes", "buckets"),
    [
        ([1, 1, 1], ["f32"] * 3, 4 * MB, [[0, 1, 2]]),
        ([1, 1, 1], ["f32"] * 3, 2 * MB, [[0, 1], [2]]),
        ([3, 1, 1], ["f32"] * 3, 2 * MB, [[0], [1, 2]]),  # a large gradient: a bucket of its own
        ([1, 1, 1, 1], ["f32", "bf16", "f32", "bf16"], 4 * MB, [[0, 2], [1, 3]]),  # one dtype a bucket
    ],
)
def test_gradients_are_bucketed_by_size_and_dtype(sizes, dtypes, bucket_bytes, buckets):
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}
    grads = [
        torch.zeros(mb * MB // dtype[d].itemsize, dtype=dtype[d]) for mb, d in zip(sizes, dtypes, strict=True)
    ]
    assert gradient_buckets(grads, bucket_bytes) == buckets


class FakeManager:
    """An elementwise 'average' (another replica's gradient is 2x + 1) that counts its calls."""

    def __init__(self):
        self.calls = 0

    def allreduce(self, tensor):
        self.calls += 1
        tensor.copy_((tensor + (2 * tensor + 1)) / 2)
        return SimpleNamespace(wait=lambda: None)


def test_bucketed_averages_equal_the_per_parameter_ones_with_one_all_reduce_per_bucket():
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES["tiny"])
    grads = [torch.randn_like(p) for p in model.parameters()]
    expected = [(g + (2 * g + 1)) / 2 for g in grads]
    bucket_bytes = 64 * 1024
    manager = FakeManager()
    average_in_buckets(manager, grads, bucket_bytes)
    assert manager.calls == len(gradient_buckets(grads, bucket_bytes)) < len(grads)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_reduce_gradients_makes_one_all_reduce_per_bucket_not_per_parameter():
    model = Transformer(MODEL_SHAPES["tiny"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    group = object.__new__(ReplicaGroup)
    group.manager = FakeManager()
    group.reduce_gradients(list(model.parameters()))
    grads = [p.grad for p in model.parameters()]
    assert group.manager.calls == len(gradient_buckets(grads)) == 1  # tiny: one bucket
    assert all(bool((g == 2).all()) for g in grads)


class Loss:
    """A loss that counts how often it is read to the host."""

    reads = 0

    def detach(self):
        return self

    def __float__(self):
        Loss.reads += 1
        return 1.0


def scripted_group(debug_checksum: bool, lines: list) -> ReplicaGroup:
    group = object.__new__(ReplicaGroup)
    group.model = Transformer(MODEL_SHAPES["tiny"])
    group.progress = lambda event, /, **fields: lines.append((event, fields))
    group.debug_checksum = debug_checksum
    group.manager = SimpleNamespace(current_step=lambda: 3, num_participants=lambda: 2, errored=lambda: None)
    return group


@pytest.mark.parametrize(("debug_checksum", "checksums", "reads"), [(False, 0, 0), (True, 1, 1)])
def test_a_step_line_copies_the_model_to_the_host_only_when_asked(
    monkeypatch, debug_checksum, checksums, reads
):
    counted = []
    real = fault_tolerance.weights_checksum
    monkeypatch.setattr(fault_tolerance, "weights_checksum", lambda m: counted.append(1) or real(m))
    Loss.reads = 0
    lines: list = []
    assert scripted_group(debug_checksum, lines).end_step(Loss(), committed=True) == 3
    assert len(counted) == checksums and Loss.reads == reads
    [(event, fields)] = lines
    assert event == "step" and fields["participants"] == 2
    assert ("checksum" in fields) is debug_checksum and ("loss" in fields) is debug_checksum

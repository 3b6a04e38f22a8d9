"""Planning (services/scheduler/planning.py) as tables: strategy, refusals, cost, budget, data policy.

The arithmetic behind each expected value uses the module's constants and desk_prices.json:
  training state = params x 16 B (BYTES_PER_PARAM_TRAINING), over the shard x TP degree, plus one
                   block FSDP gathers (8 B per parameter of a block, over TP) when sharded
  per-GPU bytes  = weights and moments + max(gradients, activations + logits) at the micro-batch
                   services/scheduler/gpu_memory.py picks from memory_calibration.json ("cuda-bf16")
  usable memory  = memory_gb x 0.9: H200 126.9 GB, H100/A100 72.0 GB, L40S 43.2 GB
  parameters     = tiny 0.468M, 150M 134.1M, 1B 1.498B, 8B 8.030B, 70B 70.554B
  state          = tiny 0.0075 GB, 150M 2.15 GB, 1B 23.98 GB, 8B 128.48 GB, 70B 1128.86 GB
  refusals, in order: multi-node ethernet -> fabric_unsupported; >1 GPU under 50M params or >1 node
  under 1B params -> plan_wasteful; no candidate fits -> capacity_insufficient. Precision is bf16
  always: the trainer has no fp8 path.
"""

import math
import pathlib
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from contracts.booking import Fabric, Topology
from contracts.errors import ErrorCode
from contracts.internal import EligibilityBody
from contracts.manifest import Manifest
from contracts.models import MODEL_SHAPES
from domain.curriculum import model_shape
from services.scheduler import planning
from services.scheduler.planning import (
    checkpoint_bytes,
    data_policy,
    first_refusal,
    parameter_count,
    plan,
)
from services.scheduler.prices import load_prices
from training.model import Transformer, count_parameters

PRICES = load_prices()
T0 = datetime(2025, 1, 1, tzinfo=UTC)
IB, ROCE, ETH = Fabric.infiniband, Fabric.roce, Fabric.ethernet
MEMORY_GB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "MI300X": 192}

GOOD_DATA = [
    {
        "name": "topics",
        "source": "builtin:pydoc_topics",
        "role": "train",
        "decontamination": {
            "method": "13-gram",
            "against": ["gsm8k"],
            "provenance": "ito-training data-prep",
        },
    }
]


def manifest(
    size="tiny",
    nodes=1,
    gpn=1,
    *,
    seq_len=64,
    tokens=1000,
    budget=1e12,
    incremental=1e12,
    data=None,
    recipe=(),
    keep_last=2,
    fabric=None,
    resumable=False,
) -> Manifest:
    doc = {
        "name": "t",
        "model": {"size": size, "revision": "r"},
        "data": GOOD_DATA if data is None else data,
        "target": {"tokens": tokens, "seq_len": seq_len},
        "post_training": {"recipe": list(recipe)},
        "checkpoint": {"keep_last": keep_last, "resumable_across_bookings": resumable},
        "resources": {"nodes": nodes, "gpus_per_node": gpn, "fabric": fabric},
        "budget_cap_usd": budget,
        "max_incremental_cost_usd": incremental,
    }
    return msgspec.convert(doc, Manifest)


def body(nodes=1, gpn=1, gpu="H200", fabric=IB, window_hours=24.0) -> EligibilityBody:
    return EligibilityBody(
        account="acct_a",
        booking_id="bk_1",
        booking_version=1,
        topology=Topology(nodes=nodes, gpus_per_node=gpn, gpu_model=gpu, gpu_memory_gb=MEMORY_GB[gpu]),
        region="eu",
        fabric=fabric,
        window_start=T0,
        window_end=T0 + timedelta(hours=window_hours),
        issued_at=T0,
        expires_at=T0 + timedelta(minutes=1),
    )


def run_plan(m: Manifest, b: EligibilityBody):
    return plan(m, "d" * 64, b, PRICES)


def code_of(p) -> str | None:
    refusal = first_refusal(p)
    return None if refusal is None else refusal[0].value


# --- parameter counts agree with the trainer's model ---


def test_parameter_count_of_tiny_equals_the_built_model():
    built = sum(p.numel() for p in Transformer(MODEL_SHAPES["tiny"]).parameters())
    assert parameter_count(MODEL_SHAPES["tiny"]) == built


@pytest.mark.parametrize("size", list(MODEL_SHAPES))
def test_parameter_count_equals_the_trainers_analytic_count(size):
    assert parameter_count(MODEL_SHAPES[size]) == count_parameters(MODEL_SHAPES[size])


@pytest.mark.parametrize(
    "size, approx",
    [("tiny", 0.468e6), ("150M", 134.1e6), ("1B", 1.498e9), ("8B", 8.030e9), ("70B", 70.55e9)],
)
def test_parameter_counts_are_the_sizes_the_table_assumes(size, approx):
    # the table below depends on these: 8B >= FP8_MIN_PARAMS, 150M < MULTI_NODE_MIN_PARAMS, tiny < SMALL_MODEL_PARAMS
    assert parameter_count(MODEL_SHAPES[size]) == pytest.approx(approx, rel=1e-3)


def test_prices_table_is_what_the_arithmetic_assumes():
    assert {g: (v.memory_gb, v.fp8) for g, v in PRICES.gpus.items()} == {
        "H200": (141, True),
        "H100": (80, True),
        "A100": (80, False),
        "L40S": (48, True),
    }
    assert (planning.USABLE_MEMORY_FRACTION, planning.BYTES_PER_PARAM_TRAINING) == (0.9, 16)
    assert (planning.SMALL_MODEL_PARAMS, planning.MULTI_NODE_MIN_PARAMS) == (50e6, 1e9)


# --- strategy table: (size, nodes, gpus/node, fabric, gpu, seq_len) -> (strategy, degrees, precision, code) ---

NONE = ("none", {})
STRATEGY_TABLE = [
    # tiny: 0.47M params
    ("tiny-1x1-ib-H200-single", "tiny", 1, 1, IB, "H200", 64, "single", {"dp_replicate": 1}, "bf16", None),
    (
        "tiny-1x1-eth-L40S-single node ethernet is fine",
        "tiny",
        1,
        1,
        ETH,
        "L40S",
        64,
        "single",
        {"dp_replicate": 1},
        "bf16",
        None,
    ),
    ("tiny-1x2-wasteful 0.47M<50M", "tiny", 1, 2, IB, "H200", 64, *NONE, "bf16", "plan_wasteful"),
    ("tiny-1x8-wasteful", "tiny", 1, 8, IB, "H100", 64, *NONE, "bf16", "plan_wasteful"),
    ("tiny-2x1-eth-fabric before waste", "tiny", 2, 1, ETH, "H200", 64, *NONE, "bf16", "fabric_unsupported"),
    ("tiny-2x8-ib-wasteful", "tiny", 2, 8, IB, "H200", 64, *NONE, "bf16", "plan_wasteful"),
    ("tiny-8x8-roce-wasteful", "tiny", 8, 8, ROCE, "H200", 64, *NONE, "bf16", "plan_wasteful"),
    # 150M: 134M params, 2.15 GB state
    (
        "150M-1x1-H100-single 2.15GB",
        "150M",
        1,
        1,
        IB,
        "H100",
        64,
        "single",
        {"dp_replicate": 1},
        "bf16",
        None,
    ),
    ("150M-1x8-H100-ddp 134M>=50M", "150M", 1, 8, IB, "H100", 64, "ddp", {"dp_replicate": 8}, "bf16", None),
    ("150M-2x8-ib-wasteful 134M<1B multi-node", "150M", 2, 8, IB, "H100", 64, *NONE, "bf16", "plan_wasteful"),
    ("150M-8x8-roce-wasteful", "150M", 8, 8, ROCE, "H100", 64, *NONE, "bf16", "plan_wasteful"),
    ("150M-2x8-eth-fabric", "150M", 2, 8, ETH, "H100", 64, *NONE, "bf16", "fabric_unsupported"),
    # 1B: 1.498B params, 23.98 GB state + 0.07 GB activations
    (
        "1B-1x1-L40S-single 24.05<=43.2",
        "1B",
        1,
        1,
        IB,
        "L40S",
        64,
        "single",
        {"dp_replicate": 1},
        "bf16",
        None,
    ),
    ("1B-1x8-H200-ddp", "1B", 1, 8, IB, "H200", 64, "ddp", {"dp_replicate": 8}, "bf16", None),
    # several nodes of several GPUs: a torchft replica group per node, sharded inside (no plain ddp)
    (
        "1B-2x8-ib-H100-hsdp 1.498B>=1B",
        "1B",
        2,
        8,
        IB,
        "H100",
        64,
        "hsdp",
        {"dp_replicate": 2, "dp_shard": 8},
        "bf16",
        None,
    ),
    (
        "1B-8x8-roce-A100-hsdp",
        "1B",
        8,
        8,
        ROCE,
        "A100",
        64,
        "hsdp",
        {"dp_replicate": 8, "dp_shard": 8},
        "bf16",
        None,
    ),
    ("1B-2x8-eth-fabric", "1B", 2, 8, ETH, "H200", 64, *NONE, "bf16", "fabric_unsupported"),
    # 8B: 8.03B params, 128.48 GB state (+ FSDP's gathered block, 1.75 GB); bf16 always (fp8 is not built)
    ("8B-1x1-H200-capacity 128.5>126.9", "8B", 1, 1, IB, "H200", 64, *NONE, "bf16", "capacity_insufficient"),
    (
        "8B-1x2-H100-fsdp2 65.99<=72",
        "8B",
        1,
        2,
        IB,
        "H100",
        64,
        "fsdp2",
        {"dp_replicate": 1, "dp_shard": 2},
        "bf16",
        None,
    ),
    (
        "8B-1x8-A100-fsdp2",
        "8B",
        1,
        8,
        IB,
        "A100",
        64,
        "fsdp2",
        {"dp_replicate": 1, "dp_shard": 8},
        "bf16",
        None,
    ),
    (
        "8B-1x8-L40S-fsdp2 17.81<=43.2",
        "8B",
        1,
        8,
        ETH,
        "L40S",
        64,
        "fsdp2",
        {"dp_replicate": 1, "dp_shard": 8},
        "bf16",
        None,
    ),
    (
        "8B-2x8-ib-H200-hsdp",
        "8B",
        2,
        8,
        IB,
        "H200",
        64,
        "hsdp",
        {"dp_replicate": 2, "dp_shard": 8},
        "bf16",
        None,
    ),
    (
        "8B-8x8-roce-H100-hsdp",
        "8B",
        8,
        8,
        ROCE,
        "H100",
        64,
        "hsdp",
        {"dp_replicate": 8, "dp_shard": 8},
        "bf16",
        None,
    ),
    ("8B-8x8-eth-fabric", "8B", 8, 8, ETH, "H100", 64, *NONE, "bf16", "fabric_unsupported"),
    # 70B: 70.55B params, 1128.86 GB state; a block FSDP gathers is 6.85 GB (over the TP degree)
    (
        "70B-1x8-H200-capacity 1128.86/8>126.9",
        "70B",
        1,
        8,
        IB,
        "H200",
        64,
        *NONE,
        "bf16",
        "capacity_insufficient",
    ),
    (
        "70B-2x8-H200-fsdp2 hsdp 148 no, 16-way 77.40 yes",
        "70B",
        2,
        8,
        IB,
        "H200",
        64,
        "fsdp2",
        {"dp_shard": 16},
        "bf16",
        None,
    ),
    # 16-way: 70.55 + 6.85 gathered > 72; tp2 +3.43, tp4 +1.71 still over; tp8 71.41 just fits
    (
        "70B-2x8-H100-tp8 71.41<=72.0 just fits",
        "70B",
        2,
        8,
        IB,
        "H100",
        64,
        "fsdp2+tp",
        {"dp_shard": 2, "tp": 8},
        "bf16",
        None,
    ),
    ("70B-2x8-A100-tp8", "70B", 2, 8, ROCE, "A100", 64, "fsdp2+tp", {"dp_shard": 2, "tp": 8}, "bf16", None),
    ("70B-2x8-L40S-capacity", "70B", 2, 8, IB, "L40S", 64, *NONE, "bf16", "capacity_insufficient"),
    (
        "70B-8x8-L40S-fsdp2 17.64+6.85<=43.2",
        "70B",
        8,
        8,
        IB,
        "L40S",
        64,
        "fsdp2",
        {"dp_shard": 64},
        "bf16",
        None,
    ),
    # seq 2048: micro-batch 1 keeps 57.86 GB of activations (no checkpointing): 77.40 - 17.64 grads + 60.49
    (
        "70B-2x8-H200-seq2048-fsdp2 120.25<=126.9",
        "70B",
        2,
        8,
        IB,
        "H200",
        2048,
        "fsdp2",
        {"dp_shard": 16},
        "bf16",
        None,
    ),
    (
        "70B-2x8-H100-seq2048-tp8 micro 1 x 8",
        "70B",
        2,
        8,
        IB,
        "H100",
        2048,
        "fsdp2+tp",
        {"dp_shard": 2, "tp": 8},
        "bf16",
        None,
    ),
    # seq 8192: the 16-way shard fits once every block is recomputed (82.29 GB), before any TP
    (
        "70B-2x8-H200-seq8192-fsdp2 full checkpointing",
        "70B",
        2,
        8,
        IB,
        "H200",
        8192,
        "fsdp2",
        {"dp_shard": 16},
        "bf16",
        None,
    ),
    ("70B-2x8-eth-fabric", "70B", 2, 8, ETH, "H200", 64, *NONE, "bf16", "fabric_unsupported"),
]


@pytest.mark.parametrize(
    "size, nodes, gpn, fabric, gpu, seq_len, strategy, degrees, precision, code",
    [row[1:] for row in STRATEGY_TABLE],
    ids=[row[0] for row in STRATEGY_TABLE],
)
def test_strategy_table(size, nodes, gpn, fabric, gpu, seq_len, strategy, degrees, precision, code):
    p = run_plan(manifest(size, nodes, gpn, seq_len=seq_len), body(nodes, gpn, gpu, fabric))
    assert (p.strategy, p.degrees, p.precision, code_of(p)) == (strategy, degrees, precision, code)
    assert p.ok is (code is None)
    names = [c.name for c in p.checks]
    if code == "fabric_unsupported":
        assert "parallelism" not in names  # the fabric refusal is reported once, under its own name
        assert not next(c for c in p.checks if c.name == "fabric").ok
    else:
        assert names[:2] == ["fabric", "parallelism"]


def test_unknown_gpu_model_is_refused_before_anything_else():
    p = run_plan(manifest("tiny"), body(gpu="MI300X"))
    assert p.checks[0].name == "price" and code_of(p) == "capacity_insufficient"
    assert "MI300X" in p.checks[0].reason


# --- cost ---

P_1B = parameter_count(MODEL_SHAPES["1B"])


def expected_total(params, tokens, gpu="H200", keep_last=2, window_hours=24.0, post_factor=0.0):
    g = PRICES.gpus[gpu]
    flops = (6.0 + post_factor) * params * tokens
    gpu_hours = flops / (g.peak_bf16_tflops * 1e12 * g.assumed_mfu) / 3600
    storage = params * 12 * keep_last / 1e9 * PRICES.storage_usd_per_gb_month * max(window_hours / 730, 1.0)
    return gpu_hours, gpu_hours * g.price_per_gpu_hour_usd + storage


@pytest.mark.parametrize(
    "recipe, post_factor",
    [
        ((), 0.0),
        (("sft",), 6.0 * 0.05),  # 6 FLOPs/token/param on 5% of the tokens
        (("dpo",), 16.0 * 0.05),  # 2x6 + 2x2
        (("rlvr",), 24.0 * 0.05),  # 8x2 + 6 + 2
        (("sft", "dpo", "rlvr"), 46.0 * 0.05),
        (("unknown_stage",), 6.0 * 0.05),  # an unknown stage is priced like sft
    ],
    ids=["pretrain-only", "sft", "dpo", "rlvr", "all-three", "unknown-stage"],
)
def test_cost_includes_post_training(recipe, post_factor):
    p = run_plan(manifest("1B", tokens=10**9, recipe=recipe), body())
    assert p.cost.flops == pytest.approx((6.0 + post_factor) * P_1B * 1e9, rel=1e-12)
    assert p.cost.total_usd == pytest.approx(
        expected_total(P_1B, 10**9, post_factor=post_factor)[1], abs=1e-5
    )


@pytest.mark.parametrize(
    "window_hours, storage_factor",
    [(24.0, 1.0), (730.0, 1.0), (1460.0, 2.0)],
    ids=["day-billed-as-a-month", "one-month", "two-months"],
)
def test_checkpoint_storage_is_billed_per_month_at_least_one(window_hours, storage_factor):
    p = run_plan(manifest("1B", tokens=1000, keep_last=3), body(window_hours=window_hours))
    expected = P_1B * 12 * 3 / 1e9 * 0.02 * storage_factor  # 1.498B x 12 B x 3 = 53.9 GB at 0.02 USD/GB-month
    assert p.cost.checkpoint_storage_usd == pytest.approx(expected, abs=1e-6)


def test_one_billion_tokens_on_1b_h200():
    # 6 x 1.498e9 x 1e9 = 8.99e18 FLOPs / (989e12 x 0.4) / 3600 = 6.31 GPU-hours x 3.50 = 22.10 USD
    # + 35.96 GB checkpoints x 0.02 = 0.72 USD
    p = run_plan(manifest("1B", tokens=10**9), body())
    assert p.cost.gpu_hours == pytest.approx(6.3128, abs=1e-3)
    assert p.cost.total_usd == pytest.approx(22.815, abs=1e-2)
    assert (p.cost.parameters, p.cost.tokens, p.cost.gpus) == (P_1B, 10**9, 1)


# --- budget boundaries: at the cap passes ---

# 2 GPU-hours booked, 6.31 needed: longer than the window, so resumable (the budget is what is tested)
BASE = run_plan(manifest("1B", tokens=10**9, resumable=True), body(window_hours=2.0))
TOTAL = BASE.cost.total_usd
INCREMENTAL = BASE.cost.incremental_usd  # (6.31 - 2) x 3.50 = 15.10 USD


def test_budget_fixture_has_a_real_incremental_cost():
    gpu_hours, total = expected_total(P_1B, 10**9, window_hours=2.0)
    assert TOTAL == pytest.approx(total, abs=1e-5)
    assert INCREMENTAL == pytest.approx((gpu_hours - 2.0) * 3.5, abs=1e-5) and INCREMENTAL > 15


@pytest.mark.parametrize(
    "cap, code",
    [
        (math.nextafter(TOTAL, math.inf), None),
        (TOTAL, None),
        (math.nextafter(TOTAL, -math.inf), "budget_exceeded"),
        (TOTAL - 0.01, "budget_exceeded"),
        (0.0, "budget_exceeded"),
    ],
    ids=[
        "estimate-just-under-cap",
        "estimate-exactly-at-cap",
        "estimate-just-over-cap",
        "a-cent-over",
        "zero-cap",
    ],
)
def test_budget_cap_boundary(cap, code):
    p = run_plan(manifest("1B", tokens=10**9, budget=cap, resumable=True), body(window_hours=2.0))
    check = next(c for c in p.checks if c.name == "budget_cap")
    assert (check.code, code_of(p)) == (code, code)


@pytest.mark.parametrize(
    "allowed, code",
    [
        (math.nextafter(INCREMENTAL, math.inf), None),
        (INCREMENTAL, None),
        (math.nextafter(INCREMENTAL, -math.inf), "budget_exceeded"),
        (0.0, "budget_exceeded"),  # the default: nothing beyond the booking
    ],
    ids=["just-under-allowed", "exactly-at-allowed", "just-over-allowed", "default-zero"],
)
def test_incremental_cap_boundary(allowed, code):
    p = run_plan(manifest("1B", tokens=10**9, incremental=allowed, resumable=True), body(window_hours=2.0))
    check = next(c for c in p.checks if c.name == "incremental_cost")
    assert (check.code, code_of(p)) == (code, code)


def test_a_run_inside_the_booking_has_no_incremental_cost():
    p = run_plan(
        manifest("1B", tokens=10**9, incremental=0.0), body(window_hours=24.0)
    )  # 24 >= 6.31 GPU-hours
    assert p.cost.incremental_usd == 0.0 and p.ok


# --- refusal order ---


def test_first_refusal_follows_check_order():
    # ethernet multi-node, remote data, a relative storage path and a zero budget all at once: fabric wins
    m = manifest(
        "1B",
        2,
        8,
        tokens=10**12,
        budget=0.0,
        incremental=0.0,
        data=[{"name": "x", "source": "https://example.com/d"}],
    )
    m = msgspec.structs.replace(m, checkpoint=msgspec.structs.replace(m.checkpoint, storage="relative/dir"))
    p = run_plan(m, body(2, 8, fabric=ETH, window_hours=2.0))  # 32 GPU-hours booked, ~6300 needed
    assert [c.name for c in p.checks if not c.ok] == [
        "fabric",
        "data_policy",
        "checkpoint_storage",
        "budget_cap",
        "incremental_cost",
        "booking_window",
    ]
    assert code_of(p) == "fabric_unsupported"


ROOTS = (pathlib.Path("/mnt/ckpt"),)


@pytest.mark.parametrize(
    "storage, roots, refused",
    [
        ("local", (), False),
        ("/mnt/ckpt", ROOTS, False),
        ("/mnt/ckpt/team", ROOTS, False),
        # issue 39: a tenant named any absolute path (a link there took the trainer anywhere)
        ("/mnt/ckpt", (), True),
        ("/etc", ROOTS, True),
        ("/mnt/ckpt2", ROOTS, True),
        ("/mnt/ckpt/../../etc", ROOTS, True),
        ("relative/dir", ROOTS, True),
        ("", ROOTS, True),
    ],
)
def test_the_storage_policy_is_judged_without_a_disk(storage, roots, refused):
    # issue 29: the scheduler measured its own disk (and made a directory inside `plan`); the
    # storage is the trainer's. The plan judges the policy's form and says how much room is needed.
    m = manifest("tiny")
    m = msgspec.structs.replace(m, checkpoint=msgspec.structs.replace(m.checkpoint, storage=storage))
    p = plan(m, "d" * 64, body(), PRICES, storage_roots=roots)
    refusal = first_refusal(p)
    if refused:
        assert refusal is not None and refusal[0] is ErrorCode.checkpoint_storage_unavailable
        assert refusal[1].startswith("checkpoint storage must be 'local' or a path under a storage root")
    else:
        assert refusal is None
    one = checkpoint_bytes(m, model_shape(m, None))
    assert one > 0 and p.checkpoint_bytes == one * m.checkpoint.keep_last


def test_a_good_plan_is_ok():
    p = run_plan(manifest("tiny"), body())
    assert p.ok and first_refusal(p) is None and all(c.ok and c.code is None for c in p.checks)


# --- data policy ---

DECON = {"method": "13-gram", "against": [], "provenance": "report sha256:abc"}
DATA_TABLE = [
    (
        "builtin-train-decontaminated",
        [{"name": "a", "source": "builtin:pydoc_topics", "decontamination": DECON}],
        None,
    ),
    (
        "generated-train-decontaminated",
        [{"name": "a", "source": "generated:arithmetic", "decontamination": DECON}],
        None,
    ),
    ("absolute-file-train", [{"name": "a", "source": "file:/data/a.txt", "decontamination": DECON}], None),
    (
        "train-plus-undecontaminated-eval-is-fine",
        [
            {"name": "a", "source": "builtin:x", "decontamination": DECON},
            {"name": "e", "source": "builtin:y", "role": "eval"},
        ],
        None,
    ),
    (
        "train-without-decontamination",
        [{"name": "a", "source": "builtin:x"}],
        "no decontamination provenance",
    ),
    (
        "https-source",
        [{"name": "a", "source": "https://example.com/data.jsonl", "decontamination": DECON}],
        "not in the allowed list",
    ),
    (
        "https-eval-source",
        [
            {"name": "a", "source": "builtin:x", "decontamination": DECON},
            {"name": "e", "source": "https://example.com/eval", "role": "eval"},
        ],
        "not in the allowed list",
    ),
    (
        "s3-source-without-a-connection",
        [{"name": "a", "source": "s3://bucket/key", "decontamination": DECON}],
        "names no connection",
    ),
    (
        "s3-source-through-a-connection",
        [{"name": "a", "source": "s3://bucket/key", "connection": "c", "decontamination": DECON}],
        None,
    ),
    ("upload-source", [{"name": "a", "source": "upload:file-" + "0" * 24, "decontamination": DECON}], None),
    (
        "relative-file-source",
        [{"name": "a", "source": "file:data.txt", "decontamination": DECON}],
        "not in the allowed list",
    ),
    (
        "prefix-must-lead",
        [{"name": "a", "source": "https://x/builtin:y", "decontamination": DECON}],
        "not in the allowed list",
    ),
    ("eval-only", [{"name": "e", "source": "builtin:y", "role": "eval"}], "no training data"),
    ("no-data", [], "no training data"),
]


@pytest.mark.parametrize("data, reason", [r[1:] for r in DATA_TABLE], ids=[r[0] for r in DATA_TABLE])
def test_data_policy(data, reason):
    refusal = data_policy(manifest(data=data))
    if reason is None:
        assert refusal is None
    else:
        assert refusal[0] is ErrorCode.data_policy_violation and reason in refusal[1]


def test_data_policy_violation_reaches_the_plan():
    p = run_plan(manifest(data=[{"name": "web", "source": "https://example.com/x"}]), body())
    assert code_of(p) == "data_policy_violation" and "'web'" in first_refusal(p)[1]


# --- nonsense sizes: the Manifest schema bounds them, so plan() never sees them ---


@pytest.mark.parametrize(
    "args, kwargs",
    [(("tiny", 0, 1), {}), (("tiny", 1, 0), {}), (("1B",), {"tokens": -(10**12), "budget": 0.0})],
    ids=["zero-nodes", "zero-gpus-per-node", "negative-tokens"],
)
def test_nonsense_sizes_are_refused_by_the_schema(args, kwargs):
    with pytest.raises(msgspec.ValidationError):
        manifest(*args, **kwargs)


@pytest.mark.parametrize(
    "wanted, gpn, strategy, degrees, code",
    [
        (None, 2, "ddp", {"dp_replicate": 2}, None),  # the cheapest that fits: a tiny model replicates
        ("fsdp2", 2, "fsdp2", {"dp_replicate": 1, "dp_shard": 2}, None),  # insisted on: it shards
        ("fsdp2+tp", 2, "fsdp2+tp", {"dp_shard": 1, "tp": 2}, None),
        ("hsdp", 2, *NONE, "capacity_insufficient"),  # one node has no hsdp layout
    ],
)
def test_resources_strategy_insists_on_a_layout(wanted, gpn, strategy, degrees, code):
    m = manifest("tiny", 1, gpn)
    m = msgspec.structs.replace(m, resources=msgspec.structs.replace(m.resources, strategy=wanted))
    p = plan(m, "d" * 64, body(1, gpn), PRICES, small_model_gangs=True)  # a tiny model on 2 GPUs
    assert (p.strategy, p.degrees, code_of(p)) == (strategy, degrees, code)

"""The gang launcher's pure parts: which plans run on a gang and which are refused (in a sentence),
the torchrun command line, the job every rank reads (a next-token or a post-training stage), rank 0's events handed on, and how the
launcher's exit code and rank 0's result become the stage's outcome."""

import dataclasses
import json
import pathlib
from datetime import UTC, datetime

import msgspec
import pytest

from contracts.booking import Fabric
from contracts.errors import ErrorCode
from contracts.manifest import Manifest, RlvrStage
from contracts.models import MODEL_SHAPES
from contracts.plans import CostEstimate, Plan
from contracts.runs import LogLine, Metrics, ParallelismStarted, RunCreated, StateChanged
from contracts.states import RunState
from domain.curriculum import curriculum_of
from services.scheduler import planning
from tests.conftest import REPO, write_manifest
from training.engine.distributed import ParallelDims, ParallelismError
from training.launch.elastic import (
    EventTail,
    GangFailed,
    GangLost,
    LaunchSpec,
    gang_dims,
    read_outcome,
    refusal,
    torchrun_command,
)
from training.launch.rank import (
    JOB_CAP_BYTES,
    PostJob,
    Refusal,
    RlvrJob,
    StageAnswer,
    StageJob,
    job_for,
    main,
    read_answer,
    read_job,
)
from training.recipes.posttrain import PostConfig
from training.recipes.pretrain import StageConfig
from training.recipes.rlvr import RlvrConfig

COST = CostEstimate(
    flops=1.0,
    tokens=1,
    parameters=1,
    assumed_mfu=0.4,
    peak_tflops_per_gpu=1.0,
    gpus=4,
    gpu_hours=0.1,
    price_per_gpu_hour_usd=1.0,
    compute_usd=0.1,
    checkpoint_storage_usd=0.0,
    total_usd=0.1,
    booked_gpu_hours=1.0,
    incremental_usd=0.0,
)
SPEC = LaunchSpec(nproc=4, port=29511, max_restarts=2, log_dir=pathlib.Path("/runs/r1/gang/pretrain/logs"))


def _plan(strategy: str, degrees: dict[str, int]) -> Plan:
    return Plan(
        booking_id="bk",
        manifest_digest="ab" * 32,
        strategy=strategy,
        degrees=degrees,
        precision="bf16",
        cost=COST,
        checks=[],
        ok=True,
    )


def _manifest(tmp_path: pathlib.Path, **overrides) -> Manifest:
    path = write_manifest(tmp_path, resources={"nodes": 1, "gpus_per_node": 4}, **overrides)
    return msgspec.json.decode(path.read_bytes(), type=Manifest)


@pytest.mark.parametrize(
    ("strategy", "degrees", "world"),
    [
        ("single", {"dp_replicate": 1}, None),
        ("ddp", {"dp_replicate": 4}, 4),
        ("fsdp2", {"dp_replicate": 1, "dp_shard": 4}, 4),
        ("fsdp2+tp", {"dp_shard": 2, "tp": 2}, 4),
    ],
)
def test_a_plan_of_more_than_one_rank_runs_on_a_gang(strategy, degrees, world):
    dims = gang_dims(_plan(strategy, degrees))
    assert (dims.world_size if dims else None) == world


def test_a_plan_whose_strategy_and_degrees_disagree_is_refused():
    with pytest.raises(ParallelismError, match="does not go with the degrees"):
        gang_dims(_plan("ddp", {"dp_shard": 4}))


def test_next_token_stages_on_one_node_are_not_refused(tmp_path):
    manifest = _manifest(tmp_path)
    assert refusal(ParallelDims(strategy="ddp", dp_replicate=4), manifest, curriculum_of(manifest)) is None


def test_post_training_and_a_custom_data_ladder_are_not_refused(tmp_path):
    custom = tmp_path / "custom.txt"
    custom.write_text("12+30=42\n" * 200)
    data = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())["data"]
    data.append({"name": "mine", "source": f"file:{custom}", "role": "train"})
    manifest = _manifest(
        tmp_path,
        data=data,
        stages={"ladder": {"proxy_steps": 4, "max_budget_fraction": 0.5}},
        post_training={"recipe": ["sft", "dpo", "rlvr"]},
    )
    run_plan = curriculum_of(manifest)
    assert run_plan.ladder is not None and run_plan.ladder.custom == ("mine",)
    assert refusal(ParallelDims(strategy="ddp", dp_replicate=4), manifest, run_plan) is None


def test_a_post_training_batch_the_data_parallel_ranks_cannot_split_is_refused(tmp_path):
    manifest = _manifest(
        tmp_path,
        target={"tokens": 30 * 12 * 32, "seq_len": 32, "batch_size": 12, "learning_rate": 0.003},
        post_training={"recipe": ["dpo"], "dpo": {"batch_size": 10}},
    )
    reason = refusal(ParallelDims(strategy="fsdp2", dp_shard=4), manifest, curriculum_of(manifest))
    assert reason is not None and "The global batch of 10 does not split evenly over 4" in reason


def test_a_batch_the_data_parallel_ranks_cannot_split_is_refused(tmp_path):
    manifest = _manifest(tmp_path)  # a global batch of 8
    reason = refusal(ParallelDims(strategy="fsdp2", dp_shard=3), manifest, curriculum_of(manifest))
    assert reason is not None and "does not split evenly over 3" in reason


def test_more_than_one_node_is_refused(tmp_path):
    path = write_manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 2})
    manifest = msgspec.json.decode(path.read_bytes(), type=Manifest)
    reason = refusal(ParallelDims(strategy="ddp", dp_replicate=4), manifest, curriculum_of(manifest))
    assert reason is not None and "2 nodes" in reason


def test_a_small_model_on_several_gpus_or_nodes_only_with_the_operator_setting():
    params = planning.parameter_count(MODEL_SHAPES["tiny"])
    refused = planning.topology_refusal(params, 1, 4, Fabric.infiniband)
    assert refused is not None and refused[0] is ErrorCode.plan_wasteful
    assert planning.topology_refusal(params, 1, 4, Fabric.infiniband, small_model_gangs=True) is None
    refused = planning.topology_refusal(params, 2, 2, Fabric.infiniband)
    assert refused is not None and refused[0] is ErrorCode.plan_wasteful
    # the setting lets tests train the tiny model on two agents (tests/e2e/test_multinode_e2e.py)
    assert planning.topology_refusal(params, 2, 2, Fabric.infiniband, small_model_gangs=True) is None
    refused = planning.topology_refusal(params, 2, 2, Fabric.ethernet, small_model_gangs=True)
    assert refused is not None and refused[0] is ErrorCode.fabric_unsupported  # never lifted


def test_the_torchrun_command_line():
    command = torchrun_command(SPEC, pathlib.Path("/runs/r1/gang/pretrain/job.json"))
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert {
        "--nnodes=1",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:29511",
        "--max-restarts=2",
        "--log-dir=/runs/r1/gang/pretrain/logs",
        "--redirects=3",
    } <= set(command)
    assert command[-4:] == [
        "-m",
        "training.launch.rank",
        "--config",
        "/runs/r1/gang/pretrain/job.json",
    ]


def _config() -> StageConfig:
    return StageConfig(
        stage="long_context",
        shape=MODEL_SHAPES["tiny"],
        train_sources=["generated:arithmetic"],
        eval_sources=["generated:arithmetic"],
        seq_len=32,
        batch_size=8,
        learning_rate=3e-4,
        steps=5,
        warmup_steps=0,
        decay="linear",
        min_lr_ratio=0.0,
        rope_base=40000.0,
        init_from="/runs/r1/midtrain",
        checkpoint_dir="/runs/r1/long_context",
        checkpoint_interval=2,
        keep_last=3,
    )


def test_the_job_every_rank_reads_carries_the_stage_config_whole_and_the_plan(tmp_path):
    # issue 29: the job was a field-by-field copy of the config (StageJob), rebuilt on the rank
    # field by field (the old rank_main.stage_config): what the copy forgot (weight decay, betas, grad clip,
    # held-out share, ...) trained with its default on a gang. The job carries the config whole now.
    cfg = dataclasses.replace(
        _config(), weight_decay=0.05, betas=(0.8, 0.9), grad_clip=0.5, held_out_fraction=0.2, z_loss=1e-4
    )
    dims = ParallelDims(strategy="fsdp2", dp_shard=4)
    job = job_for(cfg, dims, tmp_path)
    path = tmp_path / "job.json"
    path.write_bytes(msgspec.json.encode(job))
    back = read_job(str(path))
    assert isinstance(back, StageJob)
    assert back.config == dataclasses.replace(cfg, parallel=dims)
    assert back.events_path == str(tmp_path / "events.jsonl")
    assert back.result_path == str(tmp_path / "result.json")


def test_the_job_of_a_post_stage_carries_its_config_and_data_whole(tmp_path):
    section = RlvrStage(steps=3, prompts_per_step=2, group_size=4)
    cfg = RlvrConfig(
        stage="rlvr",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[("1+2=", "3")],
        steps=3,
        batch_size=8,
        learning_rate=2e-4,
        seed=7,
        checkpoint_dir="/runs/r1/rlvr",
        init_from="/runs/r1/dpo",
        rlvr=section,
        threads=3,
    )
    dims = ParallelDims(strategy="ddp", dp_replicate=2)
    sft = PostConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(PostConfig)})
    for config, kind in ((cfg, RlvrJob), (dataclasses.replace(sft, stage="sft"), PostJob)):
        path = tmp_path / "job.json"
        path.write_bytes(msgspec.json.encode(job_for(config, dims, tmp_path)))
        back = read_job(str(path))
        assert type(back) is kind and back.config == dataclasses.replace(config, parallel=dims)
        assert (back.events_path, back.result_path) == (
            str(tmp_path / "events.jsonl"),
            str(tmp_path / "result.json"),
        )


def test_a_job_whose_config_fails_its_checks_is_refused_with_its_result_written(tmp_path):
    job = msgspec.json.decode(msgspec.json.encode(job_for(_config(), ParallelDims(), tmp_path)))
    job["config"]["steps"] = 0  # StageConfig's own check, run on decode
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    assert main(["--config", str(path)]) == 2
    refused = read_answer((tmp_path / "result.json").read_bytes(), StageAnswer)
    assert isinstance(refused, Refusal) and "at least 1 step" in refused.reason
    assert JOB_CAP_BYTES >= 64 << 20  # a post stage's job carries its tasks, examples or pairs


def _stage_answer(final_step: int, stopped: bool = False) -> StageAnswer:
    return StageAnswer(
        stage="pretrain", final_step=final_step, first_loss=5.0, final_loss=4.0, stopped=stopped,
        world_size=4, strategy="ddp", degrees={"dp_replicate": 4}, held_out_loss=4.5,
    )  # fmt: skip


REFUSED = msgspec.json.encode(Refusal(reason="tp 3 does not divide n_head 4"))


@pytest.mark.parametrize(
    ("rc", "result", "stopped", "want"),
    [
        (0, msgspec.json.encode(_stage_answer(6)), False, _stage_answer(6)),
        (0, msgspec.json.encode(_stage_answer(3, stopped=True)), True, None),
        (1, None, True, None),  # torchrun exits non-zero on the SIGTERM it was sent
        (0, REFUSED, False, ParallelismError),
        (1, REFUSED, False, ParallelismError),
        (1, None, False, GangLost),  # past max_restarts: the run is interrupted and requeued
        (-9, None, False, GangLost),
        (0, None, False, GangFailed),  # a clean exit without rank 0's result: the run fails
        (0, b'{"final_step": 6}', False, GangFailed),  # the old untyped summary: no tag
        (0, b"{", False, GangFailed),
    ],
)
def test_exit_code_and_result_map_to_the_stage_outcome(rc, result, stopped, want):
    if isinstance(want, type):
        with pytest.raises(want) as raised:
            read_outcome(rc, result, stopped, SPEC, StageAnswer)
        if want is GangLost:
            assert f"code {rc}" in str(raised.value) and "2 restarts" in str(raised.value)
        if want is ParallelismError:
            assert "tp 3 does not divide n_head 4" in str(raised.value)
    else:
        assert read_outcome(rc, result, stopped, SPEC, StageAnswer) == want


def test_rank0_events_are_read_whole_lines_only_and_only_training_kinds(tmp_path):
    at = datetime(2026, 1, 1, tzinfo=UTC)
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []  # not written yet
    metrics = Metrics(
        run_id="gang", seq=0, at=at, stage="pretrain", step=1, total_steps=2, loss=5.0,
        learning_rate=1e-3, tokens_per_s=1.0, grad_norm=1.0,
    )  # fmt: skip
    lines = [
        msgspec.json.encode(ParallelismStarted(run_id="gang", seq=0, at=at, stage="pretrain", strategy="ddp", world_size=4)),
        msgspec.json.encode(StateChanged(run_id="gang", seq=0, at=at, state=RunState.succeeded)),
        msgspec.json.encode(RunCreated(run_id="gang", seq=0, at=at, account="a", booking_id="b", region="r",
                                       gpu_model="g", gpus=1, accepted_at=at)),
        b"not json",
        msgspec.json.encode(metrics),
    ]  # fmt: skip
    encoded = b"\n".join(lines) + b"\n"
    log = msgspec.json.encode(LogLine(run_id="gang", seq=0, at=at, message="half"))
    path.write_bytes(encoded + log[:10])
    assert [type(e) for e in tail.read()] == [ParallelismStarted, Metrics]
    assert tail.read() == []
    with open(path, "ab") as f:
        f.write(log[10:] + b"\n")
    assert [e.message for e in tail.read() if isinstance(e, LogLine)] == ["half"]

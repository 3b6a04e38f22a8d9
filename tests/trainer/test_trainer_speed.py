"""The trainer hands every stage the speed its plan asks for (issue 40): the scheduler's micro-batch
and activation checkpointing, and the operator's compile switch (ITO_TRAINER_COMPILE), in each
stage's config, whole on a gang's job file too."""

import dataclasses
import pathlib

import msgspec
import pytest

from contracts.manifest import Manifest
from contracts.plans import CostEstimate, Plan
from contracts.runs import TrainWork
from domain.curriculum import curriculum_of
from runtime.configuration import settings as settings_mod
from services.trainer import trainer_settings
from services.trainer.worker import Worker
from training.engine.distributed import ParallelDims
from training.engine.reporting import Recorder
from training.engine.speed import Speed
from training.launch.rank import StageJob, job_for, read_job
from training.recipes.pipeline import Trainers, run_pipeline
from training.recipes.pretrain import StageConfig, StageResult

REPO = pathlib.Path(__file__).resolve().parents[2]


def manifest() -> Manifest:
    raw = msgspec.json.decode((REPO / "examples" / "manifests" / "tiny.json").read_bytes())
    raw["target"] = {"tokens": 12 * 16 * 32, "seq_len": 32, "batch_size": 16, "learning_rate": 0.003}
    return msgspec.convert(raw, Manifest)


def plan(**speed: object) -> Plan:
    cost = CostEstimate(
        flops=1.0,
        tokens=1,
        parameters=1,
        assumed_mfu=0.4,
        peak_tflops_per_gpu=1.0,
        gpus=2,
        gpu_hours=0.0,
        price_per_gpu_hour_usd=1.0,
        compute_usd=0.0,
        checkpoint_storage_usd=0.0,
        total_usd=0.0,
        booked_gpu_hours=1.0,
        incremental_usd=0.0,
    )
    return Plan(
        booking_id="b",
        manifest_digest="d",
        strategy="ddp",
        degrees={"dp_replicate": 2},
        precision="bf16",
        cost=cost,
        checks=[],
        ok=True,
        **speed,  # type: ignore[arg-type]
    )


def never() -> bool:
    return False


@pytest.mark.parametrize(
    ("env", "fields", "want"),
    [
        (
            {"ITO_TRAINER_COMPILE": "off"},
            {"micro_batch_size": 4, "grad_accumulation": 2, "activation_checkpointing": "selective"},
            Speed(compile=False, activation_checkpointing="selective", micro_batch=4),
        ),
        (
            {},
            {"activation_checkpointing": "full"},
            Speed(activation_checkpointing="full"),
        ),  # an older plan: whole
        ({"ITO_TRAINER_COMPILE": "on"}, {}, Speed(compile=True)),
    ],
    ids=["micro-4x2-selective", "full-ac", "compile-on"],
)
def test_the_plan_gives_the_stage_configs_their_speed(tmp_path, env, fields, want):
    m = manifest()
    curriculum = curriculum_of(m)
    work = TrainWork(
        run_id="run_s",
        account="acme",
        booking_id="b",
        manifest_text=msgspec.json.encode(m).decode(),
        manifest_digest="d",
        plan=plan(**fields),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    settings = settings_mod.load({"ITO_NAMESPACE": "speed", "ITO_DATA_DIR": str(tmp_path)})
    worker = Worker(None, settings, trainer_settings.load({"ITO_TRAINER_THREADS": "1", **env}, 1))  # type: ignore[arg-type]
    configs: list[StageConfig] = []

    def train_lm(cfg: StageConfig, report, should_stop) -> StageResult:  # the first stage only: stopped
        configs.append(cfg)
        return StageResult(
            final_step=0, first_loss=None, final_loss=None, held_out_loss=None, stopped=True, tokens=0
        )

    inputs = worker._inputs(work, m, curriculum)
    run_pipeline(m, tmp_path / "ckpt", Recorder(), never, 1, Trainers(lm=train_lm), **inputs)
    assert [c.speed for c in configs] == [want]
    # A gang's ranks read the config whole from the job file, its speed included.
    dims = ParallelDims(strategy="ddp", dp_replicate=2)
    path = tmp_path / "job.json"
    path.write_bytes(msgspec.json.encode(job_for(configs[0], dims, tmp_path)))
    back = read_job(str(path))
    assert isinstance(back, StageJob) and back.config == dataclasses.replace(configs[0], parallel=dims)
    assert back.config.speed == want

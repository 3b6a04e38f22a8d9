"""A run's tenant data as the trainer reads it (services/trainer/inputs.py and the pipeline's
`localized`), on real files: each resolved input is copied into the run's directory from its
locator and used only at its confirmed digest; a changed file, a link swapped in, a ref the work
item does not resolve, all fail the run before any step; and a Parquet corpus goes through data
prep into pretraining (issue 39: data prep wrote its rows back as JSONL and the stage then opened
them as Parquet, so such a run always failed with ArrowInvalid)."""

import hashlib
import json

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contracts.files import DataInput, InputKind
from contracts.manifest import DataFormat, Manifest
from contracts.plans import Plan
from contracts.runs import Metrics, Outcome, StageStarted, TrainWork
from runtime.configuration import settings as settings_mod
from runtime.storage.tenant_files import LocalStore
from services.trainer.inputs import InputsUnavailable, materialize
from tests.support import THREADS
from training.engine.reporting import Recorder
from training.recipes.pipeline import localized, run_pipeline

ROWS = b"".join(json.dumps({"text": f"{i}+1={i + 1}"}).encode() + b"\n" for i in range(50))
FILE_ID = "file-" + "0a" * 12
DECON = {"method": "13-gram", "against": [], "provenance": "test"}


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_with(source: str, fmt: str | None = None) -> Manifest:
    ref = {"name": "mine", "source": source, "role": "train", "decontamination": DECON}
    if fmt:
        ref["format"] = fmt
    return msgspec.convert(
        {
            "name": "t",
            "model": {"size": "tiny", "revision": "r"},
            "data": [{"name": "sums", "source": "generated:arithmetic"}, ref],
            "target": {"tokens": 6 * 8 * 32, "seq_len": 32, "batch_size": 8},
            "stages": {"pretrain": {"data": ["sums", "mine"]}},
            "checkpoint": {"interval_steps": 4, "keep_last": 1},
            "budget_cap_usd": 1.0,
        },
        Manifest,
    )


def work_for(manifest: Manifest, *inputs: DataInput) -> TrainWork:
    plan = msgspec.convert(
        {
            "booking_id": "b",
            "manifest_digest": "d",
            "strategy": "single",
            "degrees": {},
            "precision": "bf16",
            "cost": {
                "flops": 1.0,
                "tokens": 1,
                "parameters": 1,
                "assumed_mfu": 0.4,
                "peak_tflops_per_gpu": 1.0,
                "gpus": 1,
                "gpu_hours": 0.0,
                "price_per_gpu_hour_usd": 0.0,
                "compute_usd": 0.0,
                "checkpoint_storage_usd": 0.0,
                "total_usd": 0.0,
                "booked_gpu_hours": 1.0,
                "incremental_usd": 0.0,
            },
            "checks": [],
            "ok": True,
        },
        Plan,
    )
    return TrainWork(
        run_id="run_x",
        account="acme",
        booking_id="b",
        manifest_text=msgspec.json.encode(manifest).decode(),
        manifest_digest="d",
        plan=plan,
        checkpoint_dir="",
        inputs=list(inputs),
    )


@pytest.fixture
def settings(tmp_path):
    (tmp_path / "file-root" / "acme").mkdir(parents=True)
    return settings_mod.load(
        {"ITO_DATA_DIR": str(tmp_path / "data"), "ITO_FILE_ROOT": str(tmp_path / "file-root")}
    )


def kept_upload(settings, data: bytes) -> None:
    store = LocalStore(settings.data_dir / "tenant-files")
    assert store.write("acme", "up-1", "corpus.jsonl", 0, data) == len(data)
    store.keep("acme", "up-1", "corpus.jsonl", FILE_ID)


def upload_input(data: bytes) -> DataInput:
    return DataInput(
        name="mine",
        kind=InputKind.upload,
        locator=FILE_ID,
        digest=sha(data),
        format=DataFormat.jsonl,
        bytes=len(data),
    )


def test_an_upload_is_copied_into_the_run_at_its_digest(settings, tmp_path):
    kept_upload(settings, ROWS)
    manifest = manifest_with(f"upload:{FILE_ID}")
    local = materialize(work_for(manifest, upload_input(ROWS)), manifest, tmp_path / "run", settings)
    path, fmt = local["mine"]
    assert path.read_bytes() == ROWS and fmt is DataFormat.jsonl
    assert path.parent == tmp_path / "run" / "inputs"


def test_an_upload_whose_bytes_changed_is_not_trained_on(settings, tmp_path):
    kept_upload(settings, ROWS.replace(b"+1", b"+2"))
    manifest = manifest_with(f"upload:{FILE_ID}")
    with pytest.raises(InputsUnavailable, match="changed since it was planned"):
        materialize(work_for(manifest, upload_input(ROWS)), manifest, tmp_path / "run", settings)
    assert list((tmp_path / "run" / "inputs").iterdir()) == []


def test_a_link_swapped_in_under_the_root_after_the_plan_is_not_followed(settings, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(ROWS)
    (settings.file_root / "acme" / "corpus.jsonl").symlink_to(secret)
    manifest = manifest_with(f"file:{settings.file_root}/acme/corpus.jsonl")
    item = DataInput(
        name="mine",
        kind=InputKind.file,
        locator="corpus.jsonl",
        digest=sha(ROWS),
        format=DataFormat.jsonl,
        bytes=len(ROWS),
    )
    with pytest.raises(InputsUnavailable, match="no longer readable"):
        materialize(work_for(manifest, item), manifest, tmp_path / "run", settings)


def test_a_tenant_ref_the_work_item_does_not_resolve_fails_the_run(settings, tmp_path):
    # a work item signed before inputs were carried names its file by path: never opened
    manifest = manifest_with(f"file:{settings.file_root}/acme/corpus.jsonl")
    (settings.file_root / "acme" / "corpus.jsonl").write_bytes(ROWS)
    with pytest.raises(InputsUnavailable, match="was not resolved by the scheduler"):
        materialize(work_for(manifest), manifest, tmp_path / "run", settings)


def test_the_pipeline_reads_no_tenant_ref_it_was_not_given_a_copy_of(tmp_path):
    manifest = manifest_with(f"upload:{FILE_ID}")
    with pytest.raises(ValueError, match="was not copied into the run"):
        run_pipeline(manifest, tmp_path, Recorder(), lambda: False, threads=THREADS)


def test_a_parquet_corpus_goes_through_data_prep_into_pretraining(tmp_path):
    docs = [f"Paragraph {i}: the river runs under the old stone bridge near mill {i}." for i in range(300)]
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": docs}), path)
    manifest = manifest_with(f"upload:{FILE_ID}")
    plan_local = {"mine": (path, DataFormat.parquet)}
    emit = Recorder()
    result = run_pipeline(
        manifest, tmp_path / "run", emit, lambda: False, threads=THREADS, local_inputs=plan_local
    )
    # it trained (six steps are too few to pass pretrain's gate; what matters is that they ran)
    assert result.outcome in (Outcome.succeeded, Outcome.gate_failed), result.summary
    assert [m.step for m in emit.of(Metrics) if m.stage == "pretrain"] == list(range(1, 7))
    assert [s.stage for s in emit.of(StageStarted)] == ["data_prep", "pretrain"]
    assert (tmp_path / "run" / "data_prep" / "01.jsonl").is_file()  # the survivors, as JSONL


def test_localized_points_each_tenant_ref_at_its_copy(tmp_path):
    from domain.curriculum import curriculum_of

    manifest = manifest_with(f"upload:{FILE_ID}")
    copy = tmp_path / "inputs" / "001.parquet"
    local_manifest, plan = localized(manifest, curriculum_of(manifest), {"mine": (copy, DataFormat.parquet)})
    (ref,) = [r for r in local_manifest.data if r.name == "mine"]
    assert (ref.source, ref.format) == (f"file:{copy}", DataFormat.parquet)
    assert plan.train_refs["mine"] == f"file:{copy}"

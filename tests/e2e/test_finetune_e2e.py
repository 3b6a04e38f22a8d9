"""Bring your model and data, take the model home, with real processes: the tenant uploads a tiny
Hugging Face checkpoint (`ecc ito models upload`) and chat JSONL (`ecc ito files upload`), sees
the model (`ecc ito models`), a manifest names it by digest and the files as `upload:<id>` (SFT on
`messages`, DPO on `prompt` / `chosen` / `rejected`, a chat eval split), and `ecc ito train`
fine-tunes it to `succeeded`: a Llama on one
process, a Qwen2 on a 2-rank FSDP2 gang with LoRA SFT then DPO (which starts from the merged model). Then `ecc ito export` + `ecc ito download`
give a directory that transformers loads with the trainer's logits (max abs diff <= 1e-4 fp32), and
the LoRA stage's PEFT adapter loads in peft."""

import importlib.util
import json
import pathlib
import sys

import pytest

from tests.conftest import start_stack
from tests.support import confirm_and_train, eventually, run_state

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300


def _assets():
    spec = importlib.util.spec_from_file_location("finetune_assets", REPO / "examples" / "finetune_assets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("finetune_assets", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services; the tiny model may be planned on several "GPUs" (CPU ranks) of a node."""
    s = start_stack(tmp_path_factory.mktemp("finetune-stack"), env={"ITO_PLAN_SMALL_MODEL_GANGS": "1"})
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


def _store(stack, env, tmp: pathlib.Path, family: str) -> tuple[str, str, dict]:
    """(model name, digest, data sources) of a fresh tiny `family` checkpoint and chat data, sent by
    the tenant itself: `ecc ito models upload` and `ecc ito files upload` (no operator step)."""
    fa = _assets()
    fa.write_base_model(tmp / "base", family)
    files = fa.write_chat_data(tmp / "data")
    name = f"tiny-{family}"
    rc, out = stack.ecc("models", "upload", str(tmp / "base"), "--name", name, env=env, timeout=240)
    assert rc == 0 and out["data"]["state"] == "ready", out
    digest = out["data"]["model"]["digest"]
    sources = {}
    for ref, key, purpose in (
        ("chat", "sft", "train"),
        ("prefs", "dpo", "train"),
        ("chat-eval", "eval", "eval"),
    ):
        rc, up = stack.ecc("files", "upload", str(files[key]), "--purpose", purpose, env=env)
        assert rc == 0 and up["data"]["state"] == "ready", up
        sources[ref] = up["data"]["file"]["source"]
    return name, digest, sources


def _manifest(tmp: pathlib.Path, name: str, digest: str, data: dict, **patch) -> pathlib.Path:
    fa = _assets()
    m = fa.finetune_manifest(
        REPO / "examples" / "manifests" / "finetune.json", base=name, revision=digest, sources=data
    )
    for key, value in patch.items():
        section, _, field = key.partition("__")
        if field:
            m[section][field] = {**m[section].get(field, {}), **value}
        else:
            m[section] = value
    path = tmp / "finetune.json"
    path.write_text(json.dumps(m))
    path.chmod(0o600)
    return path


def _export(stack, env, run_id: str, *args: str) -> dict:
    def ready():
        rc, out = stack.ecc("export", run_id, *args, env=env)
        assert rc == 0, out
        assert out["data"]["state"] != "failed", out["data"]["message"]
        return out["data"] if out["data"]["state"] == "ready" else None

    return eventually(ready, timeout=180, what="export ready")


def _our_logits(stack, account: str, run_id: str, name: str, manifest_path: pathlib.Path, ids, stage=None):
    """The trainer's model on the run's last committed checkpoint (as export and sample load it)."""
    import msgspec
    import torch

    from contracts.manifest import Manifest
    from runtime.storage.model_store import ModelStore
    from services.trainer import restore

    manifest = msgspec.json.decode(manifest_path.read_bytes(), type=Manifest)
    store_root = stack.data_dir / "models"
    base = ModelStore(store_root).resolve(name, account)
    run_dir = stack.data_dir / "checkpoints" / account / run_id
    ours, _ = restore.restore_model(restore.locate(run_dir, run_id, manifest, base, stage), store_root)
    with torch.no_grad():
        logits, _ = ours(ids)
    return logits.float()


def test_a_llama_fine_tunes_on_chat_jsonl_and_comes_out_for_transformers(stack, tmp_path):
    import torch
    import transformers

    account, _, env = stack.account()
    booking = stack.booking(account)
    name, digest, data = _store(stack, env, tmp_path, "llama")

    rc, listed = stack.ecc("models", env=env)
    assert rc == 0 and [m["digest"] for m in listed["data"]["models"] if m["name"] == name] == [digest]
    manifest_path = _manifest(tmp_path, name, digest, data)
    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", str(manifest_path), env=env)
    assert rc == 0 and plan["ok"], plan
    run_id = confirm_and_train(stack, env, booking, str(manifest_path), "finetune-llama")["data"]["run_id"]
    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    gates = {g["stage"]: g for g in final["gates"]}
    assert set(gates) >= {"sft", "dpo"} and all(g["passed"] for g in gates.values())
    sft_loss = next(m for m in gates["sft"]["metrics"] if m["name"] == "held_out_loss")
    assert (
        sft_loss["threshold"] is not None and sft_loss["value"] <= sft_loss["threshold"]
    )  # judged, not just shown

    rc, sample = stack.ecc(
        "sample", run_id, "--prompt", "What is 2+3?", "--chat", "--max-new-tokens", "4", env=env
    )
    assert rc == 0 and sample["ok"] and sample["data"]["stage"] == "dpo", sample

    view = _export(stack, env, run_id)
    assert view["export_id"] == "dpo-hf"
    out = tmp_path / "model"
    rc, done = stack.ecc("download", run_id, "--to", str(out), env=env, timeout=240)
    assert rc == 0 and done["data"]["digest"] == view["digest"], done
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    card = (out / "README.md").read_text()
    assert run_id in card and digest in card  # the model card names the run and the base model

    tok = transformers.AutoTokenizer.from_pretrained(out)  # the base model's tokenizer came along
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    mine = _our_logits(stack, account, run_id, name, manifest_path, ids)
    assert (theirs - mine).abs().max().item() <= 1e-4


def test_a_qwen2_fine_tunes_with_lora_then_dpo_on_a_two_rank_gang_and_its_adapter_loads_in_peft(
    stack, tmp_path
):
    import peft
    import torch
    import transformers

    account, _, env = stack.account()
    booking = stack.booking(account, gpus_per_node=8)
    name, digest, data = _store(stack, env, tmp_path, "qwen2")
    manifest_path = _manifest(
        tmp_path,
        name,
        digest,
        data,
        resources={"nodes": 1, "gpus_per_node": 2, "strategy": "fsdp2"},  # sharded, not replicated
        post_training={
            "recipe": ["sft", "dpo"],
            "dpo": {"steps": 10, "batch_size": 8, "learning_rate": 0.0001, "beta": 0.1, "data": ["prefs"]},
            "sft": {
                "steps": 20,
                "batch_size": 8,
                "learning_rate": 0.01,
                "data": ["chat"],
                "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
            },
        },
    )
    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", str(manifest_path), env=env)
    assert rc == 0 and plan["data"]["strategy"] == "fsdp2", plan
    run_id = confirm_and_train(stack, env, booking, str(manifest_path), "finetune-qwen2")["data"]["run_id"]
    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["parallelism"]["strategy"] == "fsdp2" and final["parallelism"]["world_size"] == 2, final

    view = _export(stack, env, run_id, "--stage", "sft", "--format", "peft")
    assert {f["path"] for f in view["files"]} >= {"adapter_config.json", "adapter_model.safetensors"}
    out = tmp_path / "adapter"
    rc, done = stack.ecc("download", run_id, "--export", view["export_id"], "--to", str(out), env=env)
    assert rc == 0, done
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([[1, 85, 91, 85, 2, 201, 1, 67]])
    with torch.no_grad():
        theirs = adapted(ids).logits.float()
    mine = _our_logits(stack, account, run_id, name, manifest_path, ids, stage="sft")
    assert (theirs - mine).abs().max().item() <= 1e-4

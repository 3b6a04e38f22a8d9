"""The plan of a fine-tune on the field's data: SFT and DPO on chat rows judged on a chat eval
split (a real gate, relative to the incoming model, not a reported number), and what the trainer
cannot train yet refused at plan time (a plan the scheduler accepts always runs)."""

import json
import pathlib

import msgspec
import pytest

from contracts.manifest import Manifest
from contracts.models import BaseModel, ModelShape
from domain import gates
from domain.curriculum import curriculum_of

TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests" / "finetune.json"
SHAPE = ModelShape(
    n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=176, vocab_size=512, max_seq_len=256, qk_norm=False
)
BASE = BaseModel(
    name="tiny-llama",
    digest="sha256:" + "ab" * 32,
    family="llama",
    architecture="LlamaForCausalLM",
    shape=SHAPE,
    parameters=1,
    tokenizer_vocab=512,
)


def _manifest(**patch) -> Manifest:
    m = json.loads(TEMPLATE.read_text())
    m["model"]["revision"] = BASE.digest
    for ref in m["data"]:
        ref["source"] = f"file:/data/{ref['name']}.jsonl"
    m["post_training"].update(patch)
    return msgspec.convert(m, Manifest)


def test_sft_and_dpo_on_chat_rows_are_gated_on_the_chat_eval_split():
    plan = curriculum_of(_manifest(), BASE)
    by_stage = {s.name: plan.rules(s) for s in plan.stages}
    (sft,) = [r for r in by_stage["sft"] if r.metric == "held_out_loss"]
    (dpo,) = [r for r in by_stage["dpo"] if r.metric == "held_out_loss"]
    assert (sft.op, sft.relative, sft.amount) == ("<=", "ratio", 1 - gates.SFT_MIN_IMPROVEMENT)
    assert (dpo.op, dpo.relative, dpo.amount) == ("<=", "ratio", 1 + gates.DPO_MAX_REGRESSION)
    assert gates.threshold(sft, 3.0) == pytest.approx(2.97)  # must fall below the base model's


def test_rlvr_on_rows_or_with_a_base_models_tokenizer_is_refused_at_plan_time():
    rlvr = {"recipe": ["rlvr"], "rlvr": {"data": ["chat"]}}
    with pytest.raises(ValueError, match="rlvr trains on the generated task refs"):
        curriculum_of(_manifest(**rlvr), BASE)

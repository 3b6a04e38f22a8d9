"""Every stage has a gate that can fail: the backend's battery with thresholds relative to the
stage's incoming model, which a manifest may tighten but never loosen or remove (tables)."""

import copy
import json
import pathlib

import msgspec
import pytest

from contracts.errors import ErrorCode
from contracts.manifest import Gate, LongContextGate, Manifest
from services.domain import gates
from services.domain.curriculum import plan_run
from services.runtime.codec import Refusal
from services.scheduler.manifests import digest_of, verify
from services.scheduler.planning import stage_gates

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"


@pytest.mark.parametrize(
    "stage, gate, incoming, expected",
    [
        ("pretrain", Gate(), {"held_out_loss": 5.5}, {"held_out_loss": 5.5 * 0.99}),
        (
            "pretrain",
            Gate(max_held_out_loss=2.0),
            {"held_out_loss": 5.5},
            {"held_out_loss": 2.0},
        ),  # tighter wins
        (
            "pretrain",
            Gate(max_held_out_loss=9.0),
            {"held_out_loss": 5.5},
            {"held_out_loss": 5.5 * 0.99},
        ),  # looser: default
        ("midtrain", Gate(), {"held_out_loss": 2.0}, {"held_out_loss": 2.2}),
        (
            "long_context",
            LongContextGate(),
            {"held_out_loss": 2.0, "short_context_loss": 1.5},
            {"held_out_loss": 2.2, "short_context_loss": 1.75},
        ),
        (
            "long_context",
            LongContextGate(max_short_loss_increase=0.1),
            {"held_out_loss": 2.0, "short_context_loss": 1.5},
            {"held_out_loss": 2.2, "short_context_loss": 1.6},
        ),
        ("sft", Gate(), {"task_accuracy": 0.40}, {"task_accuracy": 0.35}),
        ("rlvr", Gate(min_task_accuracy=0.5), {"task_accuracy": 0.40}, {"task_accuracy": 0.5}),
        ("dpo", Gate(min_task_accuracy=0.1), {"task_accuracy": 0.40}, {"task_accuracy": 0.35}),
    ],
)
def test_thresholds_are_relative_to_the_incoming_model_and_only_tightened(stage, gate, incoming, expected):
    rules = gates.rules(stage, gate, has_tasks=True, has_held_out=True)
    got = {r.metric: gates.threshold(r, incoming.get(r.metric)) for r in rules}
    assert got == pytest.approx(expected)


def test_every_stage_kind_has_a_gate_that_can_fail():
    for stage, gate in (
        ("pretrain", Gate()),
        ("midtrain", Gate()),
        ("long_context", LongContextGate()),
        ("sft", Gate()),
        ("dpo", Gate()),
        ("rlvr", Gate()),
    ):
        rules = gates.rules(stage, gate, has_tasks=True, has_held_out=True)
        assert rules and all(gates.threshold(r, 1.0) is not None for r in rules), stage


@pytest.mark.parametrize("increase, why", [(None, "cannot be removed"), (0.5, "loosens")])
def test_a_manifest_cannot_loosen_or_remove_a_gate(increase, why):
    doc = json.loads((EXAMPLES / "full.json").read_text())
    doc = copy.deepcopy(doc)
    doc["stages"]["long_context"]["gate"] = {"max_short_loss_increase": increase}
    text = json.dumps(doc)
    with pytest.raises(Refusal) as refused:
        verify(text, digest_of(text.encode()))
    assert refused.value.code is ErrorCode.manifest_invalid and why in refused.value.message


def test_plan_lists_every_stage_gate_with_its_thresholds():
    full = msgspec.json.decode((EXAMPLES / "full.json").read_bytes(), type=Manifest)
    listed = stage_gates(full)
    assert [g.stage for g in listed] == [s.name for s in plan_run(full).stages]
    assert all(g.rules for g in listed)
    pretrain = listed[0]
    assert pretrain.rules[0].startswith("held_out_loss <= 0.99 x the incoming model's")

"""Every stage has a gate that can fail: the backend's battery with thresholds relative to the
stage's incoming model, which a manifest may tighten but never loosen or remove (tables)."""

import copy
import json
import pathlib
import re

import msgspec
import pytest

from contracts.errors import ErrorCode
from contracts.manifest import Gate, LongContextGate, Manifest
from domain import gates
from domain.curriculum import curriculum_of
from runtime.messaging.codec import Refusal
from services.scheduler.manifests import digest_of, verify
from services.scheduler.planning import stage_gates

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"


@pytest.mark.parametrize(
    "stage, gate, incoming, expected",
    [
        # pretrain from scratch: a margin below the untrained model's, set by size
        ("pretrain", Gate(), {"held_out_loss": 5.5}, {"held_out_loss": 5.5 * 0.80}),
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
            {"held_out_loss": 5.5 * 0.80},
        ),  # looser: default
        # midtrain and long-context: no worse than before
        ("midtrain", Gate(), {"held_out_loss": 2.0}, {"held_out_loss": 2.0}),
        (
            "long_context",
            LongContextGate(),
            {"held_out_loss": 2.0, "short_context_loss": 1.5},
            {"held_out_loss": 2.0, "short_context_loss": 1.75},
        ),
        (
            "long_context",
            LongContextGate(max_short_loss_increase=0.1),
            {"held_out_loss": 2.0, "short_context_loss": 1.5},
            {"held_out_loss": 2.0, "short_context_loss": 1.6},
        ),
        # SFT: held-out loss on its eval split must improve; task accuracy must not drop
        (
            "sft",
            Gate(),
            {"task_accuracy": 0.40, "held_out_loss": 3.01},
            {"task_accuracy": 0.40, "held_out_loss": 3.01 * 0.99},
        ),
        (
            "rlvr",
            Gate(min_task_accuracy=0.5),
            {"task_accuracy": 0.40, "held_out_loss": 3.0},
            {"task_accuracy": 0.5},
        ),
        ("rlvr", Gate(), {"task_accuracy": 0.40}, {"task_accuracy": 0.40}),  # verifier pass rate
        # DPO: held-out preference accuracy above chance, a positive margin, loss at most +10 %
        (
            "dpo",
            Gate(min_task_accuracy=0.1),
            {"task_accuracy": 0.40, "held_out_loss": 2.0},
            {
                "task_accuracy": 0.40,
                "preference_accuracy": 0.5,
                "reward_margin": 0.0,
                "held_out_loss": 2.2,
            },
        ),
    ],
)
def test_thresholds_are_relative_to_the_incoming_model_and_only_tightened(stage, gate, incoming, expected):
    rules = gates.rules(stage, gate, has_tasks=True, has_held_out=True, size="tiny")
    got = {r.metric: gates.threshold(r, incoming.get(r.metric)) for r in rules}
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    "size, factor",
    [("tiny", 0.80), ("150M", 0.70), ("1B", 0.65), ("8B", 0.60), ("70B", 0.60), (None, 0.99)],
)
def test_pretrain_without_a_baseline_needs_a_margin_set_by_size(size, factor):
    """From scratch, the only baseline is the untrained model: 1 % under it (the issue's
    `1.6719 <= 5.5894`-style gate) said nothing; continued pretraining (size None: a base model)
    must still improve on the base model's."""
    [rule] = gates.rules("pretrain", Gate(), has_tasks=False, has_held_out=True, size=size)
    assert gates.threshold(rule, 10.0) == pytest.approx(10.0 * factor)
    assert gates.passes(10.0 * 0.99, rule.op, 10.0 * factor) is (size is None)


NO_WORSE = [  # (stage, metric, incoming value, a measured value just worse than it)
    ("pretrain", "held_out_loss", 5.0, 5.0001),
    ("midtrain", "held_out_loss", 2.0, 2.0001),
    ("long_context", "held_out_loss", 2.0, 2.0001),
    ("sft", "held_out_loss", 3.01, 3.0101),
    ("sft", "task_accuracy", 0.25, 0.2499),
    ("dpo", "task_accuracy", 0.25, 0.2499),
    ("dpo", "preference_accuracy", None, 0.5),
    ("dpo", "reward_margin", None, 0.0),
    ("rlvr", "task_accuracy", 0.25, 0.2499),
]


@pytest.mark.parametrize("stage, metric, incoming, worse", NO_WORSE)
def test_no_default_gate_passes_a_model_worse_than_before(stage, metric, incoming, worse):
    gate = LongContextGate() if stage == "long_context" else Gate()
    rules = {r.metric: r for r in gates.rules(stage, gate, has_tasks=True, has_held_out=True, size="tiny")}
    rule = rules[metric]
    bound = gates.threshold(rule, incoming)
    assert bound is not None and not gates.passes(worse, rule.op, bound)


@pytest.mark.parametrize(
    "rule, value, bound, incoming, label, expected",
    [
        (
            gates.Rule("held_out_loss", "<=", "ratio", 0.99, stage="sft"),
            7.34,
            2.9799,
            3.01,
            "the pretrain model",
            "held-out loss on the SFT eval split 7.3400 must be at most 2.9799 "
            "(1 % below the pretrain model's 3.0100): failed",
        ),
        (
            gates.Rule("held_out_loss", "<=", "ratio", 0.8, stage="pretrain"),
            1.6719,
            4.4715,
            5.5894,
            "the untrained model",
            "held-out loss 1.6719 must be at most 4.4715 (20 % below the untrained model's 5.5894): passed",
        ),
        (
            gates.Rule("task_accuracy", ">=", "delta", 0.0, stage="sft"),
            0.0,
            0.0,
            0.0,
            "the pretrain model",
            "task accuracy 0.0000 must be at least 0.0000 (the pretrain model's): passed",
        ),
        (
            gates.Rule("preference_accuracy", ">", "fixed", 0.5, stage="dpo"),
            0.5,
            0.5,
            None,
            "the sft model",
            "preference accuracy on held-out pairs 0.5000 must rise above 0.5000 (chance): failed",
        ),
        (
            gates.Rule("held_out_loss", "<=", "ratio", 0.8, absolute=2.0, stage="pretrain"),
            1.5,
            2.0,
            5.5,
            "the untrained model",
            "held-out loss 1.5000 must be at most 2.0000 (the manifest's bound): passed",
        ),
        (None, 6.62, None, None, "", "held-out loss on the eval text 6.6200: reported, not gated"),
    ],
)
def test_a_gate_says_in_words_what_it_compared(rule, value, bound, incoming, label, expected):
    got = gates.sentence(
        rule, value, bound, incoming, incoming_label=label, stage="sft", metric="general_held_out_loss"
    )
    assert got == expected
    assert not re.search(r"-0\.\d", got)  # never a bare negative threshold


@pytest.mark.parametrize(
    "train, held, finding",
    [(0.18, 1.67, True), (2.6, 2.4, False), (1.0, 1.99, False), (1.0, 2.0, True), (None, 1.0, False)],
)
def test_overfitting_is_a_finding(train, held, finding):
    got = gates.overfitting(train, held)
    assert (got is not None) is finding
    if finding:
        assert got is not None and got.startswith("overfitting: training loss") and f"{held:.4f}" in got


def test_every_stage_kind_has_a_gate_that_can_fail():
    for stage, gate in (
        ("pretrain", Gate()),
        ("midtrain", Gate()),
        ("long_context", LongContextGate()),
        ("sft", Gate()),
        ("dpo", Gate()),
        ("rlvr", Gate()),
    ):
        rules = gates.rules(stage, gate, has_tasks=True, has_held_out=True, size="tiny")
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
    assert [g.stage for g in listed] == [s.name for s in curriculum_of(full).stages]
    assert all(g.rules for g in listed)
    pretrain, midtrain = listed[0], listed[1]
    assert pretrain.rules[0].startswith("held-out loss must fall at least 20 % below the untrained model's")
    assert midtrain.rules[0].startswith("held-out loss must be no higher than the pretrain model's")
    sft = next(g for g in listed if g.stage == "sft")
    assert "held-out loss on the SFT eval split must fall at least 1 % below" in sft.rules[0]
    assert "task accuracy must not drop below the long_context model's" in sft.rules
    dpo = next(g for g in listed if g.stage == "dpo")
    assert dpo.rules[:2] == [
        "preference accuracy on held-out pairs must rise above 0.5",
        "reward margin on held-out pairs must rise above 0",
    ]
    assert not any(re.search(r"-\d", rule) for g in listed for rule in g.rules)

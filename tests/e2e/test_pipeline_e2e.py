"""Every stage through `ecc ito train`, and an eval gate nobody can pass, shown honestly."""

import json
import pathlib

import pytest

from tests.support import run_state

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]


def run_to_end(stack, env, account, manifest_path, key):
    booking = stack.booking(account)
    m = str(manifest_path)
    rc, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    assert rc == 0, conf
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        key,
        env=env,
    )
    assert rc == 0, out
    run_id = out["data"]["run_id"]
    return run_id, run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=300)


def test_a_manifest_with_every_stage_succeeds(stack, tmp_path):
    account, _, env = stack.account()
    path = tmp_path / "full.json"
    path.write_bytes((REPO / "examples" / "manifests" / "full.json").read_bytes())
    path.chmod(0o644)
    run_id, view = run_to_end(stack, env, account, path, "full-1")
    assert view["state"] == "succeeded", [
        (g["stage"], [m.get("sentence") for m in g.get("metrics", [])]) for g in view["gates"]
    ]
    stages = [g["stage"] for g in view["gates"]]
    for stage in ("pretrain", "midtrain", "long_context", "sft", "dpo", "rlvr"):
        assert stage in stages, stages
    assert all(g["passed"] for g in view["gates"] if g["stage"] != "ladder")
    steps = {s["name"]: s for s in view["provenance"]["steps"]}
    assert {"exact_dedup", "near_dedup", "decontamination"} <= set(steps)
    rc, evals = stack.ecc("evals", run_id, env=env)
    assert rc == 0 and [g["stage"] for g in evals["data"]["gates"]] == stages


def test_an_unreachable_gate_stops_the_run_in_gate_failed(stack, tmp_path):
    account, _, env = stack.account()
    raw = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    raw["target"] = {"tokens": 20 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    raw["stages"] = {"pretrain": {"gate": {"max_held_out_loss": 0.01}}}
    path = tmp_path / "strict.json"
    path.write_text(json.dumps(raw))
    path.chmod(0o644)
    _run_id, view = run_to_end(stack, env, account, path, "gate-1")
    assert view["state"] == "gate_failed", view
    (gate,) = [g for g in view["gates"] if g["stage"] == "pretrain"]
    (metric,) = [m for m in gate["metrics"] if m["name"] == "held_out_loss"]
    assert (
        gate["passed"] is False
        and metric["passed"] is False
        and metric["value"] > metric["threshold"] == 0.01
    )
    assert "held_out_loss" in view["message"] or str(round(metric["value"], 2))[:3] in view["message"]

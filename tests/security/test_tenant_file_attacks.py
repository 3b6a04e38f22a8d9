"""Attacks on the backend's files with a tenant's own key, on a real stack (issue 39): naming the
operator's NKey seed under the data dir as training data (which trained, and came back through
`ecc ito sample`), probing whether a path exists or what a file holds by its digest, and a manifest
that tries to make the trainer write its checkpoints anywhere. Each is refused from the
manifest's text, with the same answer whatever is on the disk, and nothing is created."""

import hashlib
import json
import pathlib

import pytest

pytestmark = pytest.mark.e2e
DECON = {"method": "13-gram", "against": [], "provenance": "test"}


def _with_ref(manifest, ref: dict, **changes) -> pathlib.Path:
    data = [
        {"name": "sums", "source": "generated:arithmetic", "decontamination": DECON},
        {"name": "stolen", "role": "train", "decontamination": DECON, **ref},
    ]
    return manifest(data=data, stages={"pretrain": {"data": ["sums", "stolen"]}}, **changes)


def test_a_tenant_cannot_train_on_read_or_probe_the_backends_files(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account)
    seed = stack.settings.secrets_dir / "nats" / "operator.nk"
    assert seed.is_file()
    right = "sha256:" + hashlib.sha256(seed.read_bytes()).hexdigest()
    other_root = stack.file_root("someone-else")
    (other_root / "theirs.jsonl").write_text(json.dumps({"text": "another tenant's rows"}) + "\n")
    targets = [seed, stack.data_dir / "secrets" / "nats" / "nothing.nk", other_root / "theirs.jsonl"]
    answers = set()
    for target in targets:
        for extra in ({}, {"format": "jsonl", "digest": right}, {"digest": "sha256:" + "0" * 64}):
            m = _with_ref(manifest, {"source": f"file:{target}", **extra})
            for verb in ("plan", "confirm"):
                args = ["--booking", booking, "--manifest", str(m)]
                if verb == "confirm":
                    args = ["--action", "train", *args]
                rc, out = stack.ecc(verb, *args, env=env)
                assert rc != 0 and not out["ok"], out
                answers.add((out["error"]["code"], out["error"]["message"]))
    # one answer for every path and digest: nothing tells what exists there or what it holds
    assert len(answers) == 1, answers
    ((code, message),) = answers
    assert code == "data_policy_violation" and str(stack.data_dir) not in message
    rc, runs = stack.ecc("runs", env=env)
    assert rc == 0 and runs["data"]["runs"] == []  # nothing was confirmed, nothing trained
    for path in (stack.data_dir / "checkpoints").rglob("*"):
        if path.is_file():
            assert seed.read_bytes() not in path.read_bytes()[:1_000_000], path


def test_checkpoint_storage_outside_the_operators_roots_is_refused_and_nothing_made(
    stack, manifest, tmp_path
):
    account, _, env = stack.account()
    booking = stack.booking(account)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    m = manifest(checkpoint={"interval_steps": 10, "keep_last": 1, "storage": str(elsewhere)})
    rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    assert rc != 0 and out["error"]["code"] == "checkpoint_storage_unavailable", out
    assert list(elsewhere.iterdir()) == []

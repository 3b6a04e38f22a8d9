"""`file:` data refs at plan time (services/scheduler/inputs.py with services/scheduler/data_facts.py),
on real files: a ref outside the account's root is refused from its text, with the same answer
whether or not anything is there (issue 39: a tenant named the operator's NKey seed under the data
dir and trained on it; "no readable file" against "is not the sha256" told a path that exists from
one that does not, and a guessed digest confirmed a file's content); inside the root a file is
opened from the root down (a link is no file), checked whole, and resolved into a DataInput."""

import asyncio
import hashlib
import json
import pathlib

import msgspec
import pytest

from contracts.errors import ErrorCode
from contracts.files import InputKind
from contracts.manifest import Manifest
from runtime.messaging.codec import Refusal
from services.scheduler.data_facts import DataFacts
from services.scheduler.inputs import ManifestInputs

REPO = pathlib.Path(__file__).resolve().parents[2]
DECON = {"method": "13-gram", "against": [], "provenance": "test"}


def manifest_with(ref: dict) -> Manifest:
    doc = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    doc["data"].append({"name": "mine", "role": "train", "decontamination": DECON, **ref})
    return msgspec.convert(doc, Manifest)


@pytest.fixture
def roots(tmp_path):
    file_root = tmp_path / "file-root"
    (file_root / "acme").mkdir(parents=True)
    secrets = tmp_path / "secrets" / "nats"
    secrets.mkdir(parents=True)
    (secrets / "operator.nk").write_text("SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PXHUJ5QYYD5XQ")
    inputs = ManifestInputs(
        None, None, DataFacts(file_root, tmp_path / "secrets", tmp_path / "spool"), str(file_root)
    )
    return tmp_path, file_root, inputs


def refusal_of(inputs: ManifestInputs, manifest: Manifest) -> Refusal:
    with pytest.raises(Refusal) as refused:
        asyncio.run(inputs.runnable(manifest, "acme"))
    return refused.value


def test_a_file_outside_the_accounts_root_gets_one_answer_whatever_is_there(roots):
    tmp, file_root, inputs = roots
    seed = tmp / "secrets" / "nats" / "operator.nk"
    right = "sha256:" + hashlib.sha256(seed.read_bytes()).hexdigest()
    answers = set()
    for path in (
        seed,
        tmp / "secrets" / "nats" / "missing.nk",
        file_root / "rival" / "x.txt",
        pathlib.Path("/etc/passwd"),
    ):
        for ref in (
            {"source": f"file:{path}"},
            {"source": f"file:{path}", "format": "jsonl", "digest": right},
        ):
            refused = refusal_of(inputs, manifest_with(ref))
            answers.add((refused.code, refused.message))
    assert len(answers) == 1
    ((code, message),) = answers
    assert code is ErrorCode.data_policy_violation and "file root" in message
    assert str(tmp) not in message


def test_with_no_file_root_file_refs_are_off(roots):
    tmp, file_root, _ = roots
    (file_root / "acme" / "a.txt").write_text("hello\n")
    off = ManifestInputs(None, None, DataFacts(None, tmp / "secrets", tmp / "spool"), None)
    refused = refusal_of(off, manifest_with({"source": f"file:{file_root / 'acme' / 'a.txt'}"}))
    assert refused.code is ErrorCode.data_policy_violation and "upload the file" in refused.message


def test_a_file_under_the_root_is_checked_and_resolved(roots):
    _, file_root, inputs = roots
    path = file_root / "acme" / "corpus" / "a.txt"
    path.parent.mkdir()
    path.write_text("the river runs under the bridge\n\nthe stone is old\n")
    runnable = asyncio.run(inputs.runnable(manifest_with({"source": f"file:{path}"}), "acme"))
    (item,) = runnable.inputs
    assert (item.name, item.kind, item.locator) == ("mine", InputKind.file, "corpus/a.txt")
    assert item.digest == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_link_in_the_root_is_no_file(roots):
    tmp, file_root, inputs = roots
    link = file_root / "acme" / "seed.txt"
    link.symlink_to(tmp / "secrets" / "nats" / "operator.nk")
    refused = refusal_of(inputs, manifest_with({"source": f"file:{link}"}))
    assert refused.code is ErrorCode.data_digest_mismatch and "no readable file" in refused.message


def test_a_text_file_that_is_not_utf8_fails_the_plan_at_its_line(roots):
    _, file_root, inputs = roots
    path = file_root / "acme" / "bad.txt"
    path.write_bytes(b"fine\nfine\nnot \xff fine\n")
    refused = refusal_of(inputs, manifest_with({"source": f"file:{path}"}))
    assert refused.code is ErrorCode.data_schema_invalid
    assert "line 3: not UTF-8 text (byte 0xff at column 5)" in refused.message

"""The curriculum the scheduler priced is the one the trainer trains (issue 29: the plan in the
signed work item). Its digest is the same in every process (sets and keys in a fixed order, whatever
the hash seed), changes with what the run trains, and binds the trainer's own plan to it."""

import os
import pathlib
import subprocess
import sys

import msgspec
import pytest

from contracts.manifest import Manifest
from domain.curriculum import (
    CurriculumMismatch,
    bound_curriculum,
    curriculum_digest,
    curriculum_of,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
PIPELINE = REPO / "examples" / "manifests" / "full.json"
DIGEST_IN_A_PROCESS = (
    "import msgspec, sys; from contracts.manifest import Manifest; "
    "from domain.curriculum import curriculum_digest, curriculum_of; "
    "m = msgspec.json.decode(open(sys.argv[1], 'rb').read(), type=Manifest); "
    "print(curriculum_digest(curriculum_of(m)))"
)


def _manifest(path: pathlib.Path, **changes) -> Manifest:
    raw = msgspec.json.decode(path.read_bytes())
    raw.update(changes)
    return msgspec.convert(raw, Manifest)


def test_the_digest_is_the_same_in_every_process_whatever_its_hash_seed(tmp_path):
    # a Curriculum holds a frozenset of the row files' names, whose order follows the process's
    # string hash seed: eight of them, so that a plain encoding differs between processes
    raw = msgspec.json.decode(PIPELINE.read_bytes())
    raw["data"] += [
        {"name": f"rows-{c}", "source": f"file:/data/{c}.jsonl", "role": "train"} for c in "abcdefgh"
    ]
    path = tmp_path / "rows.json"
    path.write_bytes(msgspec.json.encode(raw))
    assert len(curriculum_of(msgspec.convert(raw, Manifest)).row_refs) == 8
    seen = set()
    for seed in ("1", "2", "3", "4"):
        out = subprocess.run(
            [sys.executable, "-c", DIGEST_IN_A_PROCESS, str(path)],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        seen.add(out.stdout.strip())
    assert len(seen) == 1 and len(seen.pop()) == 64


def test_the_digest_changes_with_what_the_run_trains():
    base = _manifest(PIPELINE)
    raw = msgspec.json.decode(PIPELINE.read_bytes())
    longer = {**raw["target"], "tokens": raw["target"]["tokens"] * 2}
    assert curriculum_digest(curriculum_of(base)) != curriculum_digest(
        curriculum_of(_manifest(PIPELINE, target=longer))
    )


@pytest.mark.parametrize(
    ("signed", "refused"),
    [
        ("", False),  # an item signed before the digest was carried: the manifest's plan alone
        ("same", False),
        ("0" * 64, True),  # a scheduler of another version priced other stages
    ],
)
def test_the_trainer_trains_the_priced_curriculum_or_none(signed, refused):
    manifest = _manifest(PIPELINE)
    digest = curriculum_digest(curriculum_of(manifest)) if signed == "same" else signed
    if refused:
        with pytest.raises(CurriculumMismatch, match="otherwise than the scheduler priced them"):
            bound_curriculum(manifest, None, digest)
    else:
        assert bound_curriculum(manifest, None, digest) == curriculum_of(manifest)

"""The shipped JSON Schema is the one generated from the Manifest contract, and the example
manifests are valid against the contract."""

import json
import pathlib

import msgspec

from contracts.manifest import Manifest
from ops.main import manifest_schema

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"


def test_shipped_schema_is_current():
    shipped = (EXAMPLES / "manifest.schema.json").read_text()
    assert shipped == manifest_schema(), (
        "regenerate: ito-training manifest-schema > examples/manifests/manifest.schema.json"
    )


def test_schema_names_every_manifest_field_and_forbids_others():
    schema = json.loads(manifest_schema())
    manifest = schema["$defs"]["Manifest"]
    assert set(manifest["properties"]) == set(Manifest.__struct_fields__)
    assert manifest["additionalProperties"] is False


def test_example_manifests_decode():
    for path in EXAMPLES.glob("*.json"):
        if path.name != "manifest.schema.json":
            msgspec.json.decode(path.read_bytes(), type=Manifest)

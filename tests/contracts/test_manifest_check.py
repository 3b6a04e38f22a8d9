"""The manifest checked against its JSON Schema (contracts/manifest_check.py), as tables: every problem at
once with its path, line, column and allowed values; invalid JSON with its line and column; the
schema is msgspec's of the contract and uses only keywords the checker reads; the checker agrees
with the contract's decoder and with a reference JSON Schema validator; the server's refusal lists
every problem too."""

import copy
import json
import pathlib

import jsonschema
import msgspec
import pytest

from contracts import manifest_check
from contracts.errors import ErrorCode
from contracts.manifest import Manifest, ModelSize
from runtime.messaging.codec import Refusal
from services.scheduler.manifests import digest_of, verify

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"
TINY = json.loads((EXAMPLES / "tiny.json").read_text())


def changed(*edits) -> dict:
    """TINY with edits: (path, value) sets, (path, None-marker DELETE) removes."""
    doc = copy.deepcopy(TINY)
    for path, value in edits:
        node = doc
        for key in path[:-1]:
            node = node[key]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return doc


DELETE = object()
TWO_MISTAKES = changed((["epochs"], 3), (["target"], DELETE))


def problems_of(doc) -> list[manifest_check.Problem]:
    manifest, problems = manifest_check.check(json.dumps(doc, indent=2))
    assert (manifest is None) == bool(problems)
    return problems


def test_two_mistakes_are_both_reported_each_with_its_path_line_and_column():
    text = json.dumps(TWO_MISTAKES, indent=2)
    problems = problems_of(TWO_MISTAKES)
    assert [(p.path, p.message) for p in problems] == [
        ("$", "missing required field `target`"),
        ("$.epochs", "unknown field `epochs`"),
    ]
    lines = text.splitlines()
    epochs = problems[1]
    assert lines[epochs.line - 1][epochs.column - 1 :].startswith('"epochs"')
    assert "target" in epochs.allowed and "budget_cap_usd" in epochs.allowed
    assert (problems[0].line, problems[0].column) == (1, 1)


def test_invalid_json_gives_the_line_and_column_where_it_stops():
    text = '{\n  "name": "x",\n  "seed": 1,\n}\n'
    _, [problem] = manifest_check.check(text)
    assert (problem.line, problem.column) == (4, 1)
    assert manifest_check.message([problem]) == (
        "the manifest is not valid JSON: line 4, column 1: trailing comma in object"
    )


def test_a_bad_model_size_lists_the_valid_sizes():
    [problem] = problems_of(changed((["model", "size"], "13B")))
    assert problem.path == "$.model.size"
    assert set(problem.allowed) == {s.value for s in ModelSize} | {"null"}
    assert "allowed: " in problem.describe() and "150M" in problem.describe()


TABLE = [
    # id, document, (path, words in the message) of each problem in order
    ("valid", TINY, []),
    ("wrong-type", changed((["target", "tokens"], "many")), [("$.target.tokens", "expected an integer")]),
    ("float-for-int", changed((["seed"], 1.5)), [("$.seed", "expected an integer, got a number")]),
    ("bool-for-int", changed((["seed"], True)), [("$.seed", "got a boolean")]),
    ("below-minimum", changed((["target", "tokens"], 0)), [("$.target.tokens", "must be >= 1, got 0")]),
    ("bad-enum-in-list", changed((["data", 0, "role"], "test")), [("$.data[0].role", "is not allowed")]),
    ("literal", changed((["resources"], {"strategy": "zero3"})), [("$.resources.strategy", "not allowed")]),
    ("nullable-wrong-kind", changed((["model", "base"], 5)), [("$.model.base", "a string or null")]),
    ("too-long", changed((["name"], "x" * 300)), [("$.name", "at most 256 characters")]),
    ("empty-name", changed((["name"], "")), [("$.name", "at least 1 characters")]),
    ("not-an-array", changed((["data"], {})), [("$.data", "expected an array")]),
    ("nested-unknown", changed((["checkpoint", "keep_first"], 1)), [("$.checkpoint.keep_first", "unknown")]),
    ("not-an-object", ["a"], [("$", "expected an object (Manifest), got an array")]),
    (
        "three-at-once",
        changed((["seed"], "x"), (["data", 1, "weight"], 2), (["budget_cap_usd"], DELETE)),
        [("$", "`budget_cap_usd`"), ("$.data[1].weight", "unknown field"), ("$.seed", "expected an integer")],
    ),
]


@pytest.mark.parametrize("doc, expected", [r[1:] for r in TABLE], ids=[r[0] for r in TABLE])
def test_problems_table(doc, expected):
    problems = problems_of(doc)
    assert [p.path for p in problems] == [path for path, _ in expected]
    for p, (_, words) in zip(problems, expected, strict=True):
        assert words in p.message
        assert p.line >= 1 and p.column >= 1


@pytest.mark.parametrize("doc", [r[1] for r in TABLE], ids=[r[0] for r in TABLE])
def test_the_checker_agrees_with_the_contract_and_a_reference_validator(doc):
    """Valid for the checker exactly when msgspec decodes it and jsonschema accepts it (msgspec's
    integers are stricter than JSON Schema's: none of these rows has a 1.0)."""
    ours = not problems_of(doc)
    try:
        msgspec.convert(doc, Manifest)
        contract = True
    except msgspec.ValidationError:
        contract = False
    reference = jsonschema.Draft202012Validator(manifest_check.schema()).is_valid(doc)
    assert ours == contract == reference


def test_the_schema_is_the_contracts_and_uses_only_keywords_the_checker_reads():
    shipped = (EXAMPLES / "manifest.schema.json").read_text()
    assert shipped == manifest_check.schema_text(), (
        "regenerate: ito-training manifest-schema > examples/manifests/manifest.schema.json"
    )
    used: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                used.add(key)
                if key in ("properties", "$defs"):
                    for sub in value.values():
                        walk(sub)
                elif key not in ("default", "enum"):
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(shipped))
    assert used <= manifest_check.KNOWN_KEYWORDS, used - manifest_check.KNOWN_KEYWORDS


def test_every_example_manifest_is_valid():
    for path in EXAMPLES.glob("*.json"):
        if path.name != "manifest.schema.json":
            assert manifest_check.check(path.read_text()) == (
                msgspec.json.decode(path.read_bytes(), type=Manifest),
                [],
            ), path.name


def test_the_servers_refusal_lists_every_problem():
    text = json.dumps(TWO_MISTAKES, indent=2)
    with pytest.raises(Refusal) as refused:
        verify(text, digest_of(text.encode()))
    assert refused.value.code is ErrorCode.manifest_invalid
    assert "missing required field `target`" in refused.value.message
    assert "$.epochs (line " in refused.value.message


def test_the_servers_refusal_of_invalid_json_says_where():
    text = '{"name": "x",\n "seed": }'
    with pytest.raises(Refusal) as refused:
        verify(text, digest_of(text.encode()))
    assert "not valid JSON: line 2, column 10" in refused.value.message


# --- bounded in work (issue 39: 100,000 empty data entries took 11-27 s to refuse) ---


def test_100000_empty_data_entries_are_one_problem_the_data_lists_length():
    doc = changed((["data"], [{} for _ in range(100_000)]))
    [problem] = problems_of(doc)
    assert problem.path == "$.data"
    assert problem.message == "takes at most 256 items, has 100000"


def test_a_manifest_with_more_problems_than_the_bound_says_so_and_lists_the_first():
    bad = {"name": 1, "source": 2, "role": "wizard", "format": "csv", "verifier": 3}
    doc = changed((["data"], [bad] * 256))  # five mistakes an entry, 1,280 in all
    problems = problems_of(doc)
    assert len(problems) == manifest_check.MAX_FOUND
    assert [p.path for p in problems[:2]] == ["$.data[0].name", "$.data[0].source"]
    assert problems == sorted(problems, key=lambda p: (p.line, p.column))
    text = manifest_check.message(problems)
    assert text.startswith(f"invalid manifest, at least {manifest_check.MAX_FOUND} problems:\n")
    assert text.endswith(f"- ... and more (the check stops at {manifest_check.MAX_FOUND} problems)")
    assert text.count("\n- $.data[") == manifest_check.MAX_SHOWN


def test_lines_and_columns_of_many_problems_are_each_where_its_value_is():
    doc = changed((["data"], [{"name": i} for i in range(200)]))
    text = json.dumps(doc, indent=2)
    _, problems = manifest_check.check(text)
    lines = text.splitlines()
    names = [p for p in problems if p.path.endswith(".name")]
    assert len(names) == 200
    for p in names:  # each points at its own value
        index = int(p.path.split("[")[1].split("]")[0])
        assert lines[p.line - 1][p.column - 1 :].startswith(str(index))


def test_the_first_run_manifest_names_the_example_data_by_its_digest():
    """README's first run uploads examples/data/first-run.jsonl and its manifest names that upload
    by digest: a change to either keeps the other in step."""
    import hashlib

    data = (EXAMPLES.parent / "data" / "first-run.jsonl").read_bytes()
    doc = json.loads((EXAMPLES / "first-run.json").read_text())
    (ref,) = [r for r in doc["data"] if r["source"].startswith("upload:")]
    assert ref["source"] == "upload:sha256:" + hashlib.sha256(data).hexdigest()

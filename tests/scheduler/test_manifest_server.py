"""Server-side manifest verification (services/scheduler/manifests.py) and the secret scan.

Secret-looking samples are assembled at run time from pieces, so that this file itself holds no
credential-shaped literal; assertions compute "leaked" first so that no failure message echoes one.
"""

import copy
import json

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contracts.errors import ErrorCode
from contracts.manifest import Manifest
from runtime.messaging.codec import Refusal
from services.scheduler.manifests import MAX_MANIFEST_BYTES, digest_of, verify
from services.scheduler.secret_scan import MIN_MATCH_CHARS, PATTERNS, find_secret

VALID = {
    "name": "demo-run",
    "model": {"size": "tiny", "revision": "0123456789abcdef0123456789abcdef01234567"},
    "data": [
        {
            "name": "topics",
            "source": "builtin:pydoc_topics",
            "role": "train",
            "decontamination": {
                "method": "13-gram",
                "against": ["arith"],
                "provenance": "sha256:" + "ab" * 32,
            },
        },
        {"name": "arith", "source": "generated:arithmetic", "role": "eval"},
        {"name": "local", "source": "file:/srv/data/corpus.txt", "role": "eval"},
        {
            "name": "tasks",
            "source": "generated:arithmetic",
            "role": "train",
        },  # SFT trains on verifiable tasks
    ],
    "target": {"tokens": 100000, "seq_len": 64, "batch_size": 16, "learning_rate": 0.003},
    "post_training": {"recipe": ["sft"]},
    "checkpoint": {"interval_steps": 50, "keep_last": 2, "storage": "local"},
    "resources": {"nodes": 1, "gpus_per_node": 1, "region": "eu-west", "fabric": "infiniband"},
    "budget_cap_usd": 5.0,
    "max_incremental_cost_usd": 0.0,
    "seed": 1,
}
HERE = "https://example.com/data"  # a URL without credentials is not a secret


def text_of(doc) -> str:
    return json.dumps(doc, indent=2)


def verified(text: str):
    return verify(text, digest_of(text.encode()))


def refusal_of(text: str, digest: str | None = None) -> Refusal:
    with pytest.raises(Refusal) as info:
        verify(text, digest_of(text.encode()) if digest is None else digest)
    return info.value


# --- verify ---


def test_a_valid_manifest_verifies():
    text = text_of(VALID)
    manifest, digest = verified(text)
    assert manifest == msgspec.convert(VALID, Manifest)
    assert digest == digest_of(text.encode()) and len(digest) == 64


def test_whitespace_changes_the_digest_but_not_the_manifest():
    compact, pretty = json.dumps(VALID), text_of(VALID)
    (m1, d1), (m2, d2) = verified(compact), verified(pretty)
    assert m1 == m2 and d1 != d2


@pytest.mark.parametrize(
    "digest",
    ["0" * 64, digest_of(b"something else"), "", digest_of(text_of(VALID).encode()).upper()],
    ids=["zeros", "other-bytes", "empty", "uppercase-hex"],
)
def test_digest_mismatch(digest):
    assert refusal_of(text_of(VALID), digest).code is ErrorCode.manifest_digest_mismatch


def test_digest_is_over_the_utf8_bytes():
    text = text_of(VALID | {"name": "run-é-名前"})
    manifest, digest = verified(text)
    assert manifest.name == "run-é-名前" and digest == digest_of(text.encode("utf-8"))


def padded(total_bytes: int) -> str:
    """A valid manifest whose UTF-8 encoding is exactly total_bytes long (JSON whitespace at the end)."""
    text = text_of(VALID)
    text += " " * (total_bytes - len(text.encode()))
    assert len(text.encode()) == total_bytes
    return text


def test_exactly_one_mib_is_accepted():
    manifest, digest = verified(padded(MAX_MANIFEST_BYTES))
    assert manifest == msgspec.convert(VALID, Manifest) and digest == digest_of(
        padded(MAX_MANIFEST_BYTES).encode()
    )


def test_one_byte_over_one_mib_is_too_large():
    refusal = refusal_of(padded(MAX_MANIFEST_BYTES + 1))
    assert refusal.code is ErrorCode.manifest_too_large and str(MAX_MANIFEST_BYTES) in refusal.message


@pytest.mark.timeout(2)  # a liveness bound, not a speed target: a linear scan of 1 MiB takes milliseconds
def test_a_one_mib_manifest_with_a_long_string_is_scanned_without_hanging():
    base = text_of(with_change(["model", "revision"], ""))
    text = text_of(with_change(["model", "revision"], "a" * (MAX_MANIFEST_BYTES - len(base.encode()))))
    manifest, _ = verified(text)
    assert len(manifest.model.revision) > 1_000_000


def test_size_is_checked_before_the_digest():
    assert refusal_of(padded(MAX_MANIFEST_BYTES + 1), "0" * 64).code is ErrorCode.manifest_too_large


def test_size_cap_counts_bytes_not_characters():
    # 600k two-byte characters: 600k characters, 1.2 MB
    assert refusal_of(text_of(VALID | {"name": "é" * 600_000})).code is ErrorCode.manifest_too_large


def with_change(path: list, value) -> dict:
    doc = copy.deepcopy(VALID)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


INVALID_TABLE = [
    # id, document, text expected in the message (the field path, as msgspec names it)
    ("unknown-top-level-field", VALID | {"colour": "blue"}, "colour"),
    ("unknown-nested-field", with_change(["model", "flavour"], "x"), "$.model"),
    ("unknown-field-in-list-item", with_change(["data", 1, "weight"], 2), "$.data[1]"),
    ("wrong-type", with_change(["target", "tokens"], "many"), "$.target.tokens"),
    ("unknown-model-size", with_change(["model", "size"], "13B"), "$.model.size"),
    ("bad-fabric", with_change(["resources", "fabric"], "carrier-pigeon"), "$.resources.fabric"),
    ("missing-required", {k: v for k, v in VALID.items() if k != "budget_cap_usd"}, "budget_cap_usd"),
    ("not-an-object", ["a", "list"], "object"),
]


@pytest.mark.parametrize("doc, in_message", [r[1:] for r in INVALID_TABLE], ids=[r[0] for r in INVALID_TABLE])
def test_invalid_manifest_names_the_field(doc, in_message):
    refusal = refusal_of(text_of(doc))
    assert refusal.code is ErrorCode.manifest_invalid and in_message in refusal.message


def test_unknown_field_message_names_the_field_and_its_path():
    refusal = refusal_of(text_of(with_change(["checkpoint", "keep_first"], 1)))
    assert "keep_first" in refusal.message and "$.checkpoint" in refusal.message


@pytest.mark.parametrize(
    "text",
    ["", "not json", "{", '{"name": "x",}', "{'name': 'x'}", "\ufeff{}", "null garbage"],
    ids=["empty", "words", "truncated", "trailing-comma", "single-quotes", "bom", "trailing-garbage"],
)
def test_not_json_is_invalid(text):
    refusal = refusal_of(text)
    assert refusal.code is ErrorCode.manifest_invalid and "not valid JSON" in refusal.message


@pytest.mark.parametrize(
    "text", ["null", "0", '"text"', "[]", "{}"], ids=["null", "number", "string", "array", "empty-object"]
)
def test_json_that_is_not_a_manifest_is_invalid(text):
    assert refusal_of(text).code is ErrorCode.manifest_invalid


@pytest.mark.parametrize("depth", [5_000], ids=["depth-5000"])
def test_deeply_nested_json_is_refused_not_crashed(depth):
    text = "[" * depth + "]" * depth  # 10 KB
    assert refusal_of(text).code is ErrorCode.manifest_invalid


# --- secrets in the manifest ---


def aws_key_id() -> str:
    return "AKIA" + "Q7ZP3XK2M9VB4T6N"  # 4 + 16 uppercase letters and digits


def pem_block() -> str:
    marker = "PRIVATE KEY-----"
    return f"-----BEGIN RSA {marker}\nMIIEowIBAAKCAQEAq7\n-----END RSA {marker}"


def password_url() -> str:
    return "https://" + "alice" + ":" + "Hunter2-pw" + "@data.example.com/corpus.jsonl"


def github_token() -> str:
    return "ghp" + "_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


def aws_secret_assignment() -> str:
    return "aws_secret_access_key=" + "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "0123456789"


def jwt() -> str:
    return "eyJ" + "hbGciOiJIUzI1NiJ9" + ".eyJ" + "zdWIiOiIxMjM0In0" + "." + "abcdefghijk"


SECRET_SAMPLES = [
    # id, secret, kind named in the finding
    ("aws-access-key-id", aws_key_id(), "an AWS access key id"),
    ("pem-private-key", pem_block(), "a private key"),
    ("password-in-url", password_url(), "a password in a URL"),
    ("github-token", github_token(), "a GitHub token"),
    ("aws-secret-key", aws_secret_assignment(), "an AWS secret access key"),
    ("slack-token", "xox" + "b-" + "1234567890-abcdefghij", "a Slack token"),
    ("api-key", "sk" + "-proj-" + "A" * 24, "an API key"),
    ("ito-key", "ito_sk" + "_" + "Z" * 20, "an ito API key"),
    ("hugging-face-token", "hf" + "_" + "b" * 34, "a Hugging Face token"),
    ("google-api-key", "AIza" + "S" * 35, "a Google API key"),
    ("bearer-token", "Authorization: Bearer " + "t" * 24, "a bearer token"),
    ("jwt", jwt(), "a JSON web token"),
    ("assigned-password", "password=" + "correcthorse", "an assigned password or secret"),
]


@pytest.mark.parametrize("secret, kind", [r[1:] for r in SECRET_SAMPLES], ids=[r[0] for r in SECRET_SAMPLES])
@pytest.mark.parametrize(
    "where, path",
    [
        (["name"], "name"),
        (["data", 0, "source"], "data[0].source"),
        (["model", "revision"], "model.revision"),
    ],
    ids=["name", "data-source", "revision"],
)
def test_planted_secret_is_refused_without_echoing_it(secret, kind, where, path):
    refusal = refusal_of(text_of(with_change(where, f"prefix {secret} suffix")))
    assert refusal.code is ErrorCode.manifest_contains_secret
    assert kind in refusal.message and path in refusal.message
    leaked = secret in refusal.message or secret[:12] in refusal.message
    assert not leaked, "the refusal message must not contain the secret"


def test_secret_is_found_before_schema_validation():
    # an unknown field carrying a secret is reported as a secret, not as an unknown field with its value
    doc = VALID | {"notes": "deploy with " + github_token()}
    refusal = refusal_of(text_of(doc))
    assert refusal.code is ErrorCode.manifest_contains_secret and "notes" in refusal.message


@pytest.mark.parametrize(
    "field", ["password", "api_key", "Secret", "access-key", "private_key", "token", "credentials"]
)
def test_credential_named_field_is_refused(field):
    refusal = refusal_of(text_of(with_change(["resources", field], "whatever")))
    assert refusal.code is ErrorCode.manifest_contains_secret
    assert f"resources.{field}" in refusal.message and "whatever" not in refusal.message


# --- secret_scan on its own ---


@pytest.mark.parametrize("secret, kind", [r[1:] for r in SECRET_SAMPLES], ids=[r[0] for r in SECRET_SAMPLES])
def test_find_secret_names_the_kind(secret, kind):
    finding = find_secret({"a": [{"b": secret}]})
    assert finding == f"a[0].b looks like {kind}"


def test_every_pattern_has_a_sample():
    assert {kind for kind, _ in PATTERNS} == {kind for _, _, kind in SECRET_SAMPLES}


@pytest.mark.parametrize(
    "document, finding",
    [
        (VALID, None),
        ({"url": HERE, "n": 3, "ok": True, "none": None}, None),
        ({"tokens": 1000, "token_budget": "tokens: 1000000"}, None),  # "tokens" is a count, not a credential
        ({"digest": "sha256:" + "ab" * 32}, None),
        ({"note": "ssh-rsa public keys are fine"}, None),
        ({"Token": "x"}, "field Token is named like a credential"),
        ({"x": {"y": [0, {"password": 1}]}}, "field x.y[1].password is named like a credential"),
        (aws_key_id(), "the manifest looks like an AWS access key id"),
        ([HERE, password_url()], "[1] looks like a password in a URL"),
    ],
    ids=[
        "valid-manifest",
        "benign-scalars",
        "tokens-is-not-token",
        "digest",
        "public-key-mention",
        "field-name",
        "nested-field-name",
        "bare-string",
        "list-index-path",
    ],
)
def test_find_secret_table(document, finding):
    assert find_secret(document) == finding


def test_secret_used_as_a_key_is_found():
    finding = find_secret({"resources": {aws_key_id(): 1}})
    assert finding == "a key under resources looks like an AWS access key id"


@pytest.mark.parametrize(
    "secret",
    [aws_key_id(), github_token(), password_url()],
    ids=["aws-key-id", "github-token", "password-url"],
)
def test_secret_used_as_a_key_is_not_echoed(secret):
    refusal = refusal_of(text_of(with_change(["resources", secret], 1)))
    assert refusal.code is ErrorCode.manifest_contains_secret
    leaked = secret in refusal.message
    assert not leaked, "the refusal message must not contain the secret"


# --- properties: verify() answers every input with a Manifest or a Refusal, nothing else ---

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def check_outcome(text: str, client_digest: str | None = None) -> None:
    digest = digest_of(text.encode()) if client_digest is None else client_digest
    try:
        manifest, returned = verify(text, digest)
    except Refusal as refusal:
        assert isinstance(refusal.code, ErrorCode) and refusal.message
        event(f"refused: {refusal.code.value}")
        return
    event("accepted")
    # never passes silently: only a valid Manifest, with the digest of the exact bytes
    assert isinstance(manifest, Manifest)
    assert manifest == msgspec.json.decode(text.encode(), type=Manifest)
    assert returned == digest == digest_of(text.encode())


@FUZZ
@given(st.text(max_size=2000))
def test_arbitrary_text_is_a_manifest_or_a_refusal(text):
    check_outcome(text)


@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_are_a_manifest_or_a_refusal(data):
    check_outcome(data.decode("utf-8", errors="replace"))


@FUZZ
@given(st.text(max_size=200), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
def test_a_wrong_digest_is_always_refused(text, digest):
    if digest != digest_of(text.encode()):
        with pytest.raises(Refusal):
            verify(text, digest)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(JSON_VALUES)
def test_arbitrary_json_is_a_manifest_or_a_refusal(value):
    check_outcome(json.dumps(value))


def mutations():
    """The valid manifest with one field replaced by arbitrary JSON, removed, or one field added."""
    paths = [[k] for k in VALID] + [
        ["model", "size"],
        ["target", "tokens"],
        ["data", 0, "role"],
        ["data", 0, "decontamination"],
        ["resources", "nodes"],
        ["checkpoint", "storage"],
    ]
    replace = st.tuples(st.just("replace"), st.sampled_from(paths), JSON_VALUES)
    drop = st.tuples(st.just("drop"), st.sampled_from(paths), st.none())
    add = st.tuples(st.just("add"), st.text(max_size=12).map(lambda k: [k]), JSON_VALUES)
    return st.one_of(replace, drop, add)


@FUZZ
@given(mutations())
def test_mutated_manifests_are_a_manifest_or_a_refusal(mutation):
    op, path, value = mutation
    doc = copy.deepcopy(VALID)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if op == "drop":
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    check_outcome(json.dumps(doc))


def test_a_manifest_that_passed_is_not_parsed_and_scanned_again(monkeypatch):
    """The checks are a pure function of the bytes: remembered by the recomputed SHA-256."""
    from services.scheduler import manifests

    scans: list[int] = []
    real = manifests.find_secret
    monkeypatch.setattr(manifests, "find_secret", lambda value: scans.append(1) or real(value))
    monkeypatch.setattr(manifests, "_verified", manifests.OrderedDict())
    text = json.dumps({**VALID, "name": "cached-run"})
    first, digest = verify(text, digest_of(text.encode()))
    again, _ = verify(text, digest)
    assert again is first and len(scans) == 1
    other = json.dumps({**VALID, "name": "another-run"})
    verify(other, digest_of(other.encode()))
    assert len(scans) == 2  # other bytes are checked in full
    with pytest.raises(Refusal) as refused:  # a known digest never stands in for other bytes
        verify(other, digest)
    assert refused.value.code is ErrorCode.manifest_digest_mismatch


def test_a_refused_manifest_is_refused_every_time(monkeypatch):
    from services.scheduler import manifests

    monkeypatch.setattr(manifests, "_verified", manifests.OrderedDict())
    bad = json.dumps({**VALID, "model": {"size": "no-such-size"}})
    for _ in range(2):
        with pytest.raises(Refusal) as refused:
            verify(bad, digest_of(bad.encode()))
        assert refused.value.code is ErrorCode.manifest_invalid
    assert not manifests._verified


def test_the_shortest_matches_of_the_patterns_are_at_least_the_scans_floor():
    # the scan skips strings under MIN_MATCH_CHARS (issue 39: 200,000 short strings were each
    # searched 13 times); the shortest strings the patterns can match are that long
    shortest = {"a password in a URL": "a://b:c@", "an assigned password or secret": "pwd=abcdef"}
    for kind, text in shortest.items():
        assert len(text) >= MIN_MATCH_CHARS
        assert any(k == kind and p.search(text) for k, p in PATTERNS)


@given(st.text(alphabet="abcdkpswAKI_-:=/@.+ 0123456789", max_size=MIN_MATCH_CHARS - 1))
def test_no_pattern_matches_a_string_shorter_than_the_scans_floor(text):
    assert not any(p.search(text) for _, p in PATTERNS)

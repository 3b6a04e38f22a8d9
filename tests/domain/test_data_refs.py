"""What a data source names, from its text alone (domain/data_refs.py), as tables: the
kinds, an upload's id or digest, an s3:// object, a `file:` path below the account's root (and
the same answer for every path that is not: issue 39's existence oracle), a run's stage."""

import pytest

from domain import data_refs
from domain.data_refs import SourceKind

FILE_ID = "file-" + "0a" * 12
DIGEST = "sha256:" + "cd" * 32


@pytest.mark.parametrize(
    "source, kind, tenant",
    [
        ("builtin:pydoc_topics", SourceKind.builtin, False),
        ("generated:arithmetic", SourceKind.generated, False),
        (f"upload:{FILE_ID}", SourceKind.upload, True),
        ("s3://bucket/key.jsonl", SourceKind.s3, True),
        ("file:/data/a.txt", SourceKind.file, True),
        ("https://example.com/a", None, False),
        ("data.txt", None, False),
    ],
)
def test_the_kind_of_a_source(source, kind, tenant):
    assert data_refs.kind_of(source) is kind
    assert data_refs.is_tenant(source) is tenant


@pytest.mark.parametrize(
    "source, target",
    [
        (f"upload:{FILE_ID}", (FILE_ID, None)),
        (f"upload:{DIGEST}", (None, DIGEST)),
        ("upload:file-xyz", (None, None)),
        ("upload:../../etc/passwd", (None, None)),
        ("upload:sha256:abc", (None, None)),
    ],
)
def test_an_upload_names_one_of_the_accounts_files_by_id_or_digest(source, target):
    assert data_refs.upload_target(source) == target


@pytest.mark.parametrize(
    "source, target",
    [
        ("s3://my-bucket/corpora/chat.jsonl", ("my-bucket", "corpora/chat.jsonl")),
        ("s3://my-bucket/", None),
        ("s3://my-bucket", None),
        ("s3://B/key", None),  # not a bucket name
        ("s3://b/key\n", None),
    ],
)
def test_an_s3_source_names_a_bucket_and_a_key(source, target):
    assert data_refs.s3_target(source) == target


ROOT = "/srv/files"


@pytest.mark.parametrize(
    "source, root, relative",
    [
        ("file:/srv/files/acme/chat.jsonl", ROOT, "chat.jsonl"),
        ("file:/srv/files/acme/sub/chat.jsonl", ROOT + "/", "sub/chat.jsonl"),
        # everything else is refused on the text alone, whatever is there (issue 39: the seed file
        # under the data dir was read, and "no readable file" told a missing path from a present one)
        ("file:/srv/files/acme/chat.jsonl", None, None),  # no root configured: file: is off
        ("file:/srv/files/other/chat.jsonl", ROOT, None),  # another account's
        ("file:/srv/files/acme", ROOT, None),  # the root itself is no file
        ("file:/srv/files/acme/../other/x", ROOT, None),
        ("file:/srv/files/acme//x", ROOT, None),
        ("file:/data/secrets/nats/operator.nk", ROOT, None),
        ("file:/srv/files/acmex/chat.jsonl", ROOT, None),
        ("file:relative/chat.jsonl", ROOT, None),
    ],
)
def test_a_file_source_is_below_its_accounts_root_or_nothing(source, root, relative):
    assert data_refs.file_below_root(source, root, "acme") == relative


@pytest.mark.parametrize(
    "base, found",
    [
        ("run:run_" + "ab" * 12 + "/sft", ("run_" + "ab" * 12, "sft")),
        ("run:run_" + "ab" * 12 + "/long_context", ("run_" + "ab" * 12, "long_context")),
        ("run:run_1/sft", None),
        ("run:run_" + "ab" * 12 + "/../x", None),
        ("tiny-llama", None),
    ],
)
def test_a_run_base_names_a_run_and_a_stage(base, found):
    assert data_refs.run_base(base) == found

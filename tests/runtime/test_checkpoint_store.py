"""The checkpoint store's URL switch: a tiny DCP checkpoint saved and loaded through s3:// on a
local S3-compatible server (moto's, started here on a free loopback port), and through a shared
filesystem path; an export tree copied there; URLs that are neither refused."""

import pathlib

import pytest
import torch

from devstack.infra import free_port
from runtime.storage import checkpoint_store as cs


@pytest.fixture(scope="module")
def s3_env():
    boto3 = pytest.importorskip("boto3")
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        cs.ENV_S3_ENDPOINT_URL: f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",  # moto's server takes any; a real store reads these or a 0600 file
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        boto3.client("s3", endpoint_url=env[cs.ENV_S3_ENDPOINT_URL]).create_bucket(Bucket="ckpt")
        yield env
    server.stop()


def tiny_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "step": torch.tensor(7)}


def zeroed(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": torch.tensor(0)}


def assert_same(a: dict, b: dict) -> None:
    assert a["step"].item() == b["step"].item()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_a_dcp_checkpoint_round_trips_through_s3(s3_env, tmp_path):
    store = cs.run_url(cs.parse("s3://ckpt/prod/checkpoints", tmp_path), "acct1", "run-1").join("step-7")
    assert str(store) == "s3://ckpt/prod/checkpoints/acct1/run-1/step-7"
    state = tiny_state()
    cs.save(state, store, s3_env)
    back = zeroed(state)
    cs.load(back, store, s3_env)
    assert_same(state, back)
    import boto3

    keys = {
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_env[cs.ENV_S3_ENDPOINT_URL]).list_objects_v2(
            Bucket="ckpt"
        )["Contents"]
    }
    assert "prod/checkpoints/acct1/run-1/step-7/.metadata" in keys  # DCP's own layout, in the bucket
    assert not any((tmp_path).rglob("*"))  # nothing went to the local directory


def test_an_export_tree_is_copied_to_s3(s3_env, tmp_path):
    export = tmp_path / "export"
    (export / "tokenizer").mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"w" * 100)
    (export / "tokenizer" / "tokenizer.json").write_text("{}")
    store = cs.parse("s3://ckpt/exports/acct1/run-1", tmp_path)
    assert cs.upload_tree(export, store, s3_env) == ["model.safetensors", "tokenizer/tokenizer.json"]
    import s3fs

    fs = s3fs.S3FileSystem(**cs.storage_options(s3_env))
    assert fs.cat_file("ckpt/exports/acct1/run-1/model.safetensors") == b"w" * 100


def test_a_dcp_checkpoint_round_trips_through_a_shared_path(tmp_path):
    shared = tmp_path / "nfs"
    store = cs.parse(f"file://{shared}", tmp_path / "local").join("acct1", "run-1")
    state = tiny_state()
    cs.save(state, store)
    back = zeroed(state)
    cs.load(back, store)
    assert_same(state, back)
    assert (shared / "acct1" / "run-1" / ".metadata").is_file()


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("", ("file", "/srv/ito/checkpoints")),
        ("/mnt/nfs/ckpt", ("file", "/mnt/nfs/ckpt")),
        ("file:///mnt/nfs/ckpt/", ("file", "/mnt/nfs/ckpt")),
        ("s3://bucket", ("s3", "bucket")),
        ("s3://bucket/a/b/", ("s3", "bucket/a/b")),
        ("relative/dir", None),
        ("s3:///no-bucket", None),
        ("gs://bucket/x", None),
        ("http://example/x", None),
        ("file://host/x", None),
    ],
)
def test_the_url_switch(url, want):
    local = pathlib.Path("/srv/ito/checkpoints")
    if want is None:
        with pytest.raises(ValueError, match="ITO_CHECKPOINT_URL"):
            cs.parse(url, local)
    else:
        store = cs.parse(url, local)
        assert (store.scheme, store.root) == want


@pytest.mark.parametrize("part", ["", "..", "a/b", "."])
def test_a_path_part_cannot_climb_or_nest(part):
    with pytest.raises(ValueError):
        cs.parse("s3://bucket/x", pathlib.Path("/l")).join(part)


def test_the_settings_refuse_a_checkpoint_url_they_cannot_use(tmp_path):
    from runtime.configuration import settings

    env = {settings.ENV_DATA_DIR: str(tmp_path)}
    assert settings.load(env).checkpoint_url == ""
    assert settings.load({**env, cs.ENV_CHECKPOINT_URL: "s3://b/p"}).checkpoint_url == "s3://b/p"
    with pytest.raises(ValueError, match="ITO_CHECKPOINT_URL must be"):
        settings.load({**env, cs.ENV_CHECKPOINT_URL: "gs://b/p"})

"""Where checkpoints and exports may also live: a local path or an S3-compatible object store,
chosen by the scheme of one setting (`ITO_CHECKPOINT_URL`), and torch DCP's storage writer and
reader for it.

What it owns:
- `StoreUrl` and `parse`: `""` (the service's own `<data dir>/checkpoints`), an absolute path or
  `file:///path` (a shared filesystem: NFS, CephFS...), or `s3://bucket/prefix`; anything else is
  refused with a plain sentence.
- `run_url`: `<root>/<account>/<run_id>`, as runtime/storage/checkpoint_paths.py derives it: the
  account and run id come from the service's own records, never from a message.
- `writer` / `reader`: DCP's `FileSystemWriter`/`FileSystemReader` for a path, its fsspec ones
  (`FsspecWriter`/`FsspecReader`, s3fs) for `s3://`; `save` / `load`: a state dict through them.
- `upload_tree`: a finished export (a directory of files) copied under a URL.

Credentials for S3 never go through here: s3fs reads the standard AWS variables or a shared
credentials file (`AWS_SHARED_CREDENTIALS_FILE`, a 0600 file). The endpoint of a store that is not
AWS (MinIO, Ceph RGW, R2...) is `ITO_S3_ENDPOINT_URL`.

The trainer's own commit protocol (markers, pins, pruning: training/engine/checkpoint_dir.py) still
runs on a filesystem path; `s3://` serves as the store a run's committed checkpoints and exports are
copied to and read back from (docs/deploy.md).
"""

import os
import pathlib
from typing import Any

from runtime.configuration.settings import ENV_CHECKPOINT_URL, ENV_S3_ENDPOINT_URL, StoreUrl, parse

# the URL and its parse are a setting's (runtime/configuration/settings.py); the store re-exports them
__all__ = ["ENV_CHECKPOINT_URL", "ENV_S3_ENDPOINT_URL", "StoreUrl", "parse", "run_url"]


def from_env(local: pathlib.Path, env: dict[str, str] | None = None) -> StoreUrl:
    env = dict(os.environ) if env is None else env
    return parse(env.get(ENV_CHECKPOINT_URL, ""), local)


def run_url(store: StoreUrl, account: str, run_id: str) -> StoreUrl:
    return store.join(account, run_id)


def storage_options(env: dict[str, str] | None = None) -> dict[str, Any]:
    """s3fs's options: only the endpoint (credentials: the AWS variables or credentials file)."""
    env = dict(os.environ) if env is None else env
    endpoint = env.get(ENV_S3_ENDPOINT_URL, "")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def writer(store: StoreUrl, env: dict[str, str] | None = None) -> Any:
    if store.remote:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(str(store), **storage_options(env))
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(store.root)


def reader(store: StoreUrl, env: dict[str, str] | None = None) -> Any:
    if store.remote:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(store), **storage_options(env))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(store.root)


def save(state: dict[str, Any], store: StoreUrl, env: dict[str, str] | None = None) -> None:
    """`state` as a DCP checkpoint at `store` (one process: no process group needed)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=writer(store, env), no_dist=True)


def load(state: dict[str, Any], store: StoreUrl, env: dict[str, str] | None = None) -> None:
    """The DCP checkpoint at `store` into `state`, in place (its tensors give shapes and dtypes)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=reader(store, env), no_dist=True)


def upload_tree(local_dir: pathlib.Path, store: StoreUrl, env: dict[str, str] | None = None) -> list[str]:
    """Every file under `local_dir` copied to the same relative path under `store`; the relative
    paths copied, sorted. A path store gets a plain copy."""
    import fsspec

    if store.remote:
        fs = fsspec.filesystem("s3", **storage_options(env))
    else:
        fs = fsspec.filesystem("file")
    copied = []
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(local_dir).as_posix()
        target = f"{store.root}/{rel}"
        if not store.remote:
            fs.makedirs(os.path.dirname(target), exist_ok=True)
        fs.put_file(str(path), target)
        copied.append(rel)
    return copied

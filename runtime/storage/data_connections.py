"""Named connections: how the backend reaches a tenant's own bucket with a credential the backend
holds, so that a manifest names `s3://bucket/key` and `connection: NAME`, and nothing secret ever
travels in a manifest, an argument, a log line or an answer.

The operator makes one (`ito-training connections add NAME --account A --secret-file F`): the
secret is read from a 0600 file (JSON: `access_key_id`, `secret_access_key`, optionally
`session_token`) and kept, with the endpoint and region, in `<secrets dir>/connections/<account>/
<name>.json`, 0600 under 0700 (runtime/security/secrets.py's rules). A tenant sees its
connections' names, kinds and endpoints (`ecc ito connections`), never their secrets; another
account's name is not found, like one that does not exist. The scheduler reads a connection to
check a ref at plan time, the trainer to read the object; both through `endpoint_of`.
"""

import json
import os
import pathlib
import re

import msgspec

from contracts.files import ConnectionView
from runtime.security.secrets import SecretError, read_private, write_once
from runtime.storage.s3_objects import Endpoint

CONNECTIONS_DIR = "connections"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
KINDS = ("s3",)


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    """A connection as kept (0600): never encoded into anything that leaves the backend."""

    kind: str = "s3"
    endpoint_url: str = ""
    region: str = ""
    access_key_id: str
    secret_access_key: str
    session_token: str = ""

    def __repr__(self) -> str:
        return f"Stored(kind={self.kind!r}, endpoint_url={self.endpoint_url!r})"


_stored_decoder = msgspec.json.Decoder(Stored)


class BadConnection(ValueError):
    """A connection that cannot be made or read; the message names it, never its secret."""


def _path(secrets_dir: pathlib.Path, account: str, name: str) -> pathlib.Path:
    if not NAME.fullmatch(name):
        raise BadConnection(f"connection names are 1-64 letters, digits, '.', '_' or '-', got {name!r}")
    return secrets_dir / CONNECTIONS_DIR / account / f"{name}.json"


def add(
    secrets_dir: pathlib.Path,
    account: str,
    name: str,
    secret_file: pathlib.Path,
    *,
    endpoint_url: str = "",
    region: str = "",
    replace: bool = False,
) -> ConnectionView:
    """Keep a connection for `account`; the secret comes from `secret_file` (0600, JSON)."""
    path = _path(secrets_dir, account, name)
    try:
        secret = json.loads(read_private(secret_file))
    except SecretError as exc:
        raise BadConnection(str(exc)) from None
    except ValueError:
        raise BadConnection(f"{secret_file} is not JSON with access_key_id and secret_access_key") from None
    if not isinstance(secret, dict) or not secret.get("access_key_id") or not secret.get("secret_access_key"):
        raise BadConnection(f"{secret_file} needs access_key_id and secret_access_key")
    stored = Stored(
        endpoint_url=endpoint_url,
        region=region,
        access_key_id=str(secret["access_key_id"]),
        secret_access_key=str(secret["secret_access_key"]),
        session_token=str(secret.get("session_token") or ""),
    )
    if path.exists() and not replace:
        raise BadConnection(f"account {account} has a connection {name} already (--replace changes it)")
    for directory in (secrets_dir / CONNECTIONS_DIR, path.parent):  # the secrets dir's rule: 0700
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
    tmp = path.with_suffix(".new")
    tmp.unlink(missing_ok=True)
    write_once(tmp, msgspec.json.encode(stored))
    os.replace(tmp, path)
    return view(name, stored)


def remove(secrets_dir: pathlib.Path, account: str, name: str) -> bool:
    path = _path(secrets_dir, account, name)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def view(name: str, stored: Stored) -> ConnectionView:
    return ConnectionView(name=name, kind=stored.kind, endpoint=stored.endpoint_url, region=stored.region)


def _read(path: pathlib.Path) -> Stored | None:
    try:
        return _stored_decoder.decode(read_private(path))
    except (SecretError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def listed(secrets_dir: pathlib.Path, account: str) -> list[ConnectionView]:
    """The account's connections, by name (never a secret)."""
    directory = secrets_dir / CONNECTIONS_DIR / account
    if not directory.is_dir():
        return []
    out = []
    for path in sorted(directory.glob("*.json")):
        stored = _read(path)
        if stored is not None:
            out.append(view(path.stem, stored))
    return out


def endpoint_of(secrets_dir: pathlib.Path, account: str, name: str) -> Endpoint | None:
    """How to reach the store of `account`'s connection `name`, or None (not this account's, or not
    there: the same answer)."""
    try:
        stored = _read(_path(secrets_dir, account, name))
    except BadConnection:
        return None
    if stored is None:
        return None
    return Endpoint(
        endpoint_url=stored.endpoint_url,
        region=stored.region,
        access_key_id=stored.access_key_id,
        secret_access_key=stored.secret_access_key,
        session_token=stored.session_token,
    )

"""Where `ecc` finds the ito-training API, and the connection file `ito-training up` writes for it.

The address comes from, first to last:
1. `ITO_NATS_URL` (and `ITO_NAMESPACE`) in the environment: always wins, and the file is not read;
2. the connection file: `$ECC_CONNECTION_FILE`, else `connection.json` beside the stored login
   (`$ECC_CONFIG_DIR`, default ~/.config/ecc), which `ito-training up` writes for the stack it
   started;
3. the default, nats://127.0.0.1:4222.

`Resolved.source` says which, so that every connection error can name the address it tried, where
that address came from, and the one thing to set. The file holds no secret; it is written 0600 in
a 0700 directory anyway, like the credential beside it.
"""

import os
import pathlib
from dataclasses import dataclass

import msgspec

from contracts.connection import Connection

# The names and defaults the services read too (contracts/environment.py): the client imports no service.
from contracts.environment import DEFAULT_NAMESPACE, DEFAULT_NATS_URL, ENV_NAMESPACE, ENV_NATS_URL
from ecc import credentials

ENV_CONNECTION_FILE = "ECC_CONNECTION_FILE"
FILE_NAME = "connection.json"

_decoder = msgspec.json.Decoder(Connection)
_encoder = msgspec.json.Encoder()


class ConnectionFileInvalid(Exception):
    """The connection file exists but is not one: its path and why, safe to show."""


@dataclass(frozen=True, slots=True)
class Resolved:
    connection: Connection
    source: str  # where the URL came from, in words: "ITO_NATS_URL", "the connection file ...", "the default"
    file: pathlib.Path  # the connection file consulted (present or not)

    @property
    def url(self) -> str:
        return self.connection.url

    @property
    def namespace(self) -> str:
        return self.connection.namespace

    def what_to_set(self) -> str:
        """The one thing to do so that `ecc` finds the API, for the source this address came from."""
        if self.source == ENV_NATS_URL:
            other = (
                f"unset it to use the stack {self.file} names"
                if self.file.exists()
                else f"unset it after `make up`, which writes {self.file}"
            )
            return f"set {ENV_NATS_URL} to the API's address (`ito-training up` prints it), or {other}"
        if self.source == "the default":
            return (
                f"no connection file at {self.file}: start the stack with `make up` (it writes one), "
                f"or set {ENV_NATS_URL} to the API's address"
            )
        return (
            f"is the stack that wrote {self.file} still up? Start it with `make up` (it rewrites the "
            f"file), or set {ENV_NATS_URL} to the API's address"
        )


def path() -> pathlib.Path:
    """The connection file: `$ECC_CONNECTION_FILE`, else beside the stored login."""
    named = os.environ.get(ENV_CONNECTION_FILE)
    return pathlib.Path(named) if named else credentials.config_dir() / FILE_NAME


def load(file: pathlib.Path) -> Connection | None:
    """The file's connection; None when there is no file; ConnectionFileInvalid when it is not one."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConnectionFileInvalid(f"cannot read the connection file {file}: {exc.strerror}") from None
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConnectionFileInvalid(
            f"the connection file {file} is not valid ({exc}); run `ito-training up` again or remove it"
        ) from None


def resolve() -> Resolved:
    """The connection `ecc` uses now (see the module's order); ConnectionFileInvalid when the file
    it would read is broken. `ITO_NATS_URL` wins whole: with it set, the file is not read at all."""
    file = path()
    env_url = os.environ.get(ENV_NATS_URL)
    env_ns = os.environ.get(ENV_NAMESPACE)
    if env_url:
        return Resolved(Connection(url=env_url, namespace=env_ns or DEFAULT_NAMESPACE), ENV_NATS_URL, file)
    stored = load(file)
    if stored is not None:
        if env_ns:
            stored = msgspec.structs.replace(stored, namespace=env_ns)
        return Resolved(stored, f"the connection file {file}", file)
    return Resolved(
        Connection(url=DEFAULT_NATS_URL, namespace=env_ns or DEFAULT_NAMESPACE), "the default", file
    )


def save(connection: Connection, file: pathlib.Path | None = None) -> pathlib.Path:
    """Write the connection file (0600, atomically); its path."""
    target = file or path()
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = target.with_name(target.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(_encoder.encode(connection) + b"\n")
    os.replace(tmp, target)
    return target


def remove_if_points_at(url: str, file: pathlib.Path | None = None) -> bool:
    """Remove the connection file if it still names `url` (the stack going down); a file another
    `up` rewrote since, or one a person wrote for another API, is left alone."""
    target = file or path()
    try:
        stored = load(target)
    except ConnectionFileInvalid:
        return False
    if stored is None or stored.url != url:
        return False
    target.unlink(missing_ok=True)
    return True


def export_line(file: pathlib.Path) -> str:
    """The one line another shell (another HOME or ECC_CONFIG_DIR) needs to find the same stack."""
    import shlex

    return f"export {ENV_CONNECTION_FILE}={shlex.quote(str(file))}"

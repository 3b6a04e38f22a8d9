"""The secrets directory: every identity's credential, one 0600 file each, under a 0700 directory.

Layout (`ITO_SECRETS_DIR`, default `<data dir>/secrets`):
- `nats/<identity>.nk`: the identity's NATS nkey seed (challenge-response: the seed never crosses
  the wire; the server config holds only the public key);
- `redis/<identity>.pw`: the identity's Redis ACL password (the ACL file holds only its SHA-256);
- `signing/scheduler.ed25519`: the scheduler's Ed25519 seed; it signs work items, cancel notices
  and internal requests. `signing/scheduler.pub` is the public half that verifiers read;
- `tokens/<name>.token`: bearer tokens of the HTTP endpoints (`desk`: the desk app's operator
  token; `metrics`: the one every `/metrics` endpoint asks for, runtime/messaging/metrics.py, in a
  file of its own so that Prometheus can read it: `authorization: {credentials_file: ...}`).

Nothing here is ever logged, put in an argument, an event or an answer. Files are created with
O_EXCL at mode 0600, so a second writer cannot swap one in; a file with group or other bits set is
refused when read.
"""

import os
import pathlib
import secrets as _random

SEED_DIR = "nats"
PASSWORD_DIR = "redis"
SIGNING_DIR = "signing"
SCHEDULER_SIGNING_KEY = "scheduler.ed25519"
SCHEDULER_VERIFY_KEY = "scheduler.pub"
TOKEN_DIR = "tokens"
DESK_TOKEN = "desk"  # the desk app's operator token (services/desk/web.py)
METRICS_TOKEN = "metrics"  # every service's /metrics (runtime/messaging/metrics.py)
TOKENS = (DESK_TOKEN, METRICS_TOKEN)


class SecretError(Exception):
    """A secret file is missing or unsafe; the message names the file, never its content."""


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_once(path: pathlib.Path, data: bytes, mode: int = 0o600) -> bool:
    """Write `data` to a new file at `mode`; an existing file is kept. Returns whether it wrote."""
    _private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def read_private(path: pathlib.Path) -> bytes:
    """A secret's bytes; refused when the file is missing or readable by group or others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        raise SecretError(f"secret file {path} is missing or not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise SecretError(f"secret file {path} must have mode 0600, has {oct(mode)}")
        return f.read().strip()


def new_nkey_seed() -> bytes:
    import nkeys

    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)


def nkey_public(seed: bytes) -> str:
    import nkeys

    return nkeys.from_seed(bytearray(seed)).public_key.decode()


class Secrets:
    """Reads and creates the credentials under one directory."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root

    def seed_path(self, identity: str) -> pathlib.Path:
        return self.root / SEED_DIR / f"{identity}.nk"

    def password_path(self, identity: str) -> pathlib.Path:
        return self.root / PASSWORD_DIR / f"{identity}.pw"

    def token_path(self, name: str) -> pathlib.Path:
        return self.root / TOKEN_DIR / f"{name}.token"

    def token(self, name: str) -> str:
        return read_private(self.token_path(name)).decode()

    def seed(self, identity: str) -> bytes:
        return read_private(self.seed_path(identity))

    def password(self, identity: str) -> str:
        return read_private(self.password_path(identity)).decode()

    def public_nkey(self, identity: str) -> str:
        return nkey_public(self.seed(identity))

    def metrics_token_path(self) -> pathlib.Path:
        return self.token_path(METRICS_TOKEN)

    def metrics_token(self) -> str:
        """The bearer token of the `/metrics` endpoints; refused when missing, empty or unsafe."""
        token = read_private(self.metrics_token_path()).decode()
        if not token:
            raise SecretError(f"secret file {self.metrics_token_path()} is empty")
        return token

    def signing_key(self) -> bytes:
        return bytes.fromhex(read_private(self.root / SIGNING_DIR / SCHEDULER_SIGNING_KEY).decode())

    def verify_key(self) -> bytes:
        try:
            return bytes.fromhex((self.root / SIGNING_DIR / SCHEDULER_VERIFY_KEY).read_text().strip())
        except (OSError, ValueError):
            raise SecretError(
                f"the scheduler's public key is missing under {self.root / SIGNING_DIR}"
            ) from None

    def ensure(self, nats_identities: tuple[str, ...], redis_identities: tuple[str, ...]) -> None:
        """Create whatever is missing (existing credentials are kept: rotation is explicit)."""
        from nacl.signing import SigningKey

        _private_dir(self.root)
        for identity in nats_identities:
            write_once(self.seed_path(identity), new_nkey_seed())
        for identity in redis_identities:
            write_once(self.password_path(identity), _random.token_urlsafe(32).encode())
        for name in TOKENS:
            write_once(self.token_path(name), _random.token_urlsafe(32).encode())
        seed = _random.token_bytes(32)
        if write_once(self.root / SIGNING_DIR / SCHEDULER_SIGNING_KEY, seed.hex().encode()):
            public = SigningKey(seed).verify_key.encode().hex()
            (self.root / SIGNING_DIR / SCHEDULER_VERIFY_KEY).write_text(public + "\n")

    def rotate_nats(self, identity: str) -> None:
        """A new seed for `identity`; the server config must be written again and reloaded."""
        path = self.seed_path(identity)
        tmp = path.with_suffix(".new")
        tmp.unlink(missing_ok=True)
        write_once(tmp, new_nkey_seed())
        os.replace(tmp, path)

    def rotate_redis(self, identity: str) -> None:
        path = self.password_path(identity)
        tmp = path.with_suffix(".new")
        tmp.unlink(missing_ok=True)
        write_once(tmp, _random.token_urlsafe(32).encode())
        os.replace(tmp, path)

"""The stored login: `$ECC_CONFIG_DIR/credentials.json` (default ~/.config/ecc), mode 0600: the
account, its API key and, when login was given one (`--ca`, ITO_NATS_CA), the absolute path of the
CA file that later calls verify the server's TLS with."""

import json
import os
import pathlib

ENV_CONFIG_DIR = "ECC_CONFIG_DIR"
FILE_NAME = "credentials.json"


def config_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(ENV_CONFIG_DIR) or pathlib.Path.home() / ".config" / "ecc")


def path() -> pathlib.Path:
    return config_dir() / FILE_NAME


def save(account: str, api_key: str, ca: str | None = None) -> pathlib.Path:
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = target.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump({"account": account, "api_key": api_key, **({"ca": ca} if ca else {})}, f)
    os.replace(tmp, target)
    return target


def load() -> tuple[str, str] | None:
    try:
        raw = json.loads(path().read_text())
        return raw["account"], raw["api_key"]
    except (OSError, ValueError, KeyError):
        return None


def load_ca() -> str | None:
    """The CA file recorded at login, or None."""
    try:
        ca = json.loads(path().read_text()).get("ca")
        return ca if isinstance(ca, str) and ca else None
    except (OSError, ValueError, AttributeError):
        return None


def remove() -> bool:
    try:
        path().unlink()
        return True
    except FileNotFoundError:
        return False

"""The backend's model store: base models (Hugging Face directories) and tokenizers, by content
digest. Filled by the operator (`ito-training models add PATH`), read by the scheduler at plan time
and by the trainer before it loads weights.

Layout under the root (`ITO_MODEL_STORE`, default `<ITO_DATA_DIR>/models`):

    <hex>/                 one base model: the HF directory's files, as added, plus MODEL.json
    <hex>/MODEL.json       the `BaseModel` the planner reads and every file's sha256 (`Recorded`)
    tokenizers/<hex>/      a tokenizer: tokenizer.json (+ tokenizer_config.json) and TOKENIZER.json
    names.json             {name: {"digest": "sha256:<hex>", "accounts": [...]}}; a tenant's own
                           model (`ecc ito models upload`, a run's export) as "@<account>/<name>"

The content digest is sha256 over the sorted lines "<relative path>\\0<sha256 of the file>\\n" of
every file but the store's own record (MODEL.json / TOKENIZER.json): stable, independent of the
order files were written in, and the same on every machine. Names point to digests (names.json),
so the same content added twice is one directory, and a name can be moved to new content (a
manifest pinned to the old revision is then refused: that is what the revision is for). Which
accounts may use a model is the name's: `accounts: []` is every account's. A tenant's own model is
named under its account ("@<account>/<name>": no manifest or operator name can be one), so the same
name in two accounts is two models, and only its account resolves or lists it; an account's own
name comes before a shared one of the same name.

Writes are atomic: a model is copied into a temporary directory under the root, checked, and
renamed into place; names.json is replaced by rename under a lock file. Modes are the trainer's
(files 0600, directories 0700): every service runs as the one service user (one image, one data
volume in compose.yaml), so the scheduler and the trainer both read what the operator verb wrote
as that user.

Adding checks what planning relies on, reading only metadata: config.json must be a family the
trainer reproduces (`shape_from_hf_config`), the weights (model.safetensors, or an index whose
every shard is present) must hold exactly the tensors of that shape (safetensors headers: the
8-byte length and the JSON header, never the tensors), and symlinks or files outside the directory
are refused.
"""

from __future__ import annotations  # `ModelStore.list` shadows the builtin in the class body

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import struct
import tempfile
from collections.abc import Collection, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec

from contracts.models import BaseModel, ModelShape
from domain.model_shapes import UnsupportedConfig, count_parameters, head_dim, shape_from_hf_config

RECORD = "MODEL.json"
TOKENIZER_RECORD = "TOKENIZER.json"
NAMES = "names.json"
TOKENIZERS = "tokenizers"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HASH_CHUNK = 4 * 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024  # a safetensors JSON header; real ones are well under 1 MiB
MAX_CONFIG_BYTES = 1024 * 1024  # config.json, tokenizer_config.json, an index
WEIGHT_DTYPES = ("F32", "F16", "BF16")  # what the trainer loads; quantized checkpoints are refused
DIR_MODE, FILE_MODE = 0o700, 0o600
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,255}")  # what manifests name as model.base
RUN_NAME_RE = re.compile(r"run:run_[0-9a-f]{24}/[a-z_]{1,32}")  # a tenant's run stage, once exported


class ModelStoreError(ValueError):
    """A checkpoint or tokenizer the store refuses, or an entry that no longer checks out; the
    message names the file (and the config key, `key`, when config.json is at fault)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class StoredFile(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # relative to the entry's directory, "/"-separated
    bytes: int
    sha256: str  # hex


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """MODEL.json: the entry as added (its name is the first name it was added under) and its files."""

    model: BaseModel
    files: list[StoredFile]


class TokenizerEntry(msgspec.Struct, frozen=True, kw_only=True):
    """TOKENIZER.json: a stored tokenizer as the planner sees it."""

    digest: str
    vocab: int  # with added tokens: the embedding rows it needs
    chat_template: bool = False
    eos_token: str | None = None
    files: list[StoredFile] = []
    added_at: str = ""


class NameEntry(msgspec.Struct, frozen=True, kw_only=True):
    digest: str
    accounts: list[str] = []
    owner: str = ""  # a tenant's own model: its account ("" for the operator's shared ones)


def own_key(account: str, name: str) -> str:
    """names.json's key of `account`'s own model `name`."""
    return f"@{account}/{name}"


_names_decoder = msgspec.json.Decoder(dict[str, NameEntry])
_record_decoder = msgspec.json.Decoder(Recorded)
_tokenizer_decoder = msgspec.json.Decoder(TokenizerEntry)
_encoder = msgspec.json.Encoder()


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def content_digest(files: list[StoredFile]) -> str:
    """ "sha256:<hex>" over the sorted "<path>\\0<sha256>\\n" lines of `files`."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.sha256}\n".encode())
    return "sha256:" + h.hexdigest()


def _hex(digest: str) -> str:
    hexpart = digest.removeprefix("sha256:")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ModelStoreError(f"{digest!r} is not a digest (sha256:<64 hex digits>).")
    return hexpart


def _files(src: pathlib.Path, skip: str | frozenset[str]) -> list[pathlib.Path]:
    """Every regular file under `src` (relative), refusing symlinks and anything else odd; `skip`:
    top-level names that are not the model's (the store's record, an export's control files)."""
    skipped = {skip} if isinstance(skip, str) else set(skip)
    found: list[pathlib.Path] = []
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        here = pathlib.Path(dirpath)
        for name in dirnames + filenames:
            p = here / name
            rel = p.relative_to(src)
            if p.is_symlink():
                raise ModelStoreError(f"{rel} is a symlink; the store copies regular files only.")
            if name in dirnames:
                continue
            if not p.is_file():
                raise ModelStoreError(f"{rel} is not a regular file.")
            if rel.as_posix() not in skipped:
                found.append(rel)
    return sorted(found)


def _json(path: pathlib.Path, what: str) -> Any:
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelStoreError(f"{what} is larger than {MAX_CONFIG_BYTES} bytes.")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        raise ModelStoreError(f"{what} is not valid JSON.") from None


def safetensors_header(path: pathlib.Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: {tensor name: {dtype, shape, data_offsets}}, and
    `__metadata__`. Reads the 8-byte length and the header only, never the tensors."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelStoreError(f"{path.name} is not a safetensors file (too short).")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n > path.stat().st_size - 8:
            raise ModelStoreError(f"{path.name} is not a safetensors file (header length {n}).")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ModelStoreError(f"{path.name}'s safetensors header is not JSON.") from None
    if not isinstance(header, dict):
        raise ModelStoreError(f"{path.name}'s safetensors header is not an object.")
    return header


def expected_tensors(shape: ModelShape) -> dict[str, list[int]]:
    """Every tensor of `shape` in Hugging Face names, with its shape (lm_head absent when tied)."""
    d, hd = shape.d_model, head_dim(shape)
    q, kv = shape.n_head * hd, shape.n_kv_head * hd
    want: dict[str, list[int]] = {
        "model.embed_tokens.weight": [shape.vocab_size, d],
        "model.norm.weight": [d],
    }
    if not shape.tie_embeddings:
        want["lm_head.weight"] = [shape.vocab_size, d]
    for i in range(shape.n_layer):
        p = f"model.layers.{i}."
        want |= {
            p + "input_layernorm.weight": [d],
            p + "post_attention_layernorm.weight": [d],
            p + "self_attn.q_proj.weight": [q, d],
            p + "self_attn.k_proj.weight": [kv, d],
            p + "self_attn.v_proj.weight": [kv, d],
            p + "self_attn.o_proj.weight": [d, q],
            p + "mlp.gate_proj.weight": [shape.d_ff, d],
            p + "mlp.up_proj.weight": [shape.d_ff, d],
            p + "mlp.down_proj.weight": [d, shape.d_ff],
        }
        if shape.attention_bias:
            want |= {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv]}
            want[p + "self_attn.v_proj.bias"] = [kv]
        if shape.qk_norm:
            want |= {p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]}
    return want


def _weight_files(src: pathlib.Path) -> list[str]:
    """The safetensors files that hold the weights: model.safetensors, or every shard an index names."""
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = src / "model.safetensors.index.json"
    if not index.is_file():
        raise ModelStoreError("no weights: model.safetensors or model.safetensors.index.json is needed.")
    weight_map = _json(index, "model.safetensors.index.json").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelStoreError("model.safetensors.index.json has no weight_map.")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or not (src / shard).is_file():
            raise ModelStoreError(f"the index names shard {shard!r}, which is not in the directory.")
    return shards


def check_weights(src: pathlib.Path, shape: ModelShape) -> None:
    """Every tensor the shape has, each with its shape and a dtype the trainer loads; no other."""
    want = expected_tensors(shape)
    seen: set[str] = set()
    for name in _weight_files(src):
        for tensor, info in safetensors_header(src / name).items():
            if tensor == "__metadata__":
                continue
            if tensor.endswith("rotary_emb.inv_freq"):  # older checkpoints keep RoPE's buffer: recomputed
                continue
            if tensor == "lm_head.weight" and shape.tie_embeddings:  # a tied head saved anyway
                want[tensor] = [shape.vocab_size, shape.d_model]
            if tensor not in want:
                raise ModelStoreError(f"{name}: tensor {tensor} is not part of a {_describe(shape)} model.")
            if list(info.get("shape", [])) != want[tensor]:
                raise ModelStoreError(
                    f"{name}: tensor {tensor} has shape {info.get('shape')}; config.json implies {want[tensor]}."
                )
            if info.get("dtype") not in WEIGHT_DTYPES:
                raise ModelStoreError(
                    f"{name}: tensor {tensor} is {info.get('dtype')}; the trainer loads {', '.join(WEIGHT_DTYPES)}."
                )
            seen.add(tensor)
    missing = sorted(set(want) - seen - ({"lm_head.weight"} if shape.tie_embeddings else set()))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelStoreError(f"the weights lack {', '.join(missing[:3])}{more}.")


def _describe(shape: ModelShape) -> str:
    return f"{shape.n_layer}-layer d_model {shape.d_model}"


def tokenizer_facts(src: pathlib.Path) -> tuple[int | None, bool, str | None]:
    """(vocabulary with added tokens, has a chat template, eos token) of a directory's tokenizer
    files; (None, False, None) when it has no tokenizer.json."""
    path = src / "tokenizer.json"
    if not path.is_file():
        return None, False, None
    from tokenizers import Tokenizer  # here: the scheduler's plan path never loads it

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the Rust library raises its own exception type
        raise ModelStoreError(f"tokenizer.json cannot be loaded: {str(exc)[:200]}") from None
    chat, eos = False, None
    config_path = src / "tokenizer_config.json"
    if config_path.is_file():
        config = _json(config_path, "tokenizer_config.json")
        if isinstance(config, dict):
            chat = bool(config.get("chat_template"))
            raw = config.get("eos_token")
            eos = raw.get("content") if isinstance(raw, dict) else raw if isinstance(raw, str) else None
    return vocab, chat, eos


def _record_files(src: pathlib.Path, skip: str | frozenset[str]) -> list[StoredFile]:
    return [
        StoredFile(path=rel.as_posix(), bytes=(src / rel).stat().st_size, sha256=sha256_of(src / rel))
        for rel in _files(src, skip)
    ]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write(path: pathlib.Path, data: bytes) -> None:
    """Write by rename: a reader sees the old bytes or the new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


Files = list[StoredFile]  # named outside the class, where `list` is still the builtin


class ModelStore:
    """Base models and tokenizers under `root`, by content digest (see the module docstring)."""

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)

    # --- reads (the scheduler's plan path: small files only) ---

    def path(self, digest: str) -> pathlib.Path:
        """The HF directory of the model with this digest (it may not exist)."""
        return self.root / _hex(digest)

    def tokenizer_path(self, digest: str) -> pathlib.Path:
        return self.root / TOKENIZERS / _hex(digest)

    def names(self) -> dict[str, NameEntry]:
        path = self.root / NAMES
        if not path.is_file():
            return {}
        return _names_decoder.decode(path.read_bytes())

    def record(self, digest: str) -> Recorded | None:
        path = self.path(digest) / RECORD
        if not path.is_file():
            return None
        return _record_decoder.decode(path.read_bytes())

    def _entry(self, name: str, named: NameEntry) -> BaseModel | None:
        rec = self.record(named.digest)
        if rec is None:
            return None
        return msgspec.structs.replace(rec.model, name=name, accounts=list(named.accounts))

    def list(self, account: str | None = None) -> list[BaseModel]:
        """Every named model `account` may use, by name: its own (under their plain names) and the
        shared ones it may use (an own name hides a shared one of the same name). None: every model,
        tenants' own ones under their "@<account>/<name>" keys (the operator's view)."""
        names = self.names()
        if account is None:
            found = [self._entry(name, named) for name, named in sorted(names.items())]
            return [e for e in found if e is not None]
        prefix = own_key(account, "")
        own = {key.removeprefix(prefix): named for key, named in names.items() if key.startswith(prefix)}
        shared = {
            name: named
            for name, named in names.items()
            if not named.owner
            and not name.startswith("@")
            and (not named.accounts or account in named.accounts)
        }
        found = [self._entry(name, named) for name, named in sorted((shared | own).items())]
        return [e for e in found if e is not None]

    def resolve(self, name: str, account: str) -> BaseModel | None:
        """The model `name` as `account` may use it (its own first, then a shared one), or None (no
        such name, or not this account's: the two are not told apart, so a name leaks nothing)."""
        names = self.names()
        named = names.get(own_key(account, name))
        if named is not None:
            return self._entry(name, named)
        if name.startswith("@"):
            return None
        named = names.get(name)
        if named is None or named.owner or (named.accounts and account not in named.accounts):
            return None
        return self._entry(name, named)

    def tokenizer(self, digest: str) -> TokenizerEntry | None:
        try:
            path = self.tokenizer_path(digest) / TOKENIZER_RECORD
        except ModelStoreError:
            return None
        if not path.is_file():
            return None
        return _tokenizer_decoder.decode(path.read_bytes())

    def verify(self, digest: str) -> None:
        """Re-hash every file of the model `digest` and compare with MODEL.json: for the trainer
        before it loads (gigabytes: seconds to minutes). Plan time does not call this: it compares
        the manifest's revision with the recorded digest and re-reads config.json only.
        ModelStoreError names the first file that differs, is missing or was added."""
        rec = self.record(digest)
        if rec is None:
            raise ModelStoreError(f"no model {digest} in the store.")
        src = self.path(digest)
        now = {f.path: f for f in _record_files(src, RECORD)}
        for f in rec.files:
            found = now.pop(f.path, None)
            if found is None:
                raise ModelStoreError(f"{f.path} of {digest} is missing.")
            if found.sha256 != f.sha256:
                raise ModelStoreError(f"{f.path} of {digest} changed since it was added.")
        if now:
            raise ModelStoreError(f"{sorted(now)[0]} was added to {digest} after it was stored.")
        if content_digest(rec.files) != digest:
            raise ModelStoreError(f"MODEL.json of {digest} does not record that digest.")

    # --- writes (the operator verb) ---

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def add(
        self,
        path: pathlib.Path,
        name: str | None = None,
        accounts: Sequence[str] = (),
        owner: str | None = None,
        ignore: Collection[str] = (),
        link: bool = False,
    ) -> BaseModel:
        """Check and copy the HF directory at `path` in; point `name` (default: the directory's
        name) at it for `accounts` ([] = every account), or, with `owner`, as that account's own
        model (only it may use it; a run's export is named `run:<run id>/<stage>`). The same
        content again is the same entry; its name's accounts are replaced by these. `ignore`:
        top-level files that are not the model's (an export's record); `link`: hard-link the files
        in where the filesystem allows (an export the trainer wrote and never changes)."""
        src = pathlib.Path(path)
        if src.is_symlink() or not src.is_dir():
            raise ModelStoreError(f"{src} is not a directory.")
        name = name or src.resolve().name
        if not NAME_RE.fullmatch(name) and not (owner and RUN_NAME_RE.fullmatch(name)):
            raise ModelStoreError(
                f"name {name!r}: use 1-256 letters, digits and . _ - / (as `--name` or the directory's name)."
            )
        files = _record_files(src, frozenset({RECORD, *ignore}))
        if not (src / "config.json").is_file():
            raise ModelStoreError("no config.json: a base model is a Hugging Face directory.")
        try:
            hf = shape_from_hf_config(_json(src / "config.json", "config.json"))
        except UnsupportedConfig as exc:
            raise ModelStoreError(f"config.json's {exc.key}: {exc}", key=exc.key) from None
        check_weights(src, hf.shape)
        vocab, chat, eos = tokenizer_facts(src)
        digest = content_digest(files)
        model = BaseModel(
            name=name,
            digest=digest,
            family=hf.family,
            architecture=hf.architecture,
            shape=hf.shape,
            parameters=count_parameters(hf.shape),
            tokenizer_vocab=vocab,
            chat_template=chat,
            eos_token=eos,
            bytes=sum(f.bytes for f in files),
            accounts=list(accounts),
            added_at=_now(),
        )
        with self._locked():
            dest = self.path(digest)
            if self.record(digest) is None:
                record = _encoder.encode(Recorded(model=model, files=files))
                self._copy_in(src, files, dest, RECORD, record, link=link)
            self._name(name, digest, accounts, owner)
        entry = self.resolve(name, owner or next(iter(accounts), ""))
        assert entry is not None, "just stored"
        return entry

    def _name(self, name: str, digest: str, accounts: Sequence[str], owner: str | None) -> None:
        """Point `name` at `digest` (under the store's lock)."""
        names = self.names()
        if owner:
            names[own_key(owner, name)] = NameEntry(digest=digest, accounts=[owner], owner=owner)
        else:
            names[name] = NameEntry(digest=digest, accounts=sorted(set(accounts)))
        _write(self.root / NAMES, _encoder.encode(dict(sorted(names.items()))))

    def add_tokenizer(self, path: pathlib.Path) -> TokenizerEntry:
        """A tokenizer-only directory (tokenizer.json, optionally tokenizer_config.json), by digest."""
        src = pathlib.Path(path)
        if src.is_symlink() or not src.is_dir():
            raise ModelStoreError(f"{src} is not a directory.")
        _files(src, TOKENIZER_RECORD)  # refuses symlinks anywhere inside
        if not (src / "tokenizer.json").is_file():
            raise ModelStoreError("no tokenizer.json in the directory.")
        kept = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        files = [StoredFile(path=f, bytes=(src / f).stat().st_size, sha256=sha256_of(src / f)) for f in kept]
        vocab, chat, eos = tokenizer_facts(src)
        assert vocab is not None, "tokenizer.json is there"
        digest = content_digest(files)
        entry = TokenizerEntry(
            digest=digest, vocab=vocab, chat_template=chat, eos_token=eos, files=files, added_at=_now()
        )
        with self._locked():
            dest = self.tokenizer_path(digest)
            if self.tokenizer(digest) is None:
                dest.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
                self._copy_in(src, files, dest, TOKENIZER_RECORD, _encoder.encode(entry))
        stored = self.tokenizer(digest)
        assert stored is not None, "just stored"
        return stored

    def _copy_in(
        self,
        src: pathlib.Path,
        files: Files,
        dest: pathlib.Path,
        record: str,
        data: bytes,
        link: bool = False,
    ) -> None:
        """Copy (or, `link`, hard-link) `files` into a temporary directory beside `dest`, check each
        copy's hash, write the record, and rename the directory into place."""
        tmp = pathlib.Path(tempfile.mkdtemp(dir=dest.parent, prefix=".adding-"))
        try:
            for f in files:
                target = tmp / f.path
                target.parent.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
                try:
                    if not link:
                        raise OSError("copy")
                    os.link(src / f.path, target, follow_symlinks=False)
                except OSError:
                    shutil.copyfile(src / f.path, target, follow_symlinks=False)
                os.chmod(target, FILE_MODE)
                if sha256_of(target) != f.sha256:
                    raise ModelStoreError(f"{f.path} changed while it was copied; add it again.")
            (tmp / record).write_bytes(data)
            os.chmod(tmp / record, FILE_MODE)
            os.chmod(tmp, DIR_MODE)
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


class AddOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What `python -m runtime.storage.model_store add` prints: the model, or why not."""

    model: BaseModel | None = None
    error: str | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """`add --root ROOT --owner ACCOUNT --name NAME DIR`: a tenant's upload checked and stored in a
    process of its own (the scheduler's `models upload` commit: a hostile checkpoint's headers and
    tokenizer are parsed here, bounded by the caller's time limit, never in the service)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="model_store")
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add")
    add.add_argument("--root", required=True, type=pathlib.Path)
    add.add_argument("--owner", required=True)
    add.add_argument("--name", required=True)
    add.add_argument("directory", type=pathlib.Path)
    args = parser.parse_args(argv)
    try:
        model = ModelStore(args.root).add(args.directory, name=args.name, owner=args.owner)
        outcome = AddOutcome(model=model)
    except ModelStoreError as exc:
        outcome = AddOutcome(error=str(exc))
    sys.stdout.buffer.write(_encoder.encode(outcome))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

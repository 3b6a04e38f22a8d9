"""What an export's files are, as both ends check them: the trainer that writes and serves them
(services/trainer/exports.py) and `ecc ito download`, which writes them on the user's machine
(ecc/download.py). Pure: no I/O, no torch (the client imports this).

- An export id is "<stage>-<format>" (`dpo-hf`, `sft-peft`).
- A file's path is a plain relative path: no absolute path, no `..` or `.`, no empty part, no
  backslash or NUL, at most MAX_PATH_CHARS.
- The export digest is "sha256:" over the sorted "<path>\\0<sha256>\\n" lines of its files.
- A file of `size` bytes downloads in ceil(size / DOWNLOAD_CHUNK_MAX) chunks from the offset a
  `.part` file already holds.
"""

import hashlib
from collections.abc import Iterable

from contracts.exports import DOWNLOAD_CHUNK_MAX, ExportFile, ExportFormat

MAX_PATH_CHARS = 512  # an export's file names are a handful of short names; anything longer is not one


def export_id(stage: str, fmt: ExportFormat) -> str:
    return f"{stage}-{fmt.value}"


def parse_export_id(value: str) -> tuple[str, ExportFormat] | None:
    """(stage, format) of "<stage>-<format>", or None when it is not one (a stage name is
    lower-case letters and underscores: pretrain, long_context, sft, ...)."""
    stage, sep, fmt = value.rpartition("-")
    if not sep or not stage or not all(c.islower() or c == "_" for c in stage):
        return None
    try:
        return stage, ExportFormat(fmt)
    except ValueError:
        return None


def safe_relative(path: str) -> bool:
    """Is `path` a plain relative path below a directory?"""
    if not path or len(path) > MAX_PATH_CHARS or "\0" in path or "\\" in path or path.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def export_digest(files: Iterable[ExportFile]) -> str:
    lines = "".join(f"{f.path}\0{f.sha256}\n" for f in sorted(files, key=lambda f: f.path))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def chunks(size: int, start: int = 0, chunk: int = DOWNLOAD_CHUNK_MAX) -> list[tuple[int, int]]:
    """(offset, length) of every chunk from `start` to the end of a file of `size` bytes."""
    if size < 0 or start < 0 or chunk < 1:
        raise ValueError("Sizes and offsets must be >= 0 and a chunk at least 1 byte.")
    return [(offset, min(chunk, size - offset)) for offset in range(start, size, chunk)]

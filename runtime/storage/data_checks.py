"""A data file checked whole, before anyone pays for it: its bytes and SHA-256, its rows, the kinds
of row it holds, and every problem a stage would meet reading it, each at its 1-based line (JSONL,
text) or row (Parquet): bytes that are not UTF-8, a line that is not JSON, a role no chat template
knows, a column of the wrong type, rows of different kinds (domain/data_rows.py says what
a good row is). An upload is checked when it is committed; a `file:` or `s3://` ref when it is
planned (remembered while its bytes are the same).

The check runs in a child process (`run_check`): it reads the file from its standard input (a
descriptor the service opened safely; the child opens no path), is killed past its time bound,
and its memory is capped, so a hostile file costs a bounded amount of one process's work and
never the service's event loop. What comes back is decoded into `DataReport` at the edge. An
instance runs a few checks at once (`CheckSlots`: half its cores, one per account); the others
wait their turn.

    python -m runtime.storage.data_checks --format jsonl < FILE   # prints the report (JSON)
"""

import argparse
import asyncio
import contextlib
import hashlib
import os
import resource
import sys
from collections.abc import AsyncIterator, Iterator
from typing import IO, Any

import msgspec

from contracts.files import MAX_PROBLEMS, DataReport
from contracts.manifest import DataFormat
from domain import data_rows

READ_BLOCK = 4 * 1024 * 1024
PARQUET_BATCH = 4096
MAX_LINE_BYTES = 64 * 1024 * 1024  # one JSONL row; pyarrow's largest block (data_files.JSONL_MAX_BLOCK)
BASE_TIMEOUT_S = 60.0  # the check's time bound: this, plus PER_GB_TIMEOUT_S per GB of the file
PER_GB_TIMEOUT_S = 120.0
MEMORY_LIMIT_BYTES = 4 << 30  # the child's address space; a row batch is small, a hostile file is not
MAX_ROW_GROUP_BYTES = 512 << 20  # a Parquet row group (uncompressed): the trainer reads one whole
_report_decoder = msgspec.json.Decoder(DataReport)


class CheckFailed(Exception):
    """The check itself did not finish (time bound, memory, a crash): the message is safe to show."""


class _Findings:
    """Problems (the first MAX_PROBLEMS, then a count), the rows and their kinds."""

    def __init__(self, unit: str) -> None:
        self.unit = unit  # "line" or "row"
        self.problems: list[str] = []
        self.more = 0
        self.rows = 0
        self.kinds: frozenset[str] | None = None  # the first good row's
        self.kinds_at = 0
        self.columns: list[str] = []

    def add(self, at: int, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{self.unit} {at}: {text}")
        else:
            self.more += 1

    def row(self, at: int, row: Any) -> None:
        self.rows += 1
        problems = data_rows.row_problems(row)
        for problem in problems:
            self.add(at, problem)
        if problems:
            return
        kinds = data_rows.row_kinds(row)
        if self.kinds is None:
            self.kinds, self.kinds_at = kinds, at
            self.columns = sorted(str(k) for k in row)
            return
        mismatch = data_rows.kinds_problem(self.kinds, self.kinds_at, kinds, self.unit)
        if mismatch is not None:
            self.add(at, mismatch)

    def report(self, fmt: DataFormat, size: int, sha256: str) -> DataReport:
        return DataReport(
            format=fmt,
            bytes=size,
            sha256=sha256,
            rows=self.rows,
            kinds=sorted(self.kinds or ()),
            columns=self.columns,
            problems=self.problems,
            more_problems=self.more,
        )


def _lines(f: IO[bytes], digest: Any) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, the line without its newline) of a file read in blocks, hashing every
    byte on the way. A line longer than MAX_LINE_BYTES is cut there (and reported as too long)."""
    carry, number = b"", 0
    while block := f.read(READ_BLOCK):
        digest.update(block)
        carry += block
        *complete, carry = carry.split(b"\n")
        for line in complete:
            number += 1
            yield number, line
        if len(carry) > MAX_LINE_BYTES:
            number += 1
            yield number, carry[: MAX_LINE_BYTES + 1]
            carry = b""  # the rest of the over-long line is skipped
            while block := f.read(READ_BLOCK):
                digest.update(block)
                end = block.find(b"\n")
                if end >= 0:
                    carry = block[end + 1 :]
                    break
    if carry:
        yield number + 1, carry


def _not_utf8(line: bytes) -> str | None:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})"
    return None


def check_jsonl(f: IO[bytes]) -> DataReport:
    digest = hashlib.sha256()
    found = _Findings("line")
    for at, line in _lines(f, digest):
        if not line.strip():
            continue  # a blank line is no row (pyarrow skips it too)
        if len(line) > MAX_LINE_BYTES:
            found.add(at, f"longer than {MAX_LINE_BYTES} bytes: one row must fit in one block")
            continue
        if (why := _not_utf8(line)) is not None:
            found.add(at, why)
            continue
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            found.add(at, f"not valid JSON ({exc})")
            continue
        found.row(at, row)
    size = f.tell()
    if not found.problems and found.rows:
        _by_column(f, found)
    if not found.rows and not found.problems:
        found.add(1, "the file holds no rows")
    return found.report(DataFormat.jsonl, size, "sha256:" + digest.hexdigest())


def _by_column(f: IO[bytes], found: _Findings) -> None:
    """Read the file as the trainer does (pyarrow, by column, a block at a time): a file every line
    of which is fine can still change a column's type between rows, which pyarrow refuses."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    f.seek(0)
    block = 1 << 20
    while True:
        try:
            reader = pa_json.open_json(
                f, read_options=pa_json.ReadOptions(block_size=block, use_threads=False)
            )
            for batch in reader:
                columns = [c for c in data_rows.KNOWN_COLUMNS if c in batch.schema.names]
                batch.select(columns).to_pylist()
            return
        except pa.ArrowInvalid as exc:
            if "straddling" in str(exc) and block < MAX_LINE_BYTES:
                block *= 4
                f.seek(0)
                continue
            found.add(1, f"cannot be read by column as the trainer reads it: {str(exc)[:300]}")
            return


def check_parquet(f: IO[bytes]) -> DataReport:
    import pyarrow as pa
    import pyarrow.parquet as pq

    digest = hashlib.sha256()
    while block := f.read(READ_BLOCK):
        digest.update(block)
    size = f.tell()
    f.seek(0)
    found = _Findings("row")
    try:
        parquet = pq.ParquetFile(f)
        groups = parquet.metadata
        for i in range(groups.num_row_groups):
            if (held := groups.row_group(i).total_byte_size) > MAX_ROW_GROUP_BYTES:
                found.add(
                    1,
                    f"row group {i} holds {held:,} bytes uncompressed; a row group is read whole, so "
                    f"at most {MAX_ROW_GROUP_BYTES:,}: write the file with smaller row groups",
                )
                return found.report(DataFormat.parquet, size, "sha256:" + digest.hexdigest())
        columns = [c for c in data_rows.KNOWN_COLUMNS if c in parquet.schema_arrow.names]
        at = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=columns):
            for i, row in enumerate(_rows(batch)):
                if isinstance(row, str):
                    found.add(at + i + 1, row)
                else:
                    found.row(at + i + 1, row)
            at += batch.num_rows
        if not columns:
            names = ", ".join(parquet.schema_arrow.names[:8]) or "none"
            found.add(
                1,
                f"no column a stage reads (text; messages; prompt, chosen, rejected; prompt, answer); its columns: {names}",
            )
    except (pa.ArrowInvalid, OSError) as exc:
        found.add(1, f"not a Parquet file the trainer can read ({str(exc)[:300]})")
    if not found.rows and not found.problems:
        found.add(1, "the file holds no rows")
    return found.report(DataFormat.parquet, size, "sha256:" + digest.hexdigest())


def _rows(batch: Any) -> Iterator[dict[str, Any] | str]:
    """A Parquet batch's rows as dicts; a row whose strings are not UTF-8 as the problem's text."""
    try:
        yield from batch.to_pylist()
        return
    except UnicodeDecodeError:
        pass
    for i in range(batch.num_rows):  # find the rows that are not text, one at a time
        try:
            yield batch.slice(i, 1).to_pylist()[0]
        except UnicodeDecodeError as exc:
            yield f"a string column holds bytes that are not UTF-8 ({exc.reason})"


def check_text(f: IO[bytes]) -> DataReport:
    digest = hashlib.sha256()
    found = _Findings("line")
    lines = 0
    for at, line in _lines(f, digest):
        lines = at
        if (why := _not_utf8(line)) is not None:
            found.add(at, why)
    report = found.report(DataFormat.text, f.tell(), "sha256:" + digest.hexdigest())
    return msgspec.structs.replace(report, rows=lines, kinds=["text"] if not found.problems else [])


CHECKS = {DataFormat.jsonl: check_jsonl, DataFormat.parquet: check_parquet, DataFormat.text: check_text}


def check(f: IO[bytes], fmt: DataFormat) -> DataReport:
    """The report of the file `f` (read from its start) as `fmt`, in this process."""
    return CHECKS[fmt](f)


# --- in a child process ---------------------------------------------------------------------------


class CheckSlots:
    """The checks one instance runs at once: at most `total` (half its cores: a check is one busy
    process) and at most `per_account` of them one account's; the others wait their turn (an
    account's own first, so one account's many uploads never hold every slot)."""

    def __init__(self, total: int | None = None, per_account: int = 1) -> None:
        self.total = total or max(1, (os.cpu_count() or 2) // 2)
        self.per_account = per_account
        self._all: asyncio.Semaphore | None = None
        self._accounts: dict[str, tuple[asyncio.Semaphore, int]] = {}

    @contextlib.asynccontextmanager
    async def held(self, account: str) -> AsyncIterator[None]:
        if self._all is None:
            self._all = asyncio.Semaphore(self.total)
        mine, users = self._accounts.get(account) or (asyncio.Semaphore(self.per_account), 0)
        self._accounts[account] = (mine, users + 1)
        try:
            async with mine, self._all:
                yield
        finally:
            mine, users = self._accounts[account]
            if users == 1:
                del self._accounts[account]
            else:
                self._accounts[account] = (mine, users - 1)


def time_bound(size: int) -> float:
    return BASE_TIMEOUT_S + PER_GB_TIMEOUT_S * size / 1e9


def _limits() -> None:  # in the child, before it runs a line of the check
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


async def run_check(fd: int, fmt: DataFormat, timeout_s: float | None = None) -> DataReport:
    """The report of the open file `fd` (a regular file the caller opened safely) as `fmt`, made by
    a child process that reads it from its standard input; CheckFailed when the child does not
    finish in its time bound (it is killed) or fails."""
    size = os.fstat(fd).st_size
    os.lseek(fd, 0, os.SEEK_SET)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "runtime.storage.data_checks",
        "--format",
        fmt.value,
        stdin=fd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_limits,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s or time_bound(size))
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise CheckFailed(
            f"the check of the file took longer than {timeout_s or time_bound(size):.0f} s"
        ) from None
    if proc.returncode != 0:
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
        raise CheckFailed(f"the check of the file failed ({last[0][:200]})")
    try:
        return _report_decoder.decode(out)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise CheckFailed("the check of the file answered nothing readable") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check a data file read from standard input")
    parser.add_argument("--format", required=True, choices=[f.value for f in DataFormat])
    args = parser.parse_args(argv)
    with open(sys.stdin.fileno(), "rb", closefd=False) as f:
        report = check(f, DataFormat(args.format))
    sys.stdout.buffer.write(msgspec.json.encode(report))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The report is written and flushed: skip the interpreter's teardown, where pyarrow's worker
    # threads can be destroyed while still joinable ("terminate called without an active
    # exception", an abort seen once in CI on a loaded 2-core machine), which turned a finished
    # check into a failed one (`data_schema_invalid` for a good file).
    os._exit(code)
